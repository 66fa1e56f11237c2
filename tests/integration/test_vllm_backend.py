"""vLLM backend on a GPU: generation returns ids and logprobs; weights update in place."""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest

pytestmark = pytest.mark.gpu


def test_vllm_generates_and_updates(tmp_path: Path) -> None:
    pytest.importorskip("vllm")
    from astraflow.models.tiny import init_tiny
    from astraflow.raas.backends.base import GenerateRequest
    from astraflow.raas.backends.vllm_backend import VllmBackend

    model = init_tiny(tmp_path / "tiny", seed=0)
    b = VllmBackend("policy", str(model), gpu_memory_utilization=0.2)
    prompt = b.encode("Q: What is 2+3?\nA:", add_bos=True)
    gen = asyncio.run(b.generate(GenerateRequest(prompt, 16, 1.0, 1.0, [])))
    assert len(gen.token_ids) == len(gen.logprobs) > 0 and (gen.versions == 0).all()
    import torch
    from transformers import AutoModelForCausalLM

    sd = AutoModelForCausalLM.from_pretrained(model).state_dict()
    b.update_weights({k: v.to(torch.bfloat16) for k, v in sd.items()}, 3)
    gen = asyncio.run(b.generate(GenerateRequest(prompt, 8, 1.0, 1.0, [])))
    assert (gen.versions == 3).all()
    b.close()
