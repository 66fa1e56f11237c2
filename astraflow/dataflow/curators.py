"""Pre-rollout curators: which prompts of the pool to roll out next, given their PromptStats.

Every curator is called as `curator(pool, stats, k)` (alias `select`) with the prompt pool, the
latest PromptStats by prompt_id (from the feedback topic) and how many prompts it should pick;
it returns a `Selection`: the chosen prompts and the ones it passed over with the reason. It
may choose fewer than k when the pool has too few eligible prompts: it scans the pool at most
once per call, so it never spins. Curators keep a little state (position in the epoch, RNG) and
are seedable, so a given seed and input give the same choices.

* `accept_all`: every prompt in turn, in order or reshuffled every epoch;
* `filter_solved`: skips prompts whose EWMA pass rate reached a threshold;
* `greso`: skips prompts with a zero-variance streak z with probability 1 - p^z (GRESO, "Act
  Only When It Pays", Zheng et al. 2025), p = p_easy or p_hard by whether the prompt was last
  all-solved or all-failed; p adapts toward a target share of zero-variance groups;
* `curriculum_target` / `curriculum_ordered` (module `curriculum`), `mix` (module `mixing`).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field

import numpy as np

from astraflow.dataflow.registry import register
from astraflow.errors import StrategyError
from astraflow.records import PromptStats


@dataclass(frozen=True, slots=True)
class Prompt:
    """One entry of a dataset that a curator may turn into a task."""

    prompt_id: str  # unique across datasets (e.g. "<dataset>/<index>")
    dataset: str  # dataset it belongs to
    difficulty: float | None = None  # larger = harder; used by the ordered curriculum


@dataclass(frozen=True, slots=True)
class Skipped:
    """A prompt a curator passed over, and why."""

    prompt: Prompt  # the prompt
    reason: str  # e.g. "solved: EWMA pass rate 0.95 >= 0.9"


@dataclass(frozen=True, slots=True)
class Selection:
    """What a curator chose this time."""

    chosen: list[Prompt]  # prompts to roll out, in order
    skipped: list[Skipped] = field(default_factory=list)  # prompts looked at and passed over


@dataclass(slots=True)
class EpochOrder:
    """Endless walk over indices 0..n-1, one epoch after another (reshuffled each epoch if asked)."""

    shuffle: bool = True  # permute each epoch; False = 0, 1, ..., n-1 every epoch
    seed: int = 0  # RNG seed of the permutations
    epoch: int = 0  # epochs started so far
    rng: np.random.Generator = field(init=False, repr=False)  # permutation source
    order: list[int] = field(default_factory=list, init=False, repr=False)  # current epoch's order
    pos: int = field(default=0, init=False)  # next position in `order`

    def __post_init__(self) -> None:
        self.rng = np.random.default_rng(self.seed)

    def next(self, n: int) -> int:
        """The next index for a pool of `n` items (a changed n starts a new epoch)."""
        if n <= 0:
            raise StrategyError("cannot pick from an empty pool")
        if self.pos >= len(self.order) or len(self.order) != n:
            self.order = [int(i) for i in self.rng.permutation(n)] if self.shuffle else list(range(n))
            self.pos = 0
            self.epoch += 1
        self.pos += 1
        return self.order[self.pos - 1]


def scan(
    pool: Sequence[Prompt], k: int, order: EpochOrder, skip_reason: Callable[[Prompt], str | None]
) -> Selection:
    """Walks the epoch order, keeping prompts `skip_reason` returns None for, until k are chosen
    or every prompt of the pool was looked at once."""
    chosen: list[Prompt] = []
    skipped: list[Skipped] = []
    for _ in range(len(pool)):
        if len(chosen) >= k:
            break
        prompt = pool[order.next(len(pool))]
        reason = skip_reason(prompt)
        if reason is None:
            chosen.append(prompt)
        else:
            skipped.append(Skipped(prompt, reason))
    return Selection(chosen, skipped)


@register("curator", "accept_all", version=1)
@dataclass(slots=True)
class AcceptAll:
    """Every prompt in turn: round robin (shuffle=False) or a fresh shuffle every epoch."""

    shuffle: bool = True  # reshuffle every epoch
    seed: int = 0  # RNG seed
    order: EpochOrder = field(init=False, repr=False)  # position in the epoch

    def __post_init__(self) -> None:
        self.order = EpochOrder(self.shuffle, self.seed)

    def select(self, pool: Sequence[Prompt], stats: Mapping[str, PromptStats], k: int) -> Selection:
        if not pool:
            return Selection([])
        return Selection([pool[self.order.next(len(pool))] for _ in range(k)])

    __call__ = select


@register("curator", "filter_solved", version=1)
@dataclass(slots=True)
class FilterSolved:
    """Skips prompts whose EWMA pass rate is >= `threshold` (already solved); others in turn."""

    threshold: float = 0.9  # EWMA pass rate at which a prompt counts as solved
    min_groups: int = 1  # groups needed before a prompt may be skipped
    shuffle: bool = True  # reshuffle every epoch
    seed: int = 0  # RNG seed
    order: EpochOrder = field(init=False, repr=False)  # position in the epoch

    def __post_init__(self) -> None:
        self.order = EpochOrder(self.shuffle, self.seed)

    def skip_reason(self, prompt: Prompt, stats: Mapping[str, PromptStats]) -> str | None:
        s = stats.get(prompt.prompt_id)
        if s is not None and s.groups >= self.min_groups and s.pass_rate_ewma >= self.threshold:
            return f"solved: EWMA pass rate {s.pass_rate_ewma:.3f} >= {self.threshold}"
        return None

    def select(self, pool: Sequence[Prompt], stats: Mapping[str, PromptStats], k: int) -> Selection:
        return scan(pool, k, self.order, lambda p: self.skip_reason(p, stats))

    __call__ = select


def greso_keep_probability(streak: int, p: float, floor: float = 0.0) -> float:
    """Probability that GRESO rolls out a prompt with `streak` consecutive zero-variance groups: p**streak."""
    if streak <= 0:
        return 1.0
    return max(p**streak, floor)


def adapt_exploration(
    p: float, observed: float, target: float, step: float, min_p: float, max_p: float
) -> float:
    """GRESO's controller: more zero-variance groups than the target -> lower p (skip more), else raise it."""
    p = p - step if observed >= target else p + step
    return min(max(p, min_p), max_p)


@register("curator", "greso", version=1)
@dataclass(slots=True)
class Greso:
    """GRESO selective rollout: skip prompts likely to give zero-variance groups again.

    A prompt with zero-variance streak z is kept with probability max(p**z, keep_floor), where p
    is `p_easy` if its last group passed (last_pass_rate >= 0.5: all solved) else `p_hard`.
    `observe()` adapts p_easy / p_hard after each batch of groups, by `step`, within
    [min_p, max_p], toward a target share of zero-variance groups (a third of it easy, two
    thirds hard, as in the paper's code: hard prompts are likelier to turn informative).
    """

    p_easy: float = 0.5  # base keep probability for all-solved prompts
    p_hard: float = 0.5  # base keep probability for all-failed prompts
    target_zero_variance: float = 0.25  # share of zero-variance groups aimed for
    step: float = 0.01  # change of p per observed batch
    min_p: float = 0.05  # exploration floor of p
    max_p: float = 0.95  # ceiling of p
    keep_floor: float = 0.0  # lowest keep probability of any prompt, however long its streak
    shuffle: bool = True  # reshuffle every epoch
    seed: int = 0  # RNG seed (skips and epoch order)
    order: EpochOrder = field(init=False, repr=False)  # position in the epoch
    rng: np.random.Generator = field(init=False, repr=False)  # coin flips

    def __post_init__(self) -> None:
        self.order = EpochOrder(self.shuffle, self.seed)
        self.rng = np.random.default_rng([self.seed, 1])

    def keep_probability(self, stats: PromptStats | None) -> float:
        if stats is None:
            return 1.0
        p = self.p_easy if stats.last_pass_rate >= 0.5 else self.p_hard
        return greso_keep_probability(stats.zero_variance_streak, p, self.keep_floor)

    def skip_reason(self, prompt: Prompt, stats: Mapping[str, PromptStats]) -> str | None:
        s = stats.get(prompt.prompt_id)
        keep = self.keep_probability(s)
        if keep >= 1.0 or self.rng.random() < keep:
            return None
        kind = "solved" if s is not None and s.last_pass_rate >= 0.5 else "failed"
        streak = s.zero_variance_streak if s is not None else 0
        return f"greso: all-{kind} streak {streak}, keep probability {keep:.3f}"

    def select(self, pool: Sequence[Prompt], stats: Mapping[str, PromptStats], k: int) -> Selection:
        return scan(pool, k, self.order, lambda p: self.skip_reason(p, stats))

    __call__ = select

    def observe(self, easy: int, hard: int, total: int) -> None:
        """Adapts p after a batch of `total` rolled-out groups, `easy` all-solved and `hard` all-failed."""
        if total <= 0:
            return
        target_easy, target_hard = self.target_zero_variance / 3, self.target_zero_variance * 2 / 3
        self.p_easy = adapt_exploration(
            self.p_easy, easy / total, target_easy, self.step, self.min_p, self.max_p
        )
        self.p_hard = adapt_exploration(
            self.p_hard, hard / total, target_hard, self.step, self.min_p, self.max_p
        )
