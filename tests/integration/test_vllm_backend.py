"""vLLM backend on a GPU, in bf16 (what a GPU node serves): generation returns ids and logprobs;
weights update in place and the tokens record the new version.

The CPU build runs the rest of the backend's tests (tests/vllm, marker `vllm`); this one needs
CUDA and skips elsewhere.
"""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest

pytestmark = pytest.mark.gpu


def test_vllm_generates_and_updates_in_bf16_on_a_gpu(untied_model_dir: Path) -> None:
    pytest.importorskip("vllm")
    import torch
    from safetensors.torch import load_file

    from astraflow.raas.backends.base import GenerateRequest
    from astraflow.raas.backends.vllm_backend import VllmBackend

    b = VllmBackend("policy", str(untied_model_dir), gpu_memory_utilization=0.2, dtype="bfloat16", max_model_len=512)
    try:
        prompt = b.encode("Q: What is 2+3?\nA:", add_bos=True)
        gen = asyncio.run(b.generate(GenerateRequest(prompt, 16, 1.0, 1.0, [])))
        assert len(gen.token_ids) == len(gen.logprobs) > 0 and (gen.versions == 0).all()
        sd = load_file(str(untied_model_dir / "model.safetensors"))
        b.update_weights({k: v.to(torch.bfloat16) for k, v in sd.items()}, 3)
        assert b.wait_version(3, timeout_s=120)
        gen = asyncio.run(b.generate(GenerateRequest(prompt, 8, 1.0, 1.0, [])))
        assert (gen.versions == 3).all()
    finally:
        b.close()
