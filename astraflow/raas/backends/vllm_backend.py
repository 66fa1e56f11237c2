"""`vllm` backend: an in-process vLLM engine on GPU (imported lazily; tests carry the `gpu` marker).

Requests go to vLLM's `AsyncLLMEngine` (continuous batching) as token ids; the sampled ids and
their logprobs come back per request. New weights are loaded into the running engine without a
restart (`collective_rpc("load_weights")`), applied before the next request is submitted: with
vLLM, a version switch happens between requests, not between decoding steps, and every token of
a request records the version it was submitted under.

The logprobs recorded are vLLM's *processed* logprobs (`logprobs_mode="processed_logprobs"`,
vLLM >= 0.10.2): after temperature scaling and top-p/top-k masking, so renormalised over what
could be sampled, as the torch backend records them. vLLM's default (raw logits) would make
every importance weight of a sample drawn at T != 1 or top-p < 1 wrong; an older vLLM is
refused. `engine_kwargs` and `completion_arrays` are the pure parts, tested on CPU.

Not exercised on this project's CPU-only CI; the `gpu` tests run it where a GPU is present.
"""

from __future__ import annotations

import itertools
from typing import Any

import numpy as np

from astraflow.errors import AstraflowError
from astraflow.raas.backends.base import GenerateRequest, Generation, model_context_length


class VllmBackendError(AstraflowError):
    """Raised when vLLM is not installed, finds no GPU, or fails to load the model."""


class VllmBackend:
    """Serves one policy from a local model directory with vLLM."""

    name = "vllm"

    def __init__(self, policy: str, model_dir: str, *, version: int = 0, gpu_memory_utilization: float = 0.5,
                 max_model_len: int | None = None, seed: int | None = None, **_: Any) -> None:
        try:
            from vllm import AsyncEngineArgs, AsyncLLMEngine
        except ImportError as exc:
            raise VllmBackendError("the vllm backend needs `pip install astraflow[vllm]` and a CUDA GPU") from exc
        from transformers import AutoTokenizer

        self.policy = policy
        self.version = version
        self.model_dir = model_dir
        self.tokenizer = AutoTokenizer.from_pretrained(model_dir)
        self.context_length = max_model_len or model_context_length(model_dir)  # prompt + new tokens at most
        try:
            args = AsyncEngineArgs(**engine_kwargs(model_dir, gpu_memory_utilization, max_model_len, seed))
        except TypeError as exc:  # an AsyncEngineArgs without logprobs_mode
            raise VllmBackendError(
                f"this vLLM cannot return post-temperature logprobs ({exc}): upgrade to vllm>=0.10.2, "
                "or the trainer's importance weights would compare different distributions"
            ) from exc
        try:
            self.engine = AsyncLLMEngine.from_engine_args(args)
        except Exception as exc:  # vLLM raises many types when the GPU or model is unusable
            raise VllmBackendError(f"vLLM could not start on {model_dir}: {exc}") from exc
        self._ids = itertools.count()
        self._pending_update: tuple[dict[str, Any], int] | None = None

    def encode(self, text: str, *, add_bos: bool = False) -> list[int]:
        return self.tokenizer.encode(text, add_special_tokens=add_bos)

    def decode(self, ids) -> str:
        return self.tokenizer.decode([int(i) for i in ids], skip_special_tokens=True)

    def hardware(self) -> str:
        import torch

        return f"cuda:{torch.cuda.get_device_name(0)}" if torch.cuda.is_available() else "cuda:?"

    def update_weights(self, state_dict: dict[str, Any], version: int) -> None:
        self._pending_update = (state_dict, version)

    async def _apply_update(self) -> None:
        upd, self._pending_update = self._pending_update, None
        if upd is None:
            return
        sd, version = upd
        rpc = getattr(self.engine, "collective_rpc", None)
        if rpc is None:
            raise VllmBackendError("this vLLM version has no collective_rpc; upgrade vLLM to update weights in place")
        await rpc("load_weights", kwargs={"weights": list(sd.items())})
        self.version = version

    async def generate(self, request: GenerateRequest) -> Generation:
        from vllm import SamplingParams, TokensPrompt

        await self._apply_update()
        params = SamplingParams(temperature=request.temperature, top_p=request.top_p, max_tokens=request.max_tokens,
                                stop=request.stop or None, logprobs=0, include_stop_str_in_output=True)
        start_version = self.version
        final = None
        async for out in self.engine.generate(TokensPrompt(prompt_token_ids=request.prompt_ids), params,
                                              request_id=f"{self.policy}-{next(self._ids)}"):
            final = out
        if final is None:
            raise VllmBackendError("vLLM returned no output")
        comp = final.outputs[0]
        ids, lps = completion_arrays(list(comp.token_ids), comp.logprobs)
        versions = np.full(len(ids), start_version, np.int32)
        return Generation(ids, lps, versions, comp.text, "length" if comp.finish_reason == "length" else "stop")

    def close(self) -> None:
        shutdown = getattr(self.engine, "shutdown", None)
        if shutdown:
            shutdown()


def engine_kwargs(model_dir: str, gpu_memory_utilization: float, max_model_len: int | None, seed: int | None) -> dict[str, Any]:
    """Arguments of vLLM's `AsyncEngineArgs`: processed (post-temperature, post-top-p) logprobs."""
    return {"model": model_dir, "gpu_memory_utilization": gpu_memory_utilization, "max_model_len": max_model_len,
            "seed": seed or 0, "enforce_eager": True, "logprobs_mode": "processed_logprobs"}


def completion_arrays(token_ids: list[int], logprobs: list[dict[int, Any]] | None) -> tuple[np.ndarray, np.ndarray]:
    """(int32 ids, float32 logprobs) of a vLLM completion: the logprob of each sampled id from its
    step's dict (id -> object with `.logprob`). A step that lacks its sampled id (never with
    logprobs=0, which always includes it) is an error, not a silent 0: a 0 would claim
    probability 1 to the trainer."""
    steps = logprobs or []
    if len(steps) != len(token_ids):
        raise VllmBackendError(f"vLLM returned {len(steps)} logprob steps for {len(token_ids)} tokens; request logprobs=0")
    out = np.empty(len(token_ids), np.float32)
    for i, (t, step) in enumerate(zip(token_ids, steps, strict=True)):
        if not step or t not in step:
            raise VllmBackendError(f"vLLM gave no logprob for the sampled token {t} at position {i}")
        out[i] = float(step[t].logprob)
    return np.asarray(token_ids, np.int32), out
