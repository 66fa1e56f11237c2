"""Inference backends (`torch`, `vllm`, `openai`), created by name; heavy imports are lazy."""

from __future__ import annotations

from typing import Any

from astraflow.errors import ConfigError
from astraflow.raas.backends.base import GenerateRequest, Generation, InferenceBackend

BACKENDS = ("torch", "vllm", "openai")


def create_backend(kind: str, policy: str, model: str, **options: Any) -> InferenceBackend:
    """Builds the backend `kind` serving `policy` from `model` (a local dir, or a URL for openai)."""
    if kind == "torch":
        from astraflow.raas.backends.torch_backend import TorchBackend

        return TorchBackend(policy, model, **options)
    if kind == "vllm":
        from astraflow.raas.backends.vllm_backend import VllmBackend

        return VllmBackend(policy, model, **options)
    if kind == "openai":
        from astraflow.raas.backends.openai_backend import OpenAIBackend

        return OpenAIBackend(policy, model, **options)
    raise ConfigError(f"unknown backend {kind!r}; choose one of {', '.join(BACKENDS)}")


__all__ = ["BACKENDS", "GenerateRequest", "Generation", "InferenceBackend", "create_backend"]
