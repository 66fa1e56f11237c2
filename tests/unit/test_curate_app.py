"""The curate app driven by hand on a `FakeWorker` (tests/unit/stream_fakes.py), without a broker:
groups, per-policy GRPO advantages, filters, timeouts, duplicates."""

from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass
from typing import Any

import numpy as np
import pytest
from stream_fakes import EXP, by_policy, feed, make_curate, two_policy_traj

from astraflow.dataflow.registry import register
from astraflow.kafka.topics import Topics
from stream_apps.groups import Group


def test_curate_group_gives_per_policy_grpo_advantages_and_feedback() -> None:
    app, w = make_curate()
    rewards = [1.0, 0.0, 1.0, 0.0]
    trajs = [two_policy_traj("g", i, 4, r, with_b=i < 3) for i, r in enumerate(rewards)]
    feed(app, trajs[:3])
    assert w.sent == [] and len(app.store.held) == 3  # held in memory, their offsets in the groups table
    feed(app, trajs[3:])
    assert not w.tables["groups"] and not app.store.held and list(w.tables["emitted"]) == [b"g"]
    adv = by_policy(w)
    # policy a: rewards 1,0,1,0 -> mean .5, std .5 -> +-0.5 / (0.5 + 1e-6)
    assert adv["a"] == pytest.approx({"g/0": 1.0, "g/1": -1.0, "g/2": 1.0, "g/3": -1.0}, abs=1e-5)
    # policy b trained only in samples 0-2: rewards 1,0,1 -> mean 2/3, std sqrt(2)/3
    s = np.sqrt(2) / 3
    assert adv["b"] == pytest.approx({"g/0": (1 / 3) / s, "g/1": (-2 / 3) / s, "g/2": (1 / 3) / s}, abs=1e-5)
    lineage = [(r.app, r.slot, r.name) for r in w.sent[0][1].lineage]
    assert lineage[-1] == ("curate", "advantage", "grpo") and ("curate", "filter.zero_variance", "zero_variance") in lineage
    keys = {k: st for _, st, k in w.side}
    assert set(keys) == {"a/prompt-g", "b/prompt-g"}
    assert keys["a/prompt-g"].groups == 1 and keys["a/prompt-g"].last_pass_rate == 0.5
    assert keys["b/prompt-g"].samples == 3 and keys["b/prompt-g"].last_version == 3


def test_curate_filters_zero_variance_and_stale_samples_and_follows_advantage_swap() -> None:
    app, w = make_curate(policies=("a",), versions={"a": 20})
    feed(app, [two_policy_traj("flat", i, 2, 1.0, False, version=19) for i in range(2)])  # all solved
    assert w.sent == [] and w.dropped["zero_variance"] == 2
    feed(app, [two_policy_traj("old", i, 2, float(i), False, version=3) for i in range(2)])  # 17 versions behind
    assert w.sent == [] and w.dropped["staleness"] == 2
    w.control.set("curate", "advantage", "dr_grpo")
    w.control.set("curate", "filter.staleness", "none")
    feed(app, [two_policy_traj("ok", i, 2, float(i), False, version=3) for i in range(2)])
    assert by_policy(w)["a"] == {"ok/0": -0.5, "ok/1": 0.5}
    assert w.sent[0][1].lineage[-1].name == "dr_grpo"
    feedback = [r for t, r, _ in w.side if t == Topics(EXP).feedback]
    assert len(feedback) == 3  # feedback for every group, filtered or not
    # Every drop is a record on the lineage topic: group, trajectories, filter slot, strategy, reason.
    drops = [(k, r.filter, r.strategy, r.policy, sorted(r.trajectory_ids), r.reason) for t, r, k in w.side
             if t == Topics(EXP).lineage]
    assert [d[:5] for d in drops] == [("flat", "filter.zero_variance", "zero_variance", "a", ["flat/0", "flat/1"]),
                                      ("old", "filter.staleness", "staleness", "a", ["old/0", "old/1"])]
    assert "17" in drops[1][5] and drops[0][5], drops  # the filter's own words: 17 versions behind


def test_curate_timeouts_emit_big_enough_partial_groups_and_drop_small_ones() -> None:
    app, w = make_curate(policies=("a",), group_timeout_s=1.0, min_group_size=2)
    feed(app, [two_policy_traj("big", i, 4, float(i), False) for i in range(3)])
    small = feed(app, [two_policy_traj("small", 0, 4, 1.0, False)])
    assert w.sent == [] and len(w.tables["groups"]) == 2
    asyncio.run(app.tick(0.0))  # not yet
    assert w.sent == []
    later = time.time() + 5
    app._now = lambda: later  # type: ignore[method-assign]
    asyncio.run(app.tick(0.0))
    assert sorted(s.trajectory_id for _, s, _ in w.sent) == ["big/0", "big/1", "big/2"]
    assert w.dropped["incomplete_group"] == 1 and not w.tables["groups"] and len(w.tables["emitted"]) == 2
    # The small group's member is not dropped unseen: it is in the DLQ, original bytes and reason.
    assert [(d[0].value, d[0].offset) for d in w.dead] == [(small[0].value, small[0].offset)]
    assert "timed out" in w.dead[0][1] and "1 of 4 members" in w.dead[0][1]
    assert {k for t, _, k in w.side if t == Topics(EXP).feedback} == {"a/prompt-big", "a/prompt-small"}  # stats even for the dropped group
    # A member arriving after its group left without it is dead-lettered too; a redelivered one is dropped.
    late = feed(app, [two_policy_traj("big", 3, 4, 3.0, False), two_policy_traj("big", 0, 4, 0.0, False)])
    assert w.dropped["late_trajectory"] == 1 and w.dropped["superseded"] == 1
    assert w.dead[-1][0].value == late[0].value and "emitted without it" in w.dead[-1][1] and len(w.dead) == 2
    assert len(w.sent) == 3
    assert not [x for x in w.side if x[0] == Topics(EXP).lineage]  # the DLQ says why, not the lineage topic


@register("filter", "unit_explode", version=1)
@dataclass(frozen=True)
class Explode:
    """Raises on any group of prompt `prompt_id` (a broken plug-in)."""

    prompt_id: str = "prompt-boom"

    def __call__(self, items: list[Any], ctx: Any = None) -> Any:
        if any(i.prompt_id == self.prompt_id for i in items):
            raise RuntimeError("kaboom")
        from astraflow.dataflow.filters import FilterResult

        return FilterResult(list(items))


def test_a_raising_extra_filter_dead_letters_its_whole_group_by_name() -> None:
    app, w = make_curate(policies=("a",))
    w.control.set("curate", "filter.explode", "unit_explode")  # any filter.<name> slot joins the chain
    incs = feed(app, [two_policy_traj("boom", i, 2, float(i), False) for i in range(2)])
    assert sorted((d[0].offset, d[0].value, d[2]) for d in w.dead) == [
        (incs[0].offset, incs[0].value, "unit_explode"), (incs[1].offset, incs[1].value, "unit_explode")]  # original bytes
    assert "kaboom" in w.dead[0][1] and w.sent == []
    feed(app, [two_policy_traj("fine", i, 2, float(i), False) for i in range(2)])
    assert len(w.sent) == 2 and w.sent[0][1].lineage[-2].name == "unit_explode"


def test_curate_drops_duplicates_late_records_and_unrouted_policies() -> None:
    app, w = make_curate(policies=("a",))
    t0, t1 = (two_policy_traj("g", i, 2, float(i), with_b=True) for i in range(2))
    feed(app, [t0, t0, t1, t1])
    assert w.dropped["superseded"] == 2 and not w.dead
    assert {s.policy for _, s, _ in w.sent} == {"a"} and w.dropped["unrouted_policy"] == 2


def test_curate_group_process_is_usable_directly() -> None:
    app, _ = make_curate(policies=("a",))
    g = Group("g", 2, 0, 0.0, complete=True)
    for i in range(2):
        t = two_policy_traj("g", i, 2, float(i), False)
        g.members[t.trajectory_id] = (t, None)
    outputs, feedback = app.process(g)
    assert [s.advantage for _, s, _ in outputs] == pytest.approx([-1.0, 1.0], abs=1e-5)
    assert [k for k, _ in feedback] == ["a/prompt-g"]


def test_curate_computes_advantages_on_the_whole_group_before_filters_mask() -> None:
    """DAPO-style: two stale members are masked out, but the survivors' advantages are those of
    the full group of four (rewards 1, 0, 0, 0), not of the two left (1, 0)."""
    app, w = make_curate(policies=("a",), versions={"a": 20})
    versions = [19, 19, 3, 3]  # members 2 and 3 are 17 versions behind: stale
    feed(app, [two_policy_traj("mix", i, 4, r, False, version=v) for i, (r, v) in enumerate(zip([1.0, 0.0, 0.0, 0.0], versions, strict=True))])
    assert w.dropped["staleness"] == 2
    std = np.std([1.0, 0.0, 0.0, 0.0])
    assert by_policy(w)["a"] == pytest.approx({"mix/0": 0.75 / std, "mix/1": -0.25 / std}, abs=1e-4)


def test_error_trajectories_are_never_trained_nor_in_their_siblings_baseline() -> None:
    from astraflow.records import TrajectoryStatus

    app, w = make_curate(policies=("a",))
    w.control.set("curate", "filter.length", "none")  # not a strategy: no control record turns it off
    trajs = [two_policy_traj("g", i, 3, r, False) for i, r in enumerate([1.0, 0.0, 0.0])]
    trajs[2].status, trajs[2].error = TrajectoryStatus.ERROR, "BackendError: the engine died"
    feed(app, trajs)
    assert by_policy(w)["a"] == pytest.approx({"g/0": 1.0, "g/1": -1.0}, abs=1e-5)  # 2-member baseline
    assert w.dropped["error_trajectory"] == 1 and not w.dead
    [drop] = [r for t, r, _ in w.side if t == Topics(EXP).lineage]
    assert drop.trajectory_ids == ["g/2"] and drop.filter == "status" and "engine died" in drop.reason
