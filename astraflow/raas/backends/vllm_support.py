"""The pure parts of the `vllm` backend: request checks, the model's config and layout, engine
arguments, and the logprobs of a completion. No vLLM import: tested on any machine
(tests/unit/test_vllm_pure.py)."""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

import numpy as np

from astraflow.errors import AstraflowError
from astraflow.raas.backends.base import GenerateRequest
from astraflow.raas.backends.vllm_worker import WORKER_EXTENSION
from astraflow.weights.bits import DTYPE_BY_NAME, TensorMeta
from astraflow.weights.layout import ModelLayout

SAFETENSORS_DTYPES = {"F32": "float32", "F16": "float16", "BF16": "bfloat16", "I64": "int64", "I32": "int32"}


class VllmBackendError(AstraflowError):
    """Raised when vLLM is missing or too old, the model cannot be served by it (tied embeddings),
    the engine cannot start, or a request is invalid (the node turns it into an ERROR trajectory)."""


def check_request(request: GenerateRequest, context_length: int | None) -> int:
    """The max_tokens to ask vLLM for: `request.max_tokens`, cut to what fits the context.
    Raises `VllmBackendError` for a request the engine must not see."""
    n = len(request.prompt_ids)
    if n == 0:
        raise VllmBackendError("empty prompt: a request needs at least one token")
    if context_length is not None and n >= context_length:
        raise VllmBackendError(f"prompt of {n} tokens does not fit the model's {context_length}-token context")
    if request.max_tokens < 1:
        raise VllmBackendError(f"max_tokens must be at least 1, got {request.max_tokens}")
    if not (math.isfinite(request.temperature) and request.temperature >= 0):
        raise VllmBackendError(f"temperature must be finite and >= 0 (0 = greedy), got {request.temperature}")
    if not (0.0 < request.top_p <= 1.0):
        raise VllmBackendError(f"top_p must be in (0, 1], got {request.top_p}")
    if any(not isinstance(s, str) or not s for s in request.stop):
        raise VllmBackendError("stop strings must be non-empty strings")
    room = request.max_tokens if context_length is None else min(request.max_tokens, context_length - n)
    return room


def model_config(model_dir: str) -> dict[str, Any]:
    """The model's `config.json`; `VllmBackendError` when there is none."""
    try:
        cfg = json.loads((Path(model_dir) / "config.json").read_text())
    except (OSError, ValueError) as exc:
        raise VllmBackendError(f"no readable config.json in {model_dir}: {exc}") from exc
    if not isinstance(cfg, dict):
        raise VllmBackendError(f"config.json in {model_dir} is not an object")
    return cfg


def refuse_tied(model_dir: str, cfg: dict[str, Any]) -> None:
    """Raise `VllmBackendError` for a model whose output head shares the input embeddings."""
    if cfg.get("tie_word_embeddings") is True:
        raise VllmBackendError(
            f"the model in {model_dir} ties its output head to its input embeddings; vLLM's in-place weight "
            "reload leaves such a head stale. Serve a model with untied embeddings (init_tiny(..., tie_embeddings=False); "
            "tie_word_embeddings=false in config.json with an lm_head.weight tensor)")


def checkpoint_layout(model_dir: str) -> ModelLayout:
    """The layout of the safetensors checkpoint in `model_dir`, read from the files' headers only."""
    files = sorted(Path(model_dir).glob("*.safetensors"))
    if not files:
        raise VllmBackendError(f"no *.safetensors checkpoint in {model_dir}")
    tensors: dict[str, TensorMeta] = {}
    for f in files:
        with open(f, "rb") as fh:
            size = int.from_bytes(fh.read(8), "little")
            header = json.loads(fh.read(size))
        for name, info in header.items():
            if name == "__metadata__":
                continue
            dtype = DTYPE_BY_NAME[SAFETENSORS_DTYPES[info["dtype"]]]
            tensors[name] = TensorMeta(dtype, tuple(int(s) for s in info["shape"]))
    return ModelLayout(tensors, tuple((n,) for n in tensors))


def engine_kwargs(model_dir: str, gpu_memory_utilization: float, max_model_len: int | None, seed: int | None,
                  max_num_seqs: int | None = None, dtype: str = "auto") -> dict[str, Any]:
    """Arguments of vLLM's `AsyncEngineArgs`: processed (post-temperature, post-top-p) logprobs.
    vLLM's own throughput log is off (`disable_log_stats`, as its offline `LLM` has it): with it on,
    the engine core builds scheduler stats each step and the node's process updates per-request
    stats for every token, CPU the node's own metrics (tokens/s, rollouts/s) do not need."""
    kw: dict[str, Any] = {"model": model_dir, "gpu_memory_utilization": gpu_memory_utilization,
                          "max_model_len": max_model_len, "seed": seed or 0, "enforce_eager": True,
                          "logprobs_mode": "processed_logprobs", "dtype": dtype,
                          "worker_extension_cls": WORKER_EXTENSION, "disable_log_stats": True}
    if max_num_seqs is not None:
        kw["max_num_seqs"] = max_num_seqs
    return kw


def completion_arrays(token_ids: list[int], logprobs: list[dict[int, Any]] | None) -> tuple[np.ndarray, np.ndarray]:
    """(int32 ids, float32 logprobs) of a vLLM completion: the logprob of each sampled id from its
    step's dict (id -> object with `.logprob`). A step that lacks its sampled id (never with
    logprobs=0, which always includes it) or a non-finite value is an error, not a silent 0: a 0
    would claim probability 1 to the trainer."""
    steps = logprobs or []
    if len(steps) != len(token_ids):
        raise VllmBackendError(f"vLLM returned {len(steps)} logprob steps for {len(token_ids)} tokens; request logprobs=0")
    out = np.empty(len(token_ids), np.float32)
    for i, (t, step) in enumerate(zip(token_ids, steps, strict=True)):
        if not step or t not in step:
            raise VllmBackendError(f"vLLM gave no logprob for the sampled token {t} at position {i}")
        value = float(step[t].logprob)
        if not math.isfinite(value) or value > 1e-4:
            raise VllmBackendError(f"vLLM gave logprob {value} for the sampled token {t} at position {i}")
        out[i] = value
    return np.asarray(token_ids, np.int32), out
