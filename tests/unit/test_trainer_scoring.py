"""The trainer scores only trained tokens: same loss, gradients and metrics as the full padded pass.

`PolicyTrainer.scored_logprobs` runs the batch's rows in chunks of similar length and the LM head
only where a trained token is scored; `compute_loss` must give what the straightforward
computation gives (one forward pass over the whole padded batch, logprobs and entropies at every
position, `policy_loss` on them), on a fixed batch of uneven lengths and temperatures.
"""

from __future__ import annotations

import copy
import itertools
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

from astraflow.records import TrainSample
from astraflow.rl import (
    entropy_from_logits,
    policy_loss,
    sequence_logprobs,
    token_logprobs,
    token_logprobs_and_entropy,
)
from trainers.batching import collate, length_chunks
from trainers.config import LossSettings
from trainers.module import PolicyTrainer

pytestmark = pytest.mark.unit



def _sample(i: int) -> TrainSample:
    rng = np.random.default_rng(i)
    prompt, gen = int(rng.integers(3, 8)), int(rng.choice([2, 3, 4, 20, 25]))
    n = prompt + gen
    mask = np.r_[np.zeros(prompt, np.uint8), np.ones(gen, np.uint8)]
    if i % 5 == 0:
        mask[prompt + 1] = 0  # a tool reply inside the completion: not trained
    return TrainSample(
        f"s{i}", "t", "g", "p", "policy", rng.integers(3, 300, n, dtype=np.int32), mask,
        np.where(mask == 1, -rng.random(n) - 2.0, 0).astype(np.float32), np.where(mask == 1, 0, -1).astype(np.int32),
        float(rng.normal()), 0.5, 0, temperature=float(rng.choice([0.7, 1.0, 1.3])),
    )


def _batch() -> dict[str, Any]:
    return collate([_sample(i) for i in range(24)])


def _reference(module: PolicyTrainer, batch: dict[str, Any]) -> tuple[torch.Tensor, dict[str, float]]:
    """The loss as computed before: full logits over the padded batch, every position scored."""
    ids, attn, temps = batch["input_ids"], batch["attention_mask"], batch["temperatures"]
    logits = module.model(input_ids=ids, attention_mask=attn, use_cache=False).logits
    scaled = logits.float() / temps[:, None, None]
    logprobs = sequence_logprobs(scaled, ids)
    ent = torch.nn.functional.pad(entropy_from_logits(scaled[:, :-1]), (1, 0))
    if module.loss_config.entropy_coef == 0:
        ent = ent.detach()
    ref = None
    if module._ref:
        with torch.no_grad():
            ref = sequence_logprobs(module._ref[0](input_ids=ids, attention_mask=attn, use_cache=False).logits, ids, temps)
    out = policy_loss(logprobs, batch["behaviour_logprobs"], batch["advantages"], batch["loss_mask"], module.loss_config,
                      ref_logprobs=ref, entropy=ent, token_lags=module.token_lags(batch))
    return out.loss, out.metrics


def _grads(module: PolicyTrainer, loss: torch.Tensor) -> dict[str, torch.Tensor]:
    module.model.zero_grad(set_to_none=True)
    loss.backward()
    return {n: p.grad.clone() for n, p in module.model.named_parameters() if p.grad is not None}


@pytest.mark.parametrize("loss", [LossSettings(), LossSettings(mode="ppo", entropy_coef=0.01, kl_coef=0.05)],
                         ids=["decoupled", "ppo+entropy+kl"])
def test_loss_gradients_and_metrics_equal_the_full_padded_pass(tiny: Path, loss: LossSettings, one_thread: None) -> None:
    batch = _batch()
    assert len(length_chunks(batch["attention_mask"].sum(dim=1).tolist())) > 1  # the chunked path is exercised
    module = PolicyTrainer(tiny, loss)
    with torch.no_grad():  # move the policy off the reference so the KL term is not 0
        for p in module.model.parameters():
            p.add_(0.01 * torch.randn_like(p))
    got_loss, got_metrics = module.compute_loss(batch)
    want_loss, want_metrics = _reference(module, batch)
    torch.testing.assert_close(got_loss, want_loss, rtol=1e-5, atol=1e-6)
    got, want = _grads(module, got_loss), _grads(module, want_loss)
    assert got.keys() == want.keys() and len(got) == len(list(module.model.parameters()))
    for name in want:
        torch.testing.assert_close(got[name], want[name], rtol=1e-4, atol=1e-6, msg=name)
    for key, value in want_metrics.items():
        assert got_metrics[key] == pytest.approx(value, rel=1e-4, abs=1e-6), key
    if loss.kl_coef > 0:
        assert want_metrics["kl_ref"] > 0


def test_logprobs_are_zero_where_nothing_is_trained_and_a_model_without_logits_to_keep_scores_the_same(tiny: Path, one_thread: None) -> None:
    batch = _batch()
    module = PolicyTrainer(tiny)
    with torch.no_grad():
        lp, ent = module.scored_logprobs(batch, entropy="metric")

        class Plain(torch.nn.Module):  # a causal LM whose forward has no logits_to_keep
            def __init__(self, inner: torch.nn.Module) -> None:
                super().__init__()
                self.inner = inner

            def forward(self, input_ids: torch.Tensor, attention_mask: torch.Tensor, use_cache: bool = False) -> Any:
                return self.inner(input_ids=input_ids, attention_mask=attention_mask, use_cache=use_cache)

        plain, _ = module.scored_logprobs(batch, Plain(copy.deepcopy(module.model)))
    trained = batch["loss_mask"]
    assert not lp[~trained].any() and not ent[~trained].any()
    assert (lp[trained] < 0).all() and (ent[trained] > 0).all()
    torch.testing.assert_close(plain, lp, rtol=1e-5, atol=1e-6)


def test_token_logprobs_and_entropy_match_the_separate_functions() -> None:
    logits = torch.randn(3, 5, 11, requires_grad=True)
    targets = torch.randint(0, 11, (3, 5))
    lp, ent = token_logprobs_and_entropy(logits, targets)
    torch.testing.assert_close(lp, token_logprobs(logits, targets))
    torch.testing.assert_close(ent, entropy_from_logits(logits))
    assert lp.requires_grad and not ent.requires_grad  # a metric by default
    _, ent_grad = token_logprobs_and_entropy(logits, targets, entropy_grad=True)
    (g,) = torch.autograd.grad(ent_grad.sum(), logits)
    (want,) = torch.autograd.grad(entropy_from_logits(logits).sum(), logits)
    torch.testing.assert_close(g, want)


def _cost(chunks: list[list[int]], lengths: list[int], chunk_cost: int) -> int:
    return sum(len(c) * max(lengths[i] for i in c) + chunk_cost for c in chunks)


def test_length_chunks_cover_every_row_once_and_cost_the_least() -> None:
    rng = np.random.default_rng(0)
    for _ in range(30):
        lengths = [int(x) for x in rng.choice([3, 5, 6, 9, 30, 40], size=int(rng.integers(1, 9)))]
        for max_chunks in (1, 2, 3):
            chunks = length_chunks(lengths, max_chunks=max_chunks, chunk_cost=8)
            assert sorted(i for c in chunks for i in c) == list(range(len(lengths))) and 1 <= len(chunks) <= max_chunks
            order = sorted(range(len(lengths)), key=lambda i: (lengths[i], i))
            best = min(  # every split of the sorted rows into at most max_chunks runs
                _cost([order[a:b] for a, b in itertools.pairwise((0, *cuts, len(order)))], lengths, 8)
                for k in range(max_chunks)
                for cuts in itertools.combinations(range(1, len(order)), k)
            )
            assert _cost(chunks, lengths, 8) == best
    assert length_chunks([]) == [] and length_chunks([4, 4, 4]) == [[0, 1, 2]]
    assert length_chunks([40, 3, 3, 3, 3, 40], chunk_cost=8) == [[1, 2, 3, 4], [0, 5]]
    with pytest.raises(ValueError):
        length_chunks([1], max_chunks=0)
