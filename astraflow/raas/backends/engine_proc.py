"""The torch engine in a process of its own, so the node's Python work never holds its GIL.

A RaaS node's event loop runs workflows, tools, Avro serde and Kafka polling in Python; in the
same process they would take turns with the decoding loop for the interpreter lock. Here the
`SlotEngine` runs in a child interpreter (`python -m astraflow.raas.backends.engine_proc`,
started with `subprocess`, no pickle anywhere) and talks to the node over a socketpair in the
frames of `engine_loop`: requests and cancels in, results out, new weights in as raw tensor
bytes (applied between two decoding steps; the child answers with the version it now serves).

`EngineProcess` is the parent's side: a sender thread (so the event loop never blocks on a
large weights frame) and a reader thread that resolves the callers' futures. When the child
exits, every pending and later request fails with BackendError; closing the parent's socket
ends the child (it also exits if the parent dies). `TorchBackend` starts a new one when a child
dies (`raas.engine_restarts`).
"""

from __future__ import annotations

import argparse
import logging
import queue
import socket
import subprocess
import sys
import threading
from collections.abc import Callable
from typing import Any

import numpy as np

from astraflow.raas.backends.base import GenerateRequest, Generation
from astraflow.raas.backends.engine_loop import (
    EngineLoop,
    engine_stats,
    recv_frame,
    request_frame,
    request_of,
    result_frame,
    send_frame,
    state_frame,
    state_of,
)
from astraflow.raas.backends.engine_spawn import StartedEngine, adopt_or_start, engine_args
from astraflow.raas.backends.slots import BackendError, Finished, load_engine, model_layout
from astraflow.weights.bits import DTYPE_BY_NAME, TensorMeta
from astraflow.weights.layout import ModelLayout

log = logging.getLogger("astraflow.raas.engine")


class EngineProcess:
    """Parent side of one engine process, started by the constructor; `wait_ready()` before use.
    `on_result(rid, Generation | None, error, ttft_s)` and `on_version(version, error)` are called
    from the reader thread; `stats` is the child's last report. `started`: a child started early
    (`engine_spawn`), adopted if its arguments match."""

    def __init__(self, model_dir: str, *, on_result: Callable[[int, Generation | None, str | None, float], None],
                 on_version: Callable[[int, str | None], None], max_batch: int, cache_slots: int | None,
                 device: str | None, version: int, seed: int | None, threads: int | None, batch_wait_s: float,
                 max_cache_lag: int, start_timeout_s: float = 600.0,
                 on_exit: Callable[[], None] | None = None, started: StartedEngine | None = None) -> None:
        self.on_result, self.on_version, self.on_exit = on_result, on_version, on_exit
        self.stats: dict[str, int] = {}
        started = adopt_or_start(engine_args(model_dir, max_batch=max_batch, cache_slots=cache_slots, device=device,
                                             version=version, seed=seed, threads=threads, batch_wait_s=batch_wait_s,
                                             max_cache_lag=max_cache_lag), started)
        self.proc, self.sock = started.proc, started.sock
        self.model_dir, self.start_timeout_s = model_dir, start_timeout_s
        self.alive = False  # True from the child's "ready" until the connection ends
        self._out: queue.SimpleQueue[tuple[dict[str, Any], bytes] | None] = queue.SimpleQueue()
        self._weights: tuple[dict[str, Any], int] | None = None
        self._lock = threading.Lock()
        self._sender = threading.Thread(target=self._send_loop, name="engine-send", daemon=True)
        self._reader = threading.Thread(target=self._read_loop, name="engine-read", daemon=True)

    def wait_ready(self) -> None:
        """Waits for the child's model to load (the caller loads its tokenizer meanwhile)."""
        model_dir, start_timeout_s = self.model_dir, self.start_timeout_s
        self.sock.settimeout(start_timeout_s)
        try:
            first = recv_frame(self.sock)
        except (TimeoutError, OSError) as exc:
            self._kill()
            raise BackendError(f"the engine process did not start within {start_timeout_s:.0f} s: {exc}") from exc
        if first is None or first[0].get("kind") != "ready":
            self._kill()
            why = first[0].get("error") if first else f"it exited with code {self.proc.wait()}"
            raise BackendError(f"the engine process could not load {model_dir}: {why}")
        self.sock.settimeout(None)
        ready = first[0]
        self.hardware: str = ready["hardware"]
        self.layout = ModelLayout({n: TensorMeta(DTYPE_BY_NAME[d], tuple(s)) for n, (d, s) in ready["tensors"].items()},
                                  tuple(tuple(g) for g in ready["groups"]))
        self.alive = True
        self._sender.start()
        self._reader.start()

    def submit(self, rid: int, req: GenerateRequest) -> None:
        if not self.alive:
            raise BackendError("the engine process has exited")
        self._out.put(request_frame(rid, req))

    def cancel(self, rid: int) -> None:
        self._out.put(({"kind": "cancel", "rid": rid}, b""))

    def ask_stats(self) -> None:
        self._out.put(({"kind": "stats"}, b""))

    def offer_weights(self, state: dict[str, Any], version: int) -> None:
        with self._lock:
            self._weights = (state, version)  # serialised by the sender thread; a newer one replaces it
        self._out.put(({"kind": "weights-marker"}, b""))

    def close(self) -> None:
        if not self._sender.is_alive():  # never became ready
            self._kill()
            self.sock.close()
            return
        if self.alive:
            self._out.put(({"kind": "close"}, b""))
        self._out.put(None)
        self._sender.join(timeout=5)
        try:
            # The child leaves between two decoding steps; on a loaded machine its interpreter's
            # teardown (torch) alone has taken over 10 s, and a kill there would end it uncleanly.
            self.proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            self._kill()
        self.sock.close()

    def _kill(self) -> None:
        self.proc.kill()
        self.proc.wait()

    def _send_loop(self) -> None:
        while (item := self._out.get()) is not None:
            head, blob = item
            if head["kind"] == "weights-marker":
                with self._lock:
                    upd, self._weights = self._weights, None
                if upd is None:
                    continue
                try:
                    head, blob = state_frame(*upd)
                except BackendError as exc:
                    self.on_version(upd[1], str(exc))
                    continue
            try:
                send_frame(self.sock, head, blob)
            except OSError:
                return  # the reader sees the end and fails what is pending

    def _read_loop(self) -> None:
        try:
            while (frame := recv_frame(self.sock)) is not None:
                head, blob = frame
                self.stats = head.get("stats", self.stats)
                kind = head["kind"]
                if kind == "done":
                    n = int(head["n"])
                    arr = np.frombuffer(bytes(blob), dtype="<i4", count=3 * n)
                    ids, vers = arr[:n].astype(np.int32), arr[2 * n :].astype(np.int32)
                    lps = arr[n : 2 * n].view("<f4").astype(np.float32)
                    gen = Generation(ids, lps, vers, head["text"], head["finish_reason"])
                    self.on_result(int(head["rid"]), gen, None, float(head["ttft_s"]))
                elif kind == "error":
                    self.on_result(int(head["rid"]), None, str(head["error"]), 0.0)
                elif kind == "version":
                    self.on_version(int(head["version"]), head.get("error"))
        except (OSError, ValueError, BackendError) as exc:
            log.error("engine process connection broke: %s", exc)
        finally:
            self.alive = False
            self.on_result(-1, None, "the engine process has exited", 0.0)  # -1: fail every pending request
            if self.on_exit is not None:
                self.on_exit()


# ---- child -----------------------------------------------------------------------------------------


def _serve(args: argparse.Namespace) -> None:
    sock = socket.socket(fileno=args.fd)
    send_lock = threading.Lock()

    def send(head: dict[str, Any], blob: bytes = b"") -> None:
        with send_lock:
            send_frame(sock, head, blob)

    try:
        import transformers  # noqa: F401  (here, to time it: load_engine imports its Auto* classes)

        log.info("engine process: transformers imported")
        engine, hardware = load_engine(args.model, max_batch=args.max_batch, cache_slots=args.cache_slots,
                                       device=args.device, version=args.version, seed=args.seed,
                                       threads=args.threads, max_cache_lag=args.max_cache_lag)
    except Exception as exc:  # report why, then exit: the parent raises it
        send({"kind": "failed", "error": f"{type(exc).__name__}: {exc}"})
        sys.exit(1)
    log.info("engine process: model loaded")
    tensors, groups = model_layout(engine.model)
    send({"kind": "ready", "hardware": hardware, "tensors": tensors, "groups": groups})

    def emit(f: Finished) -> None:
        send(*result_frame(f, engine_stats(engine)))

    def applied(version: int, error: str | None) -> None:
        send({"kind": "version", "version": version, "error": error, "stats": engine_stats(engine)})

    loop = EngineLoop(engine, emit, applied, batch_wait_s=args.batch_wait_s)

    def read() -> None:
        try:
            while (frame := recv_frame(sock)) is not None:
                head, blob = frame
                kind = head.get("kind")
                if kind == "gen":
                    loop.put("gen", int(head["rid"]), request_of(head, blob))
                elif kind == "cancel":
                    loop.put("cancel", int(head["rid"]))
                elif kind == "weights":
                    loop.offer_weights(state_of(head, blob), int(head["version"]))
                elif kind == "stats":
                    send({"kind": "stats", "stats": engine_stats(engine)})
                elif kind == "close":
                    break
        except (OSError, ValueError, KeyError, BackendError) as exc:
            log.error("engine process: bad frame from the node (%s); stopping", exc)
        loop.put("close")

    threading.Thread(target=read, name="engine-read", daemon=True).start()
    loop.run()


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description="astraflow torch engine process (started by TorchBackend)")
    ap.add_argument("--fd", type=int, required=True)
    ap.add_argument("--model", required=True)
    ap.add_argument("--max-batch", type=int, default=16)
    ap.add_argument("--cache-slots", type=int, default=None)
    ap.add_argument("--device", default=None)
    ap.add_argument("--version", type=int, default=0)
    ap.add_argument("--seed", type=int, default=None)
    ap.add_argument("--threads", type=int, default=None)
    ap.add_argument("--batch-wait-s", type=float, default=0.002)
    ap.add_argument("--max-cache-lag", type=int, default=0)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(levelname)s %(message)s")
    log.info("engine process: modules imported (torch)")  # the start-up's parts are timed from these lines
    _serve(ap.parse_args(argv))


if __name__ == "__main__":
    main()
