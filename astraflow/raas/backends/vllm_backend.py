"""`vllm` backend: a vLLM engine (GPU, or vLLM's CPU build) serving one policy, weights followed in place.

The engine is vLLM's `AsyncLLM` (continuous batching; its engine core runs in a child process).
It lives in a thread of its own with its own event loop, so the node's event loop (workflows,
serde, Kafka) never waits on it and `generate_sync` works from any thread. Requests go in as token
ids (`TokensPrompt`): a multi-turn rollout's earlier generated tokens are passed back as the ids
the model produced, never re-tokenised text. The sampled ids and their logprobs come back per
request.

Log-probabilities: vLLM's *processed* logprobs (`logprobs_mode="processed_logprobs"`): after
temperature scaling and top-p masking, renormalised over what could be sampled, as the torch
backend records them (`sampling.py`). vLLM's default (raw logits) would make every importance
weight of a sample drawn at T != 1 or top-p < 1 wrong; a vLLM without the option is refused.

Weights: `update_weights(state, version)` (what `BackendWeightFollower` calls with each verified
version, deltas already applied to a full state) is applied without a restart, as a full reload:
the state is written to one safetensors file and the engine's workers read it
(`vllm_worker.WeightFileLoader`, a worker extension `collective_rpc` calls by name) into the
running model with vLLM's in-place `reload_weights`. Requests finish on the version they started with: when a version
arrives, new requests wait, the running ones drain, the weights are swapped, then the waiting
requests start on the new version. vLLM does not report which engine step produced a streamed
token, so a switch inside a request could not be attributed to exact tokens; the drain costs at
most one request's decode and every token's recorded version is exact by construction. The prefix
cache is keyed by version (`cache_salt`), so no request reuses keys and values of older weights.
A model with tied input/output embeddings is refused: vLLM's in-place reload leaves its output
head stale while reporting success.

Bad requests (a prompt that fills the context, max_tokens < 1, a non-finite temperature, top_p
outside (0, 1]) raise `VllmBackendError` before reaching the engine, which the node records as an
ERROR trajectory; max_tokens past the context is clamped to what fits (counted in `clamped`,
finish reason "length"). An engine whose core process dies is started again (up to
`engine_restarts` times) with the newest weights, and the requests it held are submitted again
once each; none of them had returned, so none is served twice.
"""

from __future__ import annotations

import asyncio
import concurrent.futures as cf
import itertools
import logging
import os
import tempfile
import threading
from pathlib import Path
from typing import Any

import numpy as np

from astraflow.errors import AstraflowError
from astraflow.raas.backends.base import GenerateRequest, Generation, model_context_length
from astraflow.raas.backends.vllm_support import (
    VllmBackendError,
    check_request,
    checkpoint_layout,
    completion_arrays,
    engine_kwargs,
    model_config,
    refuse_tied,
)
from astraflow.weights.layout import ModelLayout

log = logging.getLogger("astraflow.raas.vllm")

class VllmBackend:
    """Serves one policy from a local model directory with vLLM."""

    name = "vllm"

    def __init__(self, policy: str, model_dir: str, *, version: int = 0, gpu_memory_utilization: float = 0.5,
                 max_model_len: int | None = None, seed: int | None = None, kv_cache_gib: int | None = None,
                 max_num_seqs: int | None = None, dtype: str = "auto", engine_restarts: int = 3,
                 **_: Any) -> None:
        """`kv_cache_gib`: on vLLM's CPU build, the KV cache size (VLLM_CPU_KVCACHE_SPACE, GiB);
        `gpu_memory_utilization` bounds it on a GPU. `dtype` "auto": the checkpoint's dtype (what
        the trainer computes in)."""
        try:
            import vllm  # noqa: F401
        except ImportError as exc:
            raise VllmBackendError("the vllm backend needs vLLM: on a GPU `pip install astraflow[vllm]`; on a CPU "
                                   "use the virtualenv of `bash scripts/vllm-env.sh` (docs/raas.md)") from exc
        from transformers import AutoTokenizer

        cfg = model_config(model_dir)
        refuse_tied(model_dir, cfg)
        if dtype == "auto":  # the checkpoint's own (vLLM's "auto" would serve a float32 model in 16 bits)
            dtype = str(cfg.get("dtype") or cfg.get("torch_dtype") or "auto")
        self._kv_cache_gib = kv_cache_gib
        self.policy = policy
        self.version = version
        self.model_dir = model_dir
        self.tokenizer = AutoTokenizer.from_pretrained(model_dir)
        self.context_length = max_model_len or model_context_length(model_dir)  # prompt + new tokens at most
        self._kwargs = engine_kwargs(model_dir, gpu_memory_utilization, max_model_len, seed, max_num_seqs, dtype)
        self._layout = checkpoint_layout(model_dir)
        self.clamped = 0  # requests whose max_tokens was cut to fit the context
        self.tokens_generated = 0  # tokens of the completions returned
        self.restarts = 0  # engines started again after one died
        self.reload_s: list[float] = []  # seconds each in-place weight swap took
        self._restarts_left = engine_restarts
        self._ids = itertools.count()
        self._newest: tuple[dict[str, Any], int] | None = None  # weights not applied yet
        self._newest_lock = threading.Lock()  # the follower's thread sets it, the engine's loop takes it
        self._applied_state: tuple[dict[str, Any], int] | None = None  # the last applied (for a restart)
        self._applied = threading.Condition()
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._loop.run_forever, name=f"vllm-{policy}", daemon=True)
        self._thread.start()
        try:
            self._call(self._start()).result()
        except BaseException:
            self.close()
            raise

    # ---- public API ----------------------------------------------------------------------------

    def encode(self, text: str, *, add_bos: bool = False) -> list[int]:
        return self.tokenizer.encode(text, add_special_tokens=add_bos)

    def decode(self, ids) -> str:
        return self.tokenizer.decode([int(i) for i in ids], skip_special_tokens=True)

    def hardware(self) -> str:
        from vllm.platforms import current_platform

        if current_platform.is_cpu():
            return f"cpu:vllm:{os.cpu_count()}"
        import torch

        return f"cuda:{torch.cuda.get_device_name(0)}" if torch.cuda.is_available() else f"vllm:{current_platform}"

    def weight_layout(self) -> ModelLayout:
        """Names, shapes and dtypes of the checkpoint's tensors: what the weight follower checks against."""
        return self._layout

    async def generate(self, request: GenerateRequest) -> Generation:
        return await asyncio.wrap_future(self._call(self._generate(request)))

    def generate_sync(self, request: GenerateRequest) -> Generation:
        return self._call(self._generate(request)).result()

    def update_weights(self, state_dict: dict[str, Any], version: int) -> None:
        """Queues new weights (the newest replaces one not applied yet); applied once the requests
        running now have finished, before any request that waits."""
        with self._newest_lock:
            self._newest = (state_dict, int(version))
        self._loop.call_soon_threadsafe(self._kick_update)

    def wait_version(self, version: int, timeout_s: float) -> bool:
        """Waits until `version` (or a later one) is served; False on timeout."""
        with self._applied:
            return self._applied.wait_for(lambda: self.version >= version, timeout_s)

    def close(self) -> None:
        if not self._thread.is_alive():
            return
        try:
            self._call(self._stop()).result(timeout=60)
        except (cf.TimeoutError, RuntimeError, AstraflowError):
            log.warning("vLLM engine of %s did not shut down cleanly", self.policy)
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(timeout=10)

    def engine_pids(self) -> list[int]:
        """Process ids of the engine's core processes (children of this process)."""
        import psutil

        me = psutil.Process()
        return [p.pid for p in me.children(recursive=True) if "EngineCore" in " ".join(_name(p))]

    # ---- the engine thread ---------------------------------------------------------------------

    def _call(self, coro) -> cf.Future:
        return asyncio.run_coroutine_threadsafe(coro, self._loop)

    async def _start(self) -> None:
        self._open = asyncio.Event()  # set while new requests may start
        self._open.set()
        self._drained = asyncio.Event()  # set while no request runs
        self._drained.set()
        self._running = 0
        self._updating: asyncio.Task | None = None
        self._engine_ok = asyncio.Event()
        self.engine = await asyncio.to_thread(self._new_engine)
        self._engine_ok.set()

    def _new_engine(self) -> Any:
        from vllm import AsyncEngineArgs
        from vllm.v1.engine.async_llm import AsyncLLM

        try:
            args = AsyncEngineArgs(**self._kwargs)
        except TypeError as exc:  # an AsyncEngineArgs without logprobs_mode
            raise VllmBackendError(
                f"this vLLM cannot return post-temperature logprobs ({exc}): upgrade to vllm>=0.10.2, "
                "or the trainer's importance weights would compare different distributions"
            ) from exc
        before = os.environ.get("VLLM_CPU_KVCACHE_SPACE")
        if self._kv_cache_gib is not None:  # read by the engine process it starts
            os.environ["VLLM_CPU_KVCACHE_SPACE"] = str(int(self._kv_cache_gib))  # vLLM reads whole GiB
        try:
            return AsyncLLM.from_engine_args(args)
        except Exception as exc:  # vLLM raises many types when the device or model is unusable
            raise VllmBackendError(f"vLLM could not start on {self.model_dir}: {exc}") from exc
        finally:
            if before is None:
                os.environ.pop("VLLM_CPU_KVCACHE_SPACE", None)
            else:
                os.environ["VLLM_CPU_KVCACHE_SPACE"] = before

    async def _stop(self) -> None:
        engine = getattr(self, "engine", None)
        if engine is not None:  # in this loop: its output handler is cancelled before it sees the engine go
            engine.shutdown()

    async def _generate(self, request: GenerateRequest) -> Generation:
        from vllm.v1.engine.exceptions import EngineDeadError

        max_tokens = check_request(request, self.context_length)
        if max_tokens < request.max_tokens:
            self.clamped += 1
        retried = False
        while True:
            while not self._open.is_set():  # a weight swap waits for the running requests
                await self._open.wait()
            await self._engine_ok.wait()
            version = self.version
            self._running += 1
            self._drained.clear()
            try:
                return await self._run_once(request, max_tokens, version)
            except EngineDeadError as exc:
                if retried:
                    raise VllmBackendError(f"the vLLM engine died twice under this request: {exc}") from exc
                retried = True
                await self._engine_died()
            finally:
                self._running -= 1
                if self._running == 0:
                    self._drained.set()

    async def _run_once(self, request: GenerateRequest, max_tokens: int, version: int) -> Generation:
        from vllm import SamplingParams, TokensPrompt
        from vllm.sampling_params import RequestOutputKind

        # FINAL_ONLY: one output per request, not one per step (per-step outputs cost this
        # process a Python pass per token of every running request). vLLM's incremental
        # detokenization (a tokenizer call per token) runs only when stop strings need it: the
        # text returned is always `decode(ids)`, once per request.
        params = SamplingParams(temperature=request.temperature, top_p=request.top_p, max_tokens=max_tokens,
                                stop=request.stop or None, logprobs=0, include_stop_str_in_output=True,
                                output_kind=RequestOutputKind.FINAL_ONLY, detokenize=bool(request.stop))
        prompt = TokensPrompt(prompt_token_ids=list(request.prompt_ids), cache_salt=f"v{version}")
        final = None
        async for out in self.engine.generate(prompt, params, request_id=f"{self.policy}-{next(self._ids)}"):
            final = out
        if final is None or not final.outputs:
            raise VllmBackendError("vLLM returned no output")
        comp = final.outputs[0]
        if comp.finish_reason not in ("stop", "length"):
            raise VllmBackendError(f"vLLM ended the request with {comp.finish_reason!r}")
        ids, lps = completion_arrays(list(comp.token_ids), comp.logprobs)
        versions = np.full(len(ids), version, np.int32)
        self.tokens_generated += len(ids)
        return Generation(ids, lps, versions, self.decode(ids), "length" if comp.finish_reason == "length" else "stop")

    # ---- weights ---------------------------------------------------------------------------------

    def _kick_update(self) -> None:
        if self._updating is None or self._updating.done():
            self._updating = self._loop.create_task(self._apply_updates())

    async def _apply_updates(self) -> None:
        while self._newest is not None:
            self._open.clear()  # new requests wait; the running ones finish on their version
            try:
                await self._drained.wait()
                await self._engine_ok.wait()
                with self._newest_lock:
                    (state, version), self._newest = self._newest, None
                try:
                    await self._load(state)
                except Exception:  # keeps serving the weights it has (the follower logs the next version)
                    log.exception("vLLM engine of %s could not load version %d; serving version %d",
                                  self.policy, version, self.version)
                    continue
                self._applied_state = (state, version)
                with self._applied:
                    self.version = version
                    self._applied.notify_all()
                log.info("vLLM engine of %s serves version %d (reload %.2f s)", self.policy, version, self.reload_s[-1])
            finally:
                if self._newest is None:
                    self._open.set()

    async def _load(self, state: dict[str, Any]) -> None:
        import time

        from astraflow.raas.backends.vllm_worker import LOAD_METHOD, write_weights_file

        t0 = time.perf_counter()
        with tempfile.TemporaryDirectory(prefix="astraflow-vllm-", dir=_shm()) as tmp:
            path = str(Path(tmp) / "weights.safetensors")
            await asyncio.to_thread(write_weights_file, state, path)
            await self.engine.collective_rpc(LOAD_METHOD, args=(path,))
        self.reload_s.append(time.perf_counter() - t0)

    # ---- restarts --------------------------------------------------------------------------------

    async def _engine_died(self) -> None:
        """Starts a new engine (once, however many requests saw the old one die) with the newest
        applied weights; raises when no restart is left."""
        if self._engine_ok.is_set():
            if self._restarts_left <= 0:
                raise VllmBackendError("the vLLM engine died and no restart is left (engine_restarts): restart the node")
            self._restarts_left -= 1
            self._engine_ok.clear()
            log.error("the vLLM engine of %s died; starting a new one", self.policy)
            self.engine.shutdown()
            self.engine = await asyncio.to_thread(self._new_engine)
            if self._applied_state is not None:
                await self._load(self._applied_state[0])
            self.restarts += 1
            self._engine_ok.set()
            log.info("vLLM engine of %s restarted at version %d", self.policy, self.version)
        await self._engine_ok.wait()


def _name(p: Any) -> list[str]:
    try:
        return [p.name(), *p.cmdline()]
    except Exception:  # a child that exited meanwhile
        return []


def _shm() -> str | None:
    return "/dev/shm" if os.path.isdir("/dev/shm") and os.access("/dev/shm", os.W_OK) else None


__all__ = ["VllmBackend", "VllmBackendError", "check_request", "completion_arrays", "engine_kwargs"]
