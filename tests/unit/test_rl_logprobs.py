"""Token logprobs, causal alignment and entropy from logits."""

from __future__ import annotations

import math

import pytest
import torch

from astraflow.errors import RLError
from astraflow.rl import entropy_from_logits, masked_mean, sequence_logprobs, token_logprobs

pytestmark = pytest.mark.unit


def test_token_logprobs_match_log_softmax() -> None:
    logits = torch.randn(2, 5, 11, generator=torch.Generator().manual_seed(0))
    targets = torch.randint(0, 11, (2, 5), generator=torch.Generator().manual_seed(1))
    expected = torch.log_softmax(logits, dim=-1).gather(-1, targets[..., None]).squeeze(-1)
    assert torch.allclose(token_logprobs(logits, targets), expected, atol=1e-6)


def test_token_logprobs_are_stable_for_huge_and_bf16_logits() -> None:
    logits = torch.tensor([[1e4, 0.0, -1e4]])
    out = token_logprobs(logits, torch.tensor([1]))
    assert torch.isfinite(out).all() and out.item() == pytest.approx(-1e4)
    bf16 = token_logprobs(torch.zeros(3, 4, dtype=torch.bfloat16), torch.tensor([0, 1, 2]))
    assert bf16.dtype == torch.float32 and bf16.tolist() == pytest.approx([-math.log(4)] * 3)


def test_token_logprobs_shape_mismatch_raises() -> None:
    with pytest.raises(RLError):
        token_logprobs(torch.zeros(2, 3, 5), torch.zeros(2, 4, dtype=torch.long))


def test_sequence_logprobs_align_with_token_ids() -> None:
    logits = torch.full((1, 3, 4), -10.0)
    logits[0, 0, 2] = 10.0  # position 0 predicts token 2
    logits[0, 1, 3] = 10.0  # position 1 predicts token 3
    token_ids = torch.tensor([[1, 2, 0]])
    out = sequence_logprobs(logits, token_ids)
    assert out.shape == (1, 3)
    assert out[0, 0].item() == 0.0
    assert out[0, 1].item() == pytest.approx(0.0, abs=1e-6)  # token 2 was the predicted one
    assert out[0, 2].item() < -15.0  # token 0 was not


def test_entropy_uniform_and_peaked() -> None:
    ent = entropy_from_logits(torch.stack([torch.zeros(8), torch.tensor([50.0] + [0.0] * 7)]))
    assert ent[0].item() == pytest.approx(math.log(8))
    assert ent[1].item() == pytest.approx(0.0, abs=1e-6)


def test_masked_mean_ignores_masked_nan() -> None:
    values = torch.tensor([1.0, 3.0, float("nan")])
    assert masked_mean(values, torch.tensor([1, 1, 0])).item() == pytest.approx(2.0)
    assert masked_mean(values, torch.zeros(3)).item() == 0.0
