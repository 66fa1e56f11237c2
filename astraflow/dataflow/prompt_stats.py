"""Per-prompt statistics that curators choose from: a pure update from one scored group.

The curate app calls `update_prompt_stats(previous, rewards, lengths, version)` for every group
it sees and publishes the result, keyed by prompt, on the compacted feedback topic:

* pass rate of the group = fraction of rewards strictly above `pass_threshold`;
* `pass_rate_ewma` = alpha * pass rate + (1 - alpha) * previous EWMA (the first group sets it);
* `zero_variance_streak` counts consecutive groups whose rewards were all equal (0 otherwise);
* `reward_mean` / `reward_std` / `mean_length` run over every sample seen (population std,
  pooled exactly from the stored mean, std and count).
"""

from __future__ import annotations

import math
from collections.abc import Sequence

from astraflow.errors import StrategyError
from astraflow.records import PromptStats, now_ms


def ewma(previous: float | None, value: float, alpha: float) -> float:
    """Exponentially weighted moving average; the first value (previous None) is taken as is."""
    if not 0.0 < alpha <= 1.0:
        raise StrategyError(f"EWMA alpha must be in (0, 1], got {alpha}")
    return value if previous is None else alpha * value + (1.0 - alpha) * previous


def pass_rate(rewards: Sequence[float], threshold: float = 0.5) -> float:
    """Fraction of rewards strictly above `threshold`."""
    if not rewards:
        raise StrategyError("pass rate of an empty group is undefined")
    return sum(r > threshold for r in rewards) / len(rewards)


def is_zero_variance(rewards: Sequence[float], atol: float = 0.0) -> bool:
    """Whether all rewards are equal within `atol` (the group gives no GRPO gradient)."""
    return max(rewards) - min(rewards) <= atol


def pooled_mean_std(n1: int, mean1: float, std1: float, values: Sequence[float]) -> tuple[int, float, float]:
    """(count, mean, population std) of a summary (n1, mean1, std1) joined with `values`."""
    n2 = len(values)
    mean2 = sum(values) / n2
    m2_new = sum((v - mean2) ** 2 for v in values)
    n = n1 + n2
    delta = mean2 - mean1
    m2 = std1 * std1 * n1 + m2_new + delta * delta * n1 * n2 / n
    return n, mean1 + delta * n2 / n, math.sqrt(m2 / n)


def update_prompt_stats(
    prev: PromptStats | None,
    rewards: Sequence[float],
    lengths: Sequence[int],
    version: int,
    *,
    alpha: float = 0.3,
    pass_threshold: float = 0.5,
    atol: float = 0.0,
    prompt_id: str | None = None,
    dataset: str | None = None,
    policy: str | None = None,
    updated_at: int | None = None,
) -> PromptStats:
    """New statistics of a prompt after one more scored group.

    `prompt_id`, `dataset` and `policy` are needed only for the first group (prev is None).
    `lengths` are the samples' lengths in tokens, one per reward.
    """
    if not rewards:
        raise StrategyError("update_prompt_stats needs at least one reward")
    if len(lengths) != len(rewards):
        raise StrategyError(
            f"got {len(rewards)} rewards but {len(lengths)} lengths; give one length per sample"
        )
    if prev is None and None in (prompt_id, dataset, policy):
        raise StrategyError("the first update of a prompt needs prompt_id, dataset and policy")
    rate = pass_rate(rewards, pass_threshold)
    flat = is_zero_variance(rewards, atol)
    n0, mean0, std0 = (prev.samples, prev.reward_mean, prev.reward_std) if prev else (0, 0.0, 0.0)
    samples, reward_mean, reward_std = pooled_mean_std(n0, mean0, std0, [float(r) for r in rewards])
    length0 = prev.mean_length * prev.samples if prev else 0.0
    return PromptStats(
        prompt_id=prev.prompt_id if prev else str(prompt_id),
        dataset=prev.dataset if prev else str(dataset),
        policy=prev.policy if prev else str(policy),
        groups=(prev.groups if prev else 0) + 1,
        samples=samples,
        last_pass_rate=rate,
        pass_rate_ewma=ewma(prev.pass_rate_ewma if prev else None, rate, alpha),
        reward_mean=reward_mean,
        reward_std=reward_std,
        mean_length=(length0 + sum(lengths)) / samples,
        zero_variance_streak=((prev.zero_variance_streak if prev else 0) + 1) if flat else 0,
        last_version=max(version, prev.last_version) if prev else version,
        updated_at=now_ms() if updated_at is None else updated_at,
    )
