"""Curriculum curators: roll out prompts of the right difficulty for the policy as it is now.

* `curriculum_target`: samples prompts with weight exp(-|pass rate - target| / temperature),
  so prompts the policy solves about `target` of the time (0.5: the most reward variance for
  binary rewards) come up most; prompts never seen count as `unseen_pass_rate`.
* `curriculum_ordered`: prompts carry a `difficulty`; only levels up to a frontier are eligible
  and the frontier moves one level up once the eligible prompts' mean EWMA pass rate reaches
  `advance_at`.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

import numpy as np

from astraflow.dataflow.curators import EpochOrder, Prompt, Selection, Skipped
from astraflow.dataflow.registry import register
from astraflow.errors import StrategyError
from astraflow.records import PromptStats


def curriculum_weights(pass_rates: Sequence[float], target: float, temperature: float) -> np.ndarray:
    """Unnormalised weights exp(-|p - target| / temperature) of prompts with these pass rates."""
    if temperature <= 0:
        raise StrategyError(f"curriculum temperature must be > 0, got {temperature}")
    p = np.asarray(pass_rates, dtype=np.float64)
    return np.exp(-np.abs(p - target) / temperature)


@register("curator", "curriculum_target", version=1)
@dataclass(slots=True)
class CurriculumTarget:
    """Samples k distinct prompts, favouring EWMA pass rates near `target`."""

    target: float = 0.5  # pass rate to aim for
    temperature: float = 0.1  # smaller = sharper preference for the target
    unseen_pass_rate: float | None = None  # assumed pass rate of prompts without stats (None = target)
    seed: int = 0  # RNG seed
    rng: np.random.Generator = field(init=False, repr=False)  # sampler

    def __post_init__(self) -> None:
        self.rng = np.random.default_rng(self.seed)

    def pass_rates(self, pool: Sequence[Prompt], stats: Mapping[str, PromptStats]) -> list[float]:
        unseen = self.target if self.unseen_pass_rate is None else self.unseen_pass_rate
        return [s.pass_rate_ewma if (s := stats.get(p.prompt_id)) is not None else unseen for p in pool]

    def select(self, pool: Sequence[Prompt], stats: Mapping[str, PromptStats], k: int) -> Selection:
        if not pool or k <= 0:
            return Selection([])
        w = curriculum_weights(self.pass_rates(pool, stats), self.target, self.temperature)
        idx = self.rng.choice(len(pool), size=min(k, len(pool)), replace=False, p=w / w.sum())
        return Selection([pool[int(i)] for i in idx])

    __call__ = select


@register("curator", "curriculum_ordered", version=1)
@dataclass(slots=True)
class CurriculumOrdered:
    """Prompts up to a difficulty frontier, in turn; the frontier advances as they get solved."""

    advance_at: float = 0.7  # mean EWMA pass rate of eligible prompts that moves the frontier up
    min_seen: float = 0.5  # share of eligible prompts with stats needed before advancing
    shuffle: bool = True  # reshuffle eligible prompts every epoch
    seed: int = 0  # RNG seed
    level: int = 0  # index of the frontier among the pool's distinct difficulties
    order: EpochOrder = field(init=False, repr=False)  # position in the epoch

    def __post_init__(self) -> None:
        self.order = EpochOrder(self.shuffle, self.seed)

    @staticmethod
    def levels(pool: Sequence[Prompt]) -> list[float]:
        """Distinct difficulties of the pool, easiest first (missing difficulty = 0)."""
        return sorted({p.difficulty or 0.0 for p in pool})

    def maybe_advance(self, pool: Sequence[Prompt], stats: Mapping[str, PromptStats]) -> None:
        levels = self.levels(pool)
        if self.level >= len(levels) - 1:
            return
        eligible = [p for p in pool if (p.difficulty or 0.0) <= levels[self.level]]
        rates = [s.pass_rate_ewma for p in eligible if (s := stats.get(p.prompt_id)) is not None]
        if rates and len(rates) >= self.min_seen * len(eligible) and float(np.mean(rates)) >= self.advance_at:
            self.level += 1

    def select(self, pool: Sequence[Prompt], stats: Mapping[str, PromptStats], k: int) -> Selection:
        if not pool:
            return Selection([])
        self.maybe_advance(pool, stats)
        frontier = self.levels(pool)[min(self.level, len(self.levels(pool)) - 1)]
        eligible = [p for p in pool if (p.difficulty or 0.0) <= frontier]
        chosen = [eligible[self.order.next(len(eligible))] for _ in range(k)]
        skipped = [
            Skipped(p, f"beyond frontier: difficulty {p.difficulty} > {frontier}")
            for p in pool
            if (p.difficulty or 0.0) > frontier
        ]
        return Selection(chosen, skipped)

    __call__ = select
