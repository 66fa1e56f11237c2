"""Post-rollout filters: staleness, dynamic sampling, length, dedupe, chaining."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest

from astraflow.dataflow.filters import (
    Dedupe,
    FilterContext,
    Length,
    Staleness,
    ZeroVariance,
    apply_filters,
    min_trained_version,
)
from astraflow.dataflow.registry import get
from astraflow.errors import StrategyError
from astraflow.records import Segment, TrainSample, Trajectory, TrajectoryStatus
from astraflow.testing import make_trajectory

pytestmark = pytest.mark.unit
BASE = make_trajectory(32)


def traj(
    tid: str,
    *,
    group: str = "g",
    reward: float | None = None,
    versions: tuple[int, ...] = (5,),
    policy: str = "policy",
    status: TrajectoryStatus = TrajectoryStatus.OK,
) -> Trajectory:
    n = len(versions)
    generated = Segment(
        policy,
        "assistant",
        np.arange(n, dtype=np.int32),
        np.zeros(n, np.float32),
        np.ones(n, np.uint8),
        np.array(versions, np.int32),
    )
    prompt = Segment.context(policy, "prompt", [1, 2, 3])
    return dataclasses.replace(
        BASE, trajectory_id=tid, group_id=group, reward=reward, segments=[prompt, generated], status=status
    )


def ids(items: list) -> list[str]:
    return [getattr(i, "trajectory_id", None) or i.item.trajectory_id for i in items]


def test_min_trained_version_ignores_masked_tokens_and_other_policies() -> None:
    t = traj("t", versions=(8, 9))
    other = Segment(
        "critic",
        "assistant",
        np.array([1], np.int32),
        np.zeros(1, np.float32),
        np.ones(1, np.uint8),
        np.array([1], np.int32),
    )
    t.segments.append(other)
    assert min_trained_version(t) == 1
    assert min_trained_version(t, policy="policy") == 8
    assert min_trained_version(traj("c", versions=())) is None  # prompt only: nothing trained


def test_staleness_drop_and_keep_modes() -> None:
    items = [traj("fresh", versions=(8, 9)), traj("stale", versions=(7, 10)), traj("none", versions=())]
    ctx = FilterContext(current_version=10)
    dropped = Staleness(max_staleness=2)(items, ctx)  # lags: 2 (ok), 3 (> 2), none
    assert ids(dropped.kept) == ["fresh", "none"]
    assert ids(dropped.dropped) == ["stale"]
    assert dropped.dropped[0].reason == "stale: 3 versions behind (max 2)"
    kept = get("filter", "staleness", max_staleness=2, mode="keep")(items, ctx)
    assert ids(kept.kept) == ["fresh", "stale", "none"] and kept.dropped == []
    assert ids(kept.flagged) == ["stale"]
    with pytest.raises(StrategyError, match="current_version"):
        Staleness(max_staleness=2)(items)
    with pytest.raises(StrategyError, match="mode"):
        Staleness(max_staleness=2, mode="maybe")  # type: ignore[arg-type]


def test_staleness_on_train_samples() -> None:
    sample = TrainSample(
        sample_id="s1",
        trajectory_id="t1",
        group_id="g",
        prompt_id="p",
        policy="policy",
        token_ids=np.arange(4, dtype=np.int32),
        loss_mask=np.array([0, 1, 1, 1], np.uint8),
        behaviour_logprobs=np.zeros(4, np.float32),
        versions=np.array([-1, 5, 6, 6], np.int32),
        advantage=0.0,
        reward=1.0,
        min_version=5,
    )
    assert Staleness(max_staleness=4)([sample], FilterContext(current_version=9)).kept == [sample]
    out = Staleness(max_staleness=3)([sample], FilterContext(current_version=9))
    assert out.kept == [] and out.dropped[0].reason == "stale: 4 versions behind (max 3)"


def test_zero_variance_groups_are_dropped_whole() -> None:
    items = [
        traj("a1", group="a", reward=1.0),
        traj("b1", group="b", reward=1.0),
        traj("a2", group="a", reward=0.0),
        traj("b2", group="b", reward=1.0),
        traj("x", group="a", reward=None),
        traj("c1", group="c", reward=0.5),
        traj("c2", group="c", reward=0.5005),
    ]
    out = ZeroVariance()(items)
    assert ids(out.kept) == ["a1", "a2", "c1", "c2"]
    assert {d.item.trajectory_id: d.reason for d in out.dropped} == {
        "x": "no reward: score it before filtering",
        "b1": "zero-variance group: all 2 rewards = 1",
        "b2": "zero-variance group: all 2 rewards = 1",
    }
    assert ids(ZeroVariance(atol=1e-3)(items).kept) == ["a1", "a2"]  # c's spread 5e-4 counts as flat


def test_length_drops_truncated_and_long() -> None:
    items = [
        traj("short", versions=(1,) * 2),  # 3 prompt + 2 = 5 tokens
        traj("long", versions=(1,) * 10),  # 13 tokens
        traj("cut", versions=(1,), status=TrajectoryStatus.TRUNCATED),
    ]
    out = Length(max_tokens=12)(items)
    assert ids(out.kept) == ["short"]
    assert [d.reason for d in out.dropped] == ["too long: 13 tokens (max 12)", "truncated"]
    assert ids(Length(drop_truncated=False)(items).kept) == ["short", "long", "cut"]


def test_dedupe_remembers_a_bounded_lru_set() -> None:
    dedupe = Dedupe(capacity=2)
    a, b, c = traj("a"), traj("b"), traj("c")
    first = dedupe([a, b, a])
    assert ids(first.kept) == ["a", "b"] and first.dropped[0].reason == "duplicate id a"
    assert ids(dedupe([c]).kept) == ["c"]  # remembers a, c (b was least recent and is evicted)
    third = dedupe([a, b])
    assert ids(third.kept) == ["b"] and ids(third.dropped) == ["a"]
    assert ids(dedupe([c]).kept) == ["c"]  # c was evicted by b
    assert len(dedupe.seen) == 2
    with pytest.raises(StrategyError):
        Dedupe(capacity=0)


def test_apply_filters_chains_and_collects_reasons() -> None:
    items = [
        traj("a1", group="a", reward=1.0),
        traj("a2", group="a", reward=0.0),
        traj("a2", group="a", reward=0.0),  # redelivered duplicate
        traj("b1", group="b", reward=1.0, status=TrajectoryStatus.TRUNCATED),
        traj("b2", group="b", reward=1.0),
    ]
    out = apply_filters(items, [Dedupe(), Length(), ZeroVariance()])
    assert ids(out.kept) == ["a1", "a2"]
    assert [d.reason.split(":")[0] for d in out.dropped] == [
        "duplicate id a2",
        "truncated",
        "zero-variance group",
    ]
