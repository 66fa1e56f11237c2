"""Group assembly and per-policy training samples (curate's pure parts), with hand-built segments."""

from __future__ import annotations

import numpy as np
import pytest

from astraflow.records import NodeInfo, Segment, StrategyRef, Timings, Trajectory
from stream_apps.groups import GroupAssembler, policy_reward, train_sample, trained_policies

TP = ("scored", 0)


def gen(policy: str, ids: list[int], version: int, logp: float = -0.5) -> Segment:
    n = len(ids)
    return Segment(policy, "assistant", np.array(ids, np.int32), np.full(n, logp, np.float32),
                   np.ones(n, np.uint8), np.full(n, version, np.int32))


def traj(group: str, i: int, size: int, segments: list[Segment] | None = None, reward: float = 1.0, **kw) -> Trajectory:
    return Trajectory(
        trajectory_id=f"{group}/{i}", task_id=group, group_id=group, prompt_id="p", dataset="d", workflow="w",
        sample_index=i, group_size=size, segments=segments or [gen("a", [1, 2], 0)],
        timings=Timings(0, 0, 0), node=NodeInfo("n", "cpu", "local", "torch"), reward=reward, **kw,
    )


def test_group_completes_when_all_distinct_members_arrived() -> None:
    asm = GroupAssembler(timeout_s=10)
    assert asm.add(traj("g", 0, 3), "tok0", TP, 0.0).status == "held"
    assert asm.add(traj("g", 0, 3), "dup", TP, 0.1).status == "duplicate"  # redelivered
    assert asm.add(traj("g", 2, 3), "tok2", TP, 0.2).status == "held"
    done = asm.add(traj("g", 1, 3), "tok1", TP, 0.3)
    assert done.status == "complete" and done.group.complete
    assert [t.sample_index for t in done.group.trajectories] == [0, 1, 2]
    assert sorted(done.group.tokens) == ["tok0", "tok1", "tok2"]
    assert asm.add(traj("g", 1, 3), "late", TP, 0.4).status == "late"  # its group already left
    assert not asm.pending


def test_groups_expire_after_the_timeout_oldest_first() -> None:
    asm = GroupAssembler(timeout_s=5)
    asm.add(traj("g1", 0, 4), 1, TP, 0.0)
    asm.add(traj("g2", 0, 4), 2, TP, 3.0)
    assert asm.expire(4.9) == []
    expired = asm.expire(5.0)
    assert [g.group_id for g in expired] == ["g1"] and not expired[0].complete
    assert [g.group_id for g in asm.expire(8.0)] == ["g2"]
    assert asm.add(traj("g1", 1, 4), 3, TP, 9.0).status == "late"


def test_revoked_partitions_drop_their_pending_groups() -> None:
    asm = GroupAssembler(timeout_s=5)
    asm.add(traj("g1", 0, 2), 1, ("scored", 0), 0.0)
    asm.add(traj("g2", 0, 2), 2, ("scored", 1), 0.0)
    assert [g.group_id for g in asm.drop_partitions({("scored", 1)})] == ["g2"]
    assert list(asm.pending) == ["g1"]


def test_train_sample_concatenates_segments_and_masks_other_policies() -> None:
    prompt = Segment.context("a", "prompt", [7, 8, 9])
    solver = gen("a", [10, 11], version=3, logp=-0.25)
    verifier = gen("b", [20], version=5, logp=-1.0)
    tool = Segment.context("a", "tool", [30])
    answer = gen("a", [40, 41], version=4, logp=-0.75)
    t = traj("g", 0, 1, [prompt, solver, verifier, tool, answer], reward=1.0, reward_components={"policy.b": 0.0})
    a = train_sample(t, "a", lineage=[StrategyRef("reward", "reward", "exact_match", 1)])
    assert a.sample_id == "g/0#a" and a.policy == "a"
    assert a.token_ids.tolist() == [7, 8, 9, 10, 11, 20, 30, 40, 41]
    assert a.loss_mask.tolist() == [0, 0, 0, 1, 1, 0, 0, 1, 1]
    assert a.behaviour_logprobs.tolist() == [0, 0, 0, -0.25, -0.25, 0, 0, -0.75, -0.75]
    assert a.versions.tolist() == [-1, -1, -1, 3, 3, -1, -1, 4, 4]
    assert a.min_version == 3 and a.reward == 1.0 and a.lineage[0].name == "exact_match"
    b = train_sample(t, "b")
    assert b.loss_mask.tolist() == [0, 0, 0, 0, 0, 1, 0, 0, 0]
    assert b.versions.tolist() == [-1, -1, -1, -1, -1, 5, -1, -1, -1]
    assert b.min_version == 5 and b.reward == 0.0  # the per-policy reward component wins
    assert train_sample(t, "c") is None  # c trained nothing here
    assert trained_policies([t]) == ["a", "b"]


def test_policy_reward_needs_a_reward() -> None:
    t = traj("g", 0, 1, reward=None)
    with pytest.raises(ValueError):
        policy_reward(t, "a")
