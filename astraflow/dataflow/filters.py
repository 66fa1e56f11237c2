"""Post-rollout filters over trajectories (or training samples): what reaches the trainer.

Each filter is a small object called as `f(items, ctx)` and returns a `FilterResult`: the kept
items in their order, and every dropped item with the reason (for the DLQ or metrics).
Filters work on one group or on a batch of several; those that reason about groups (zero
variance) group by `group_id` themselves.

* `staleness`: drop (or only flag) items whose oldest trained token is more than S versions
  behind the trainer's current version;
* `zero_variance`: dynamic sampling (DAPO): drop groups whose rewards are all equal, which
  give zero advantage and so no gradient;
* `length`: drop truncated rollouts and over-long ones;
* `dedupe`: drop ids seen recently (at-least-once delivery redelivers), with bounded memory.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Generic, Literal, TypeVar

import numpy as np

from astraflow.dataflow.registry import register
from astraflow.errors import StrategyError
from astraflow.records import TrainSample, Trajectory, TrajectoryStatus

T = TypeVar("T", Trajectory, TrainSample)


@dataclass(frozen=True, slots=True)
class Dropped(Generic[T]):
    """An item a filter removed, and why."""

    item: T  # the trajectory or sample
    reason: str  # human-readable cause, e.g. "stale: 5 versions behind (max 2)"


@dataclass(frozen=True, slots=True)
class FilterResult(Generic[T]):
    """What a filter kept and what it dropped."""

    kept: list[T]  # survivors, in input order
    dropped: list[Dropped[T]] = field(default_factory=list)  # removed items with reasons
    flagged: list[Dropped[T]] = field(default_factory=list)  # kept, but would be dropped in drop mode


@dataclass(frozen=True, slots=True)
class FilterContext:
    """What filters may need beyond the items themselves."""

    current_version: int | None = None  # the trainer's latest published policy version


def item_id(item: Trajectory | TrainSample) -> str:
    """The identity used for dedupe: trajectory_id or sample_id."""
    return item.trajectory_id if isinstance(item, Trajectory) else item.sample_id


def item_length(item: Trajectory | TrainSample) -> int:
    """Total tokens of the item."""
    return item.num_tokens if isinstance(item, Trajectory) else len(item.token_ids)


def min_trained_version(item: Trajectory | TrainSample, policy: str | None = None) -> int | None:
    """Oldest policy version among trained tokens (loss_mask == 1), or None if there are none."""
    if isinstance(item, TrainSample):
        return item.min_version if np.any(item.loss_mask) else None
    oldest: int | None = None
    for seg in item.segments:
        if policy is not None and seg.policy != policy:
            continue
        versions = np.asarray(seg.versions)[np.asarray(seg.loss_mask) == 1]
        if versions.size:
            v = int(versions.min())
            oldest = v if oldest is None else min(oldest, v)
    return oldest


@register("filter", "staleness", version=1)
@dataclass(frozen=True, slots=True)
class Staleness:
    """Items whose oldest trained token is more than `max_staleness` versions behind the trainer."""

    max_staleness: int  # S: allowed versions between the oldest trained token and the trainer
    mode: Literal["drop", "keep"] = "drop"  # keep: let stale items through, listed in `flagged`
    policy: str | None = None  # count only this policy's segments of a trajectory

    def __post_init__(self) -> None:
        if self.mode not in ("drop", "keep"):
            raise StrategyError(f"staleness mode must be 'drop' or 'keep', got {self.mode!r}")
        if self.max_staleness < 0:
            raise StrategyError(f"max_staleness must be >= 0, got {self.max_staleness}")

    def __call__(self, items: Sequence[T], ctx: FilterContext = FilterContext()) -> FilterResult[T]:
        if ctx.current_version is None:
            raise StrategyError("the staleness filter needs FilterContext(current_version=...)")
        kept: list[T] = []
        stale: list[Dropped[T]] = []
        for item in items:
            oldest = min_trained_version(item, self.policy)
            lag = None if oldest is None else ctx.current_version - oldest
            if lag is not None and lag > self.max_staleness:
                stale.append(Dropped(item, f"stale: {lag} versions behind (max {self.max_staleness})"))
                if self.mode == "keep":
                    kept.append(item)
            else:
                kept.append(item)
        if self.mode == "keep":
            return FilterResult(kept, [], stale)
        return FilterResult(kept, stale)


@register("filter", "zero_variance", version=1)
@dataclass(frozen=True, slots=True)
class ZeroVariance:
    """Dynamic sampling: drops every group whose rewards are all equal (within `atol`)."""

    atol: float = 0.0  # rewards closer than this count as equal

    def __call__(self, items: Sequence[T], ctx: FilterContext = FilterContext()) -> FilterResult[T]:
        groups: dict[str, list[float]] = {}
        dropped: list[Dropped[T]] = []
        for item in items:
            if item.reward is None:
                dropped.append(Dropped(item, "no reward: score it before filtering"))
            else:
                groups.setdefault(item.group_id, []).append(float(item.reward))
        flat = {gid for gid, rewards in groups.items() if max(rewards) - min(rewards) <= self.atol}
        kept: list[T] = []
        for item in items:
            if item.reward is None:
                continue
            if item.group_id in flat:
                rewards = groups[item.group_id]
                dropped.append(
                    Dropped(item, f"zero-variance group: all {len(rewards)} rewards = {rewards[0]:g}")
                )
            else:
                kept.append(item)
        return FilterResult(kept, dropped)


@register("filter", "length", version=1)
@dataclass(frozen=True, slots=True)
class Length:
    """Drops truncated rollouts (status TRUNCATED) and items longer than `max_tokens`."""

    max_tokens: int | None = None  # longest total length kept; None = no bound
    drop_truncated: bool = True  # drop trajectories that hit the generation limit

    def __call__(self, items: Sequence[T], ctx: FilterContext = FilterContext()) -> FilterResult[T]:
        kept: list[T] = []
        dropped: list[Dropped[T]] = []
        for item in items:
            n = item_length(item)
            if (
                self.drop_truncated
                and isinstance(item, Trajectory)
                and item.status == TrajectoryStatus.TRUNCATED
            ):
                dropped.append(Dropped(item, "truncated"))
            elif self.max_tokens is not None and n > self.max_tokens:
                dropped.append(Dropped(item, f"too long: {n} tokens (max {self.max_tokens})"))
            else:
                kept.append(item)
        return FilterResult(kept, dropped)


@register("filter", "dedupe", version=1)
@dataclass(slots=True)
class Dedupe:
    """Drops items whose id was seen among the last `capacity` distinct ids (an LRU set)."""

    capacity: int = 100_000  # distinct ids remembered; memory is O(capacity)
    seen: OrderedDict[str, None] = field(default_factory=OrderedDict, repr=False)  # id -> None, oldest first

    def __post_init__(self) -> None:
        if self.capacity < 1:
            raise StrategyError(f"dedupe capacity must be >= 1, got {self.capacity}")

    def __call__(self, items: Sequence[T], ctx: FilterContext = FilterContext()) -> FilterResult[T]:
        kept: list[T] = []
        dropped: list[Dropped[T]] = []
        for item in items:
            key = item_id(item)
            if key in self.seen:
                self.seen.move_to_end(key)
                dropped.append(Dropped(item, f"duplicate id {key}"))
                continue
            self.seen[key] = None
            if len(self.seen) > self.capacity:
                self.seen.popitem(last=False)
            kept.append(item)
        return FilterResult(kept, dropped)


def apply_filters(
    items: Sequence[T], filters: Sequence[object], ctx: FilterContext = FilterContext()
) -> FilterResult[T]:
    """Runs filters in order, each on the previous one's survivors; merges drops and flags."""
    kept = list(items)
    dropped: list[Dropped[T]] = []
    flagged: list[Dropped[T]] = []
    for f in filters:
        result: FilterResult[T] = f(kept, ctx)  # type: ignore[operator]
        kept = result.kept
        dropped.extend(result.dropped)
        flagged.extend(result.flagged)
    return FilterResult(kept, dropped, flagged)
