"""`torch` backend: a transformers causal LM from a local directory, continuous batching.

The model runs in a `SlotEngine` (`slots.py`): every decoding step admits new requests into free
rows and releases finished ones, each row with its own sampling parameters, stop conditions and
KV cache; the n samples of a group prefill their shared prompt once, and the next turn of a
multi-turn rollout continues from its cached conversation. Weight updates are applied between
two decoding steps, so rollouts in flight continue with the new weights (their earlier tokens
keep the version that produced them).

Where the engine runs: `process=True` (what `astraflow raas serve` uses) puts it in a child
process (`engine_proc.py`) so the node's workflows, serde and Kafka work never take the
interpreter lock from decoding; `process=False` (the default) runs it in a thread of this
process, and then `.model` is the served model itself (tests and in-process benchmarks use it).

A child that dies (a crash, the OOM killer) is started again, up to `engine_restarts` times: the
requests it was running fail (one of them may be what killed it, so none is retried), the newest
weights handed to the backend are applied to the new child before it takes a request (a version
number keeps meaning one set of weights), and requests that arrive meanwhile wait for it.

The logprob recorded for each token is its log-probability under the distribution it was
sampled from (`sample_tokens`, see `sampling.py`).
"""

from __future__ import annotations

import asyncio
import collections
import concurrent.futures as cf
import itertools
import logging
import threading
import time
from typing import Any

import numpy as np
import torch

from astraflow.raas.backends.base import GenerateRequest, Generation, model_context_length
from astraflow.raas.backends.engine_loop import EngineLoop, engine_stats
from astraflow.raas.backends.engine_spawn import StartedEngine
from astraflow.raas.backends.sampling import sample_tokens
from astraflow.raas.backends.slots import BackendError, Finished, load_engine
from astraflow.weights.layout import ModelLayout

__all__ = ["BackendError", "TorchBackend", "sample_tokens"]

log = logging.getLogger("astraflow.raas.engine")


ENCODED_KEPT = 256  # texts whose ids `TorchBackend.encode` keeps (a node's groups in flight share their prompts)
ENCODED_MAX_CHARS = 8192  # longer texts are encoded each time


class TorchBackend:
    """Serves one policy with transformers + torch (CPU by default, CUDA when present)."""

    name = "torch"

    def __init__(self, policy: str, model_dir: str, *, max_batch: int = 16, device: str | None = None,
                 version: int = 0, seed: int | None = None, threads: int | None = None,
                 batch_wait_s: float = 0.002, process: bool = False, cache_slots: int | None = None,
                 max_cache_lag: int = 0, engine_restarts: int = 3, started: StartedEngine | None = None) -> None:
        """`started`: with `process`, an engine child started early (`engine_spawn.start_engine`)."""
        self.policy = policy
        self.version = version
        self.max_batch = max_batch
        self.process = process
        self.context_length = model_context_length(model_dir)  # prompt + new tokens at most, or None
        self._futures: dict[int, cf.Future] = {}
        self._ids = itertools.count()
        self._lock = threading.Lock()
        self._applied = threading.Condition()
        self.ttft_s: collections.deque[float] = collections.deque(maxlen=100_000)  # submit -> first token, recent
        self._encoded: dict[tuple[str, bool], tuple[int, ...]] = {}  # recent short texts' ids (see `encode`)
        self._encoded_lock = threading.Lock()
        opts = {"max_batch": max_batch, "cache_slots": cache_slots, "device": device, "version": version, "seed": seed,
                "threads": threads, "max_cache_lag": max_cache_lag}
        self.model: Any = None
        self.restarts = 0  # engine processes started again after one died
        self._restarts_left = engine_restarts
        self._closing = False
        self._restarting = False
        self._parked: list[tuple[int, GenerateRequest]] = []  # requests that wait for a restarted engine
        self._newest: tuple[dict[str, Any], int] | None = None  # the last weights handed over (kept for a restart)
        if process:
            from astraflow.raas.backends.engine_proc import EngineProcess

            self._engine_args: dict[str, Any] = {"batch_wait_s": batch_wait_s, **opts}
            self._model_dir = model_dir
            # Started first: the child imports and loads its model while this process loads the tokenizer.
            self._proc: EngineProcess | None = EngineProcess(model_dir, on_result=self._resolve,
                                                            on_version=self._on_version, on_exit=self._engine_exited,
                                                            started=started, **self._engine_args)
            try:
                from transformers import AutoTokenizer

                self.tokenizer = AutoTokenizer.from_pretrained(model_dir)
            except (OSError, ValueError) as exc:
                self._proc.close()
                raise BackendError(f"cannot load a tokenizer from {model_dir}: {exc}") from exc
            self._proc.wait_ready()
            self._hardware = self._proc.hardware
            self._layout = self._proc.layout
        else:
            if started is not None:  # in this process: a child started for it is not needed
                started.close()
            self._proc = None
            self.engine, self._hardware = load_engine(model_dir, **opts)
            self.model, self.tokenizer = self.engine.model, self.engine.tokenizer
            self._loop = EngineLoop(self.engine, self._emit, self._on_version, batch_wait_s=batch_wait_s)
            self._thread = threading.Thread(target=self._loop.run, name=f"torch-backend-{policy}", daemon=True)
            self._thread.start()

    # ---- public API ----------------------------------------------------------------------------

    def encode(self, text: str, *, add_bos: bool = False) -> list[int]:
        """The token ids of `text` (a new list each call). The last `ENCODED_KEPT` texts of up to
        `ENCODED_MAX_CHARS` are remembered: the n samples of a group each encode the same prompt."""
        if len(text) > ENCODED_MAX_CHARS:
            return self.tokenizer.encode(text, add_special_tokens=add_bos)
        key = (text, add_bos)
        ids = self._encoded.get(key)
        if ids is None:
            ids = tuple(self.tokenizer.encode(text, add_special_tokens=add_bos))
            with self._encoded_lock:
                self._encoded[key] = ids
                if len(self._encoded) > ENCODED_KEPT:
                    del self._encoded[next(iter(self._encoded))]  # the oldest
        return list(ids)

    def decode(self, ids: list[int] | np.ndarray) -> str:
        return self.tokenizer.decode([int(i) for i in ids], skip_special_tokens=True)

    async def generate(self, request: GenerateRequest) -> Generation:
        return await asyncio.wrap_future(self._submit(request))

    def generate_sync(self, request: GenerateRequest) -> Generation:
        return self._submit(request).result()

    def update_weights(self, state_dict: dict[str, Any], version: int) -> None:
        """Queues new weights (the newest replaces one not applied yet); applied between two steps."""
        if self._proc is not None:
            with self._lock:
                self._newest = (state_dict, version)
                if self._restarting:
                    return  # the restart applies the newest weights before it takes requests
                proc = self._proc
            proc.offer_weights(state_dict, version)
        else:
            self._loop.offer_weights(state_dict, version)

    def wait_version(self, version: int, timeout_s: float) -> bool:
        """Waits until `version` (or a later one) is served; False on timeout."""
        with self._applied:
            return self._applied.wait_for(lambda: self.version >= version, timeout_s)

    def state_dict(self) -> dict[str, torch.Tensor]:
        if self.model is None:
            raise BackendError("the engine runs in its own process: its weights are not readable here; "
                               "use TorchBackend(..., process=False) to read them")
        return {k: v.detach() for k, v in self.model.state_dict().items()}

    def weight_layout(self) -> ModelLayout:
        """Names, shapes and dtypes of the model's tensors: what a weight follower checks payloads against."""
        if self._proc is not None:
            return self._layout
        return ModelLayout.of(self.model.state_dict())

    def hardware(self) -> str:
        return self._hardware

    def stats(self) -> dict[str, int]:
        """Engine counters (`engine_loop.engine_stats`): forward steps, rows sampled, generated /
        prefilled / reused-from-cache tokens, time spent stepping, version."""
        if self._proc is not None:
            return dict(self._proc.stats)
        return engine_stats(self.engine)

    def refresh_stats(self) -> None:
        """Process engine: asks the child for its counters (they arrive with its answer)."""
        if self._proc is not None:
            self._proc.ask_stats()

    @property
    def tokens_generated(self) -> int:
        return self.stats().get("tokens_generated", 0)

    @property
    def decode_steps(self) -> int:
        return self.stats().get("steps", 0)

    def close(self) -> None:
        if self._proc is not None:
            with self._lock:
                self._closing = True
                parked, self._parked = self._parked, []
            for rid, _ in parked:
                self._resolve(rid, None, "the backend is closing", 0.0)
            self._proc.close()
        else:
            self._loop.put("close")
            self._thread.join(timeout=10)

    # ---- plumbing ------------------------------------------------------------------------------

    def _submit(self, request: GenerateRequest) -> cf.Future:
        rid = next(self._ids)
        fut: cf.Future = cf.Future()
        with self._lock:
            self._futures[rid] = fut
        fut.add_done_callback(lambda f, rid=rid: self._cancelled(rid) if f.cancelled() else None)
        try:
            if self._proc is not None:
                with self._lock:
                    if self._restarting:
                        self._parked.append((rid, request))
                        return fut
                    proc = self._proc
                proc.submit(rid, request)
            else:
                self._loop.put("gen", rid, request)
        except BackendError as exc:
            self._resolve(rid, None, str(exc), 0.0)
        return fut

    def _cancelled(self, rid: int) -> None:
        with self._lock:
            self._futures.pop(rid, None)
            self._parked = [p for p in self._parked if p[0] != rid]
        if self._proc is not None:
            self._proc.cancel(rid)
        else:
            self._loop.put("cancel", rid)

    def _emit(self, f: Finished) -> None:
        self._resolve(f.rid, f.generation, f.error, f.ttft_s)

    def _resolve(self, rid: int, gen: Generation | None, error: str | None, ttft_s: float) -> None:
        with self._lock:
            futs = list(self._futures.values()) if rid < 0 else [self._futures.pop(rid, None)]
            if rid < 0:
                self._futures.clear()
        if gen is not None:
            self.ttft_s.append(ttft_s)
        for fut in futs:
            if fut is None or fut.done():
                continue
            try:
                if gen is not None:
                    fut.set_result(gen)
                else:
                    fut.set_exception(BackendError(error or "generation failed"))
            except cf.InvalidStateError:  # cancelled meanwhile by its caller
                pass

    def _on_version(self, version: int, error: str | None) -> None:
        if error is None:
            with self._applied:
                self.version = version
                self._applied.notify_all()

    # ---- engine restarts (process=True) --------------------------------------------------------

    def _engine_exited(self) -> None:
        """Called by the dead child's reader thread, after its pending requests failed."""
        with self._lock:
            if self._closing or self._restarting:
                return
            if self._restarts_left <= 0:
                log.error("the engine process of %s has exited and no restart is left (raas.engine_restarts): "
                          "every request fails until the node is restarted", self.policy)
                return
            self._restarts_left -= 1
            self._restarting = True
        log.error("the engine process of %s has exited (code %s); starting a new one", self.policy,
                  self._proc.proc.poll() if self._proc else None)
        threading.Thread(target=self._restart, name=f"engine-restart-{self.policy}", daemon=True).start()

    def _restart(self) -> None:
        from astraflow.raas.backends.engine_proc import EngineProcess

        applied = threading.Condition()
        served: list[int] = []

        def on_version(version: int, error: str | None) -> None:
            with applied:
                served.append(version if error is None else -1)
                applied.notify_all()
            if error is not None:
                log.error("restarted engine of %s refused version %d: %s", self.policy, version, error)

        proc = None
        try:
            proc = EngineProcess(self._model_dir, on_result=self._resolve, on_version=on_version,
                                 on_exit=self._engine_exited, **self._engine_args)
            proc.wait_ready()
            while True:  # the newest weights first (a newer version may arrive meanwhile: apply that one)
                with self._lock:
                    newest = self._newest
                if newest is not None:
                    proc.offer_weights(*newest)
                    _wait_applied(proc, applied, served, newest[1])
                with self._lock:
                    if self._newest is not newest:
                        continue
                    proc.on_version = self._on_version
                    self._proc, self._restarting = proc, False
                    parked, self._parked = self._parked, []
                    self.restarts += 1
                    break
        except BackendError as exc:
            log.error("could not restart the engine process of %s: %s", self.policy, exc)
            if proc is not None:
                proc.on_exit = None
                proc.close()
            with self._lock:
                self._restarting = False  # later requests fail on the dead process
                parked, self._parked = self._parked, []
            for rid, _ in parked:
                self._resolve(rid, None, f"the engine process could not be restarted: {exc}", 0.0)
            return
        if newest is not None:
            self._on_version(newest[1], None)
        log.info("engine process of %s restarted (serving version %s); %d waiting requests submitted",
                 self.policy, self.version, len(parked))
        for rid, request in parked:
            try:
                proc.submit(rid, request)
            except BackendError as exc:
                self._resolve(rid, None, str(exc), 0.0)


def _wait_applied(proc: Any, applied: threading.Condition, served: list[int], version: int,
                  timeout_s: float = 600.0) -> None:
    """Until the restarted engine `proc` reports `version` applied; BackendError if it refuses it,
    dies or takes longer than `timeout_s`."""
    deadline = time.monotonic() + timeout_s
    with applied:
        while not served or served[-1] not in (version, -1):
            if not proc.alive or time.monotonic() > deadline:
                raise BackendError(f"the restarted engine process did not apply version {version}")
            applied.wait(1.0)
        if served[-1] != version:
            raise BackendError(f"the restarted engine process refused version {version}")
