"""Dataset mixing: each pick goes to a dataset in proportion to its weight.

Datasets are interleaved by smooth weighted round robin (the nginx upstream algorithm): every
dataset accumulates its weight each pick, the largest total wins and pays back the sum of all
weights. The mix is exact and deterministic: weights {a: 2, b: 1} give a, b, a, a, b, a, ...
and never a long run of one dataset. Within a dataset prompts come in turn (reshuffled each
epoch), so every dataset is walked completely at its own pace.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

from astraflow.dataflow.curators import EpochOrder, Prompt, Selection
from astraflow.dataflow.registry import register
from astraflow.errors import StrategyError
from astraflow.records import PromptStats


def smooth_weighted_round_robin(weights: Mapping[str, float], current: dict[str, float]) -> str:
    """One pick; `current` holds the running totals and is updated in place."""
    total = sum(weights.values())
    for name, w in weights.items():
        current[name] = current.get(name, 0.0) + w
    best = max(weights, key=lambda n: current[n])
    current[best] -= total
    return best


@register("curator", "mix", version=1)
@dataclass(slots=True)
class Mix:
    """Picks from several datasets of the pool in proportion to `weights` (by dataset name)."""

    weights: Mapping[str, float]  # dataset -> weight (> 0); datasets not named are not drawn from
    shuffle: bool = True  # reshuffle each dataset every epoch
    seed: int = 0  # RNG seed of the per-dataset orders
    current: dict[str, float] = field(default_factory=dict, init=False)  # round-robin totals
    orders: dict[str, EpochOrder] = field(default_factory=dict, init=False, repr=False)  # per dataset

    def __post_init__(self) -> None:
        bad = {k: v for k, v in self.weights.items() if not v > 0}
        if not self.weights or bad:
            raise StrategyError(
                f"mix weights must be a non-empty map of dataset -> positive weight, got {dict(self.weights)}"
            )

    def select(self, pool: Sequence[Prompt], stats: Mapping[str, PromptStats], k: int) -> Selection:
        by_dataset: dict[str, list[Prompt]] = {}
        for p in pool:
            if p.dataset in self.weights:
                by_dataset.setdefault(p.dataset, []).append(p)
        active = {name: w for name, w in self.weights.items() if name in by_dataset}
        if not active:
            return Selection([])
        chosen = []
        for _ in range(k):
            name = smooth_weighted_round_robin(active, self.current)
            if name not in self.orders:
                self.orders[name] = EpochOrder(self.shuffle, self.seed + len(self.orders))
            prompts = by_dataset[name]
            chosen.append(prompts[self.orders[name].next(len(prompts))])
        return Selection(chosen)

    __call__ = select
