"""The loss at any world size (`astraflow.rl.losses`: `aggregation_count`,
`data_parallel_normaliser`, `aggregate(normaliser=...)`) and how a batch's rows are dealt to ranks
(`trainers.batching.minibatch_rows`, `rank_rows`): with gradients averaged over ranks (what DDP
and FSDP do), the ranks' shares give one rank's gradient on the whole batch, for every
aggregation; a per-rank mean would not."""

from __future__ import annotations

import pytest
import torch

from astraflow.errors import RLError
from astraflow.rl import PolicyLossConfig, aggregate, aggregation_count, data_parallel_normaliser, policy_loss
from trainers.batching import minibatch_rows, rank_rows

AGGREGATIONS = ["token_mean", "seq_mean_token_mean", "seq_mean_token_sum_norm"]


def _batch(seed: int = 0) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    b, t = 7, 9
    lengths = torch.tensor([1, 8, 3, 0, 5, 2, 4])  # trained tokens per row, one row with none
    mask = torch.arange(t)[None, :] >= (t - lengths)[:, None]
    logits = torch.randn(b, t, generator=g, requires_grad=True)
    behaviour = -torch.rand(b, t, generator=g) - 0.5
    adv = torch.randn(b, generator=g)
    return logits, behaviour, adv, mask


def _grad(loss_of_rows, rows_per_rank: list[list[int]], logits: torch.Tensor) -> torch.Tensor:
    """The gradient data parallelism gives: each rank's loss on its rows, gradients averaged."""
    total = torch.zeros_like(logits)
    for rows in rows_per_rank:
        x = logits.detach().clone().requires_grad_(True)
        loss_of_rows(x, rows).backward()
        total += x.grad
    return total / len(rows_per_rank)


@pytest.mark.parametrize("aggregation", AGGREGATIONS)
def test_ranks_shares_average_to_one_ranks_gradient(aggregation: str) -> None:
    logits, behaviour, adv, mask = _batch()
    config = PolicyLossConfig(mode="ppo", aggregation=aggregation, max_tokens=16, kl_coef=0.0)

    def loss(x: torch.Tensor, rows: list[int], world: int = 1, share: bool = True) -> torch.Tensor:
        lp = torch.log_softmax(torch.stack([x, torch.zeros_like(x)], -1), -1)[..., 0]
        normaliser = None
        if world > 1 and share:
            total = aggregation_count(mask, aggregation)  # the all-reduced count of every rank's rows
            normaliser = data_parallel_normaliser(total, world)
        return policy_loss(lp[rows], behaviour[rows], adv[rows], mask[rows], config, normaliser=normaliser).loss

    one = _grad(lambda x, rows: loss(x, rows), [list(range(7))], logits)
    for world in (2, 3):
        dealt = [[r for part in rank_rows(7, 1, world, k) for r in part] for k in range(world)]
        assert sorted(r for rows in dealt for r in rows) == list(range(7))
        many = _grad(lambda x, rows, w=world: loss(x, rows, w), dealt, logits)
        torch.testing.assert_close(many, one, rtol=1e-5, atol=1e-7)
        if world == 2:  # shares of unequal counts (4 and 3 rows, 4 and 2 with tokens): a per-rank mean is off
            per_rank_mean = _grad(lambda x, rows, w=world: loss(x, rows, w, share=False), dealt, logits)
            assert (per_rank_mean - one).abs().max() > 1e-3


def test_aggregation_count_is_what_aggregate_divides_by() -> None:
    _, _, _, mask = _batch()
    values = torch.rand(mask.shape)
    for aggregation in AGGREGATIONS:
        count = aggregation_count(mask, aggregation)
        assert torch.allclose(aggregate(values, mask, aggregation, 16, normaliser=count), aggregate(values, mask, aggregation, 16))
    assert aggregation_count(mask, "token_mean") == 23 and aggregation_count(mask, "seq_mean_token_mean") == 6
    assert aggregation_count(mask, "seq_mean_token_sum_norm") == 7
    assert data_parallel_normaliser(0.0, 2) == 0.5  # an empty batch: as one rank's clamp at 1
    with pytest.raises(RLError):
        data_parallel_normaliser(4.0, 0)


def test_rows_are_dealt_per_optimizer_step_the_same_at_any_world_size() -> None:
    assert minibatch_rows(7, 3) == [[0, 1, 2], [3, 4], [5, 6]]
    assert minibatch_rows(2, 3) == [[0], [1]]  # never an empty step
    for n, m, world in ((8, 2, 2), (13, 3, 4), (6, 1, 3)):
        steps = minibatch_rows(n, m)
        dealt = [rank_rows(n, m, world, r) for r in range(world)]
        for k, rows in enumerate(steps):
            assert sorted(x for d in dealt for x in d[k]) == rows  # each step: the same rows over all ranks
            if n >= world * m:
                assert all(d[k] for d in dealt)  # every rank has a row in every step
    with pytest.raises(ValueError):
        rank_rows(4, 1, 2, 2)
