"""The loop that drives a `SlotEngine` from one thread, and the wire format of the engine process.

`EngineLoop.run()` alternates: take what arrived (requests, cancels, close), apply the newest
offered weights, run one engine step, hand finished requests to `emit`. New weights are
therefore applied between two decoding steps, never during one, and a rollout in flight pauses
for at most the step that was running when they arrived.

Wire format (parent <-> engine process, a socketpair): a frame is ``>II`` (header length, blob
length), a JSON header, then a blob of raw little-endian array bytes. No pickle: the header is
data only and arrays are rebuilt from declared dtypes and shapes.
"""

from __future__ import annotations

import json
import logging
import queue
import socket
import struct
import threading
import time
from collections.abc import Callable
from typing import Any

import numpy as np
import torch

from astraflow.raas.backends.base import GenerateRequest
from astraflow.raas.backends.slots import BackendError, Finished, SlotEngine

log = logging.getLogger("astraflow.raas.engine")

_FRAME = struct.Struct(">II")
MAX_HEADER = 1 << 20  # a header is a few hundred bytes; anything larger is a broken peer
_DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16, "float64": torch.float64,
           "int64": torch.int64, "int32": torch.int32, "int8": torch.int8, "uint8": torch.uint8, "bool": torch.bool}


class EngineLoop:
    """Runs a SlotEngine; `put` and `offer_weights` may be called from any thread."""

    def __init__(self, engine: SlotEngine, emit: Callable[[Finished], None],
                 on_weights: Callable[[int, str | None], None] = lambda v, e: None, batch_wait_s: float = 0.002) -> None:
        self.engine = engine
        self.emit = emit  # called on the loop's thread for each finished request
        self.on_weights = on_weights  # (version, refusal or None) after each offered version
        self.batch_wait_s = batch_wait_s  # an idle engine waits this long for a group to arrive together
        self._inbox: queue.SimpleQueue[tuple[Any, ...]] = queue.SimpleQueue()
        self._weights: tuple[dict[str, Any], int] | None = None
        self._lock = threading.Lock()

    def put(self, *msg: Any) -> None:
        """("gen", rid, GenerateRequest) | ("cancel", rid) | ("close",)"""
        self._inbox.put(msg)

    def offer_weights(self, state: dict[str, Any], version: int) -> None:
        with self._lock:
            self._weights = (state, version)  # a newer offer replaces one not applied yet
        self._inbox.put(("wake",))

    def run(self) -> None:
        eng = self.engine
        while True:
            msgs = self._take(block=not eng.has_work())
            if any(m[0] == "close" for m in msgs):
                for r in [*eng.waiting, *eng.active]:
                    self.emit(Finished(r.rid, None, "the backend was closed"))
                return
            self._apply_weights()
            for m in msgs:
                if m[0] == "gen":
                    try:
                        eng.submit(m[1], m[2])
                    except BackendError as exc:
                        self.emit(Finished(m[1], None, str(exc)))
                elif m[0] == "cancel":
                    eng.cancel(m[1])
            try:
                done = eng.step()
            except Exception as exc:  # a failed forward must not kill the engine: its requests get the error
                log.exception("engine step failed")
                done = [Finished(r.rid, None, f"generation failed: {exc!r}") for r in [*eng.active]]
                for r in list(eng.active):
                    eng.cancel(r.rid)
                eng.slot_tokens = [[] for _ in range(eng.slots)]  # the cache may be half-written
            for f in done:
                self.emit(f)

    def _take(self, block: bool) -> list[tuple[Any, ...]]:
        msgs: list[tuple[Any, ...]] = []
        if block:
            msgs.append(self._inbox.get())
            # Rollouts started together (a GRPO group) arrive a few hundred microseconds apart:
            # wait a moment so their prompts are admitted, and shared, in one step.
            deadline = time.monotonic() + self.batch_wait_s
            while (left := deadline - time.monotonic()) > 0:
                try:
                    msgs.append(self._inbox.get(timeout=left))
                except queue.Empty:
                    break
        while True:
            try:
                msgs.append(self._inbox.get_nowait())
            except queue.Empty:
                return msgs

    def _apply_weights(self) -> None:
        with self._lock:
            upd, self._weights = self._weights, None
        if upd is not None:
            err = self.engine.load_weights(*upd)
            if err:
                log.error(err)
            self.on_weights(upd[1], err)


# ---- wire ----------------------------------------------------------------------------------------


def send_frame(sock: socket.socket, header: dict[str, Any], blob: bytes | memoryview = b"") -> None:
    head = json.dumps(header).encode()
    sock.sendall(_FRAME.pack(len(head), len(blob)) + head)
    if len(blob):
        sock.sendall(blob)


def recv_frame(sock: socket.socket) -> tuple[dict[str, Any], bytearray] | None:
    """The next frame, or None at end of stream."""
    raw = _recv_exact(sock, _FRAME.size)
    if raw is None:
        return None
    hlen, blen = _FRAME.unpack(raw)
    if hlen > MAX_HEADER:
        raise BackendError(f"engine frame header of {hlen} bytes: the peer is broken")
    head = _recv_exact(sock, hlen)
    blob = _recv_exact(sock, blen) if blen else bytearray()
    if head is None or blob is None:
        return None
    return json.loads(head), blob


def _recv_exact(sock: socket.socket, n: int) -> bytearray | None:
    buf = bytearray(n)
    view, got = memoryview(buf), 0
    while got < n:
        k = sock.recv_into(view[got:], n - got)
        if k == 0:
            return None
        got += k
    return buf


def request_frame(rid: int, req: GenerateRequest) -> tuple[dict[str, Any], bytes]:
    head = {"kind": "gen", "rid": rid, "max_tokens": int(req.max_tokens), "temperature": float(req.temperature),
            "top_p": float(req.top_p), "stop": [str(s) for s in req.stop]}
    return head, np.asarray(req.prompt_ids, dtype="<i4").tobytes()


def request_of(head: dict[str, Any], blob: bytearray) -> GenerateRequest:
    ids = np.frombuffer(bytes(blob), dtype="<i4").tolist()
    return GenerateRequest(ids, int(head["max_tokens"]), float(head["temperature"]), float(head["top_p"]),
                           [str(s) for s in head["stop"]])


def state_frame(state: dict[str, Any], version: int) -> tuple[dict[str, Any], bytes]:
    """A state dict as (header, blob): names, dtypes, shapes, byte offsets; raw bytes."""
    parts, index, off = [], [], 0
    for name, value in state.items():
        t = torch.as_tensor(value).detach().cpu().contiguous()
        dtype = str(t.dtype).removeprefix("torch.")
        if dtype not in _DTYPES:
            raise BackendError(f"tensor {name} has dtype {dtype}, which the engine process does not take")
        raw = t.view(torch.uint8).numpy().tobytes() if t.numel() else b""
        index.append([name, dtype, list(t.shape), off, len(raw)])
        parts.append(raw)
        off += len(raw)
    return {"kind": "weights", "version": int(version), "tensors": index}, b"".join(parts)


def state_of(head: dict[str, Any], blob: bytearray) -> dict[str, torch.Tensor]:
    out: dict[str, torch.Tensor] = {}
    for name, dtype, shape, off, n in head["tensors"]:
        if dtype not in _DTYPES or off < 0 or off + n > len(blob):
            raise BackendError(f"weights frame: tensor {name} is out of bounds or of an unknown dtype")
        t = torch.frombuffer(blob, dtype=torch.uint8, offset=off, count=n) if n else torch.empty(0, dtype=torch.uint8)
        out[name] = t.view(_DTYPES[dtype]).reshape(shape)
    return out


def result_frame(f: Finished, stats: dict[str, int]) -> tuple[dict[str, Any], bytes]:
    if f.generation is None:
        return {"kind": "error", "rid": f.rid, "error": f.error, "stats": stats}, b""
    g = f.generation
    head = {"kind": "done", "rid": f.rid, "n": len(g.token_ids), "text": g.text, "finish_reason": g.finish_reason,
            "ttft_s": f.ttft_s, "stats": stats}
    blob = (np.asarray(g.token_ids, "<i4").tobytes() + np.asarray(g.logprobs, "<f4").tobytes()
            + np.asarray(g.versions, "<i4").tobytes())
    return head, blob


def engine_stats(engine: SlotEngine) -> dict[str, int]:
    """The engine's counters: forward steps, rows sampled over them, generated / prefilled /
    reused-from-cache tokens, microseconds spent stepping, the version served."""
    return {"steps": engine.steps, "rows_sampled": engine.rows_sampled, "tokens_generated": engine.tokens_generated,
            "prefill_tokens": engine.prefill_tokens, "reused_tokens": engine.reused_tokens,
            "busy_us": int(engine.busy_s * 1e6), "version": engine.version}
