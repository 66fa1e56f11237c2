"""Group assembly (GroupStore over plain mappings) and per-policy training samples, with hand-built segments."""

from __future__ import annotations

import json
from typing import Any

import numpy as np
import pytest

from astraflow.records import NodeInfo, Segment, StrategyRef, Timings, Trajectory
from astraflow.serde import AvroSerde
from astraflow.testing import make_trajectory
from stream_apps.groups import (
    BAD_INDEX,
    DUPLICATE_SAMPLE,
    NO_TASK,
    NOT_ITS_TASK,
    WRONG_SIZE,
    GroupStore,
    TaskClaim,
    forget_partitions,
    policy_reward,
    train_samples,
    trained_policies,
)


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


SOURCE: dict[tuple[int, int], bytes] = {}  # (partition, offset) -> bytes: the source topic a store reads members from


def from_source(partition: int, offsets: list[int]) -> dict[int, bytes]:
    return {o: SOURCE[(partition, o)] for o in offsets if (partition, o) in SOURCE}


def store(timeout_s: float) -> GroupStore:
    serde = AvroSerde()
    return GroupStore({}, {}, lambda b: serde.loads(b, Trajectory), from_source, timeout_s)


def add(st: GroupStore, t: Trajectory, now: float, partition: int = 0, offset: int = 0,
        task: TaskClaim | str | None = "own") -> Any:
    """Adds `t`; its group's task is, by default, the one its claims describe (an honest member)."""
    value = AvroSerde().dumps(t)
    SOURCE[(partition, offset)] = value
    claim = TaskClaim(t.task_id, t.group_id, t.prompt_id, t.group_size) if task == "own" else task
    return st.add(t, value, partition, offset, now, claim)  # type: ignore[arg-type]


def test_group_completes_when_all_distinct_members_arrived() -> None:
    st = store(timeout_s=10)
    assert add(st, traj("g", 0, 3), 0.0, offset=5).status == "held"
    assert add(st, traj("g", 0, 3), 0.1).status == "superseded"  # redelivered
    assert add(st, traj("g", 2, 3), 0.2, offset=7).status == "held"
    done = add(st, traj("g", 1, 3), 0.3, offset=9)
    assert done.status == "complete" and done.group.complete
    assert [t.sample_index for t in done.group.trajectories] == [0, 1, 2]
    assert sorted(m.offset for m in done.group.tokens) == [5, 7, 9]  # where each member came from, for the DLQ
    assert add(st, traj("g", 1, 3), 0.4).status == "superseded"  # its group already left, with it
    assert not st.groups and not st.held and list(st.emitted) == [b"g"]


def test_the_group_is_its_task_and_members_that_disagree_are_refused_by_rule() -> None:
    st = store(timeout_s=10)
    task = TaskClaim("g", "g", "p", 3)
    assert add(st, traj("g", 0, 3), 0.0, offset=1, task=task).status == "held"
    # A hijack: the group's id with group_size=1, which would have completed it alone.
    hijack = add(st, traj("g", 1, 1), 0.1, offset=2, task=task)
    assert (hijack.status, hijack.rule) == ("refused", WRONG_SIZE) and "asked for 3" in hijack.reason
    assert add(st, traj("g", 3, 3), 0.1, task=task).rule == BAD_INDEX
    assert add(st, traj("g", -1, 3), 0.1, task=task).rule == BAD_INDEX
    other = traj("g", 1, 3)
    other.trajectory_id = "evil/1"  # sample 1 is still free: an id that is not the task's
    assert add(st, other, 0.1, task=task).rule == NOT_ITS_TASK
    dup = traj("g", 0, 3)
    dup.trajectory_id = "evil/0"  # sample 0 is taken by g/0
    refused = add(st, dup, 0.1, task=task)
    assert refused.rule == DUPLICATE_SAMPLE and "g/0 already holds" in refused.reason
    wrong_prompt = traj("g", 1, 3)
    wrong_prompt.prompt_id = "q"
    assert add(st, wrong_prompt, 0.1, task=task).rule == NOT_ITS_TASK
    assert add(st, traj("nobody", 0, 1), 0.1, task=None).rule == NO_TASK
    assert list(st.groups) == [b"g"] and json.loads(st.groups[b"g"])["members"] == ["g/0"]  # refusals changed nothing
    assert add(st, traj("g", 0, 3), 0.2, task=task).status == "superseded"  # the task redelivered: same id
    assert add(st, traj("g", 1, 3), 0.3, offset=3, task=task).status == "held"
    done = add(st, traj("g", 2, 3), 0.4, offset=4, task=task)  # the honest members complete the group
    assert done.status == "complete" and [t.trajectory_id for t in done.group.trajectories] == ["g/0", "g/1", "g/2"]
    late_dup = traj("g", 2, 3)
    late_dup.trajectory_id = "evil/2"
    assert add(st, late_dup, 0.5, task=task).rule == DUPLICATE_SAMPLE  # after it left, too
    assert add(st, traj("g", 2, 3), 0.5, task=task).status == "superseded"  # re-issued: dropped, not an attack


def test_groups_expire_after_the_timeout_oldest_first() -> None:
    st = store(timeout_s=5)
    add(st, traj("g1", 0, 4), 0.0)
    add(st, traj("g2", 0, 4), 3.0)
    assert st.expired(4.9) == []
    expired = st.expired(5.0)
    assert [p.group_id for p in expired] == ["g1"]
    group = st.take(expired[0], 5.0)
    assert not group.complete and [t.trajectory_id for t in group.trajectories] == ["g1/0"]
    assert [p.group_id for p in st.expired(8.0)] == ["g2"]
    late = add(st, traj("g1", 1, 4), 9.0)  # its group left without it: curate dead-letters it
    assert late.status == "late" and late.emitted["members"] == ["g1/0"] and not late.emitted["complete"]
    assert add(st, traj("g1", 0, 4), 9.5).status == "superseded"


def test_state_is_plain_bytes_so_another_worker_resumes_it_reading_members_again() -> None:
    st = store(timeout_s=5)
    add(st, traj("g", 0, 3), 0.0, partition=1, offset=3)
    add(st, traj("g", 2, 3), 0.0, partition=1, offset=8)
    entry = json.loads(st.groups[b"g"])  # ids and offsets, not the trajectories
    assert entry["members"] == ["g/0", "g/2"] and entry["offsets"] == [3, 8] and len(st.groups[b"g"]) < 200
    fetched: list[tuple[int, list[int]]] = []

    def fetch(partition: int, offsets: list[int]) -> dict[int, bytes]:
        fetched.append((partition, sorted(offsets)))
        return from_source(partition, offsets)

    again = GroupStore(dict(st.groups), dict(st.emitted), st.decode, fetch, 5)  # e.g. rebuilt from the changelog
    assert not again.held  # the members' bytes stayed with the first worker
    done = add(again, traj("g", 1, 3), 1.0, partition=1, offset=9)
    assert done.status == "complete" and [t.sample_index for t in done.group.trajectories] == [0, 1, 2]
    assert fetched == [(1, [3, 8])]  # only those it had not read itself, from the source, at their offsets
    assert sorted(m.offset for m in done.group.tokens) == [3, 8, 9] and not done.group.lost


def test_a_member_the_source_no_longer_has_is_reported_lost() -> None:
    st = store(timeout_s=5)
    add(st, traj("g", 0, 2), 0.0, partition=0, offset=40)
    again = GroupStore(dict(st.groups), dict(st.emitted), st.decode, lambda p, offs: {}, 5)  # retention deleted offset 40
    done = add(again, traj("g", 1, 2), 1.0, partition=0, offset=41)
    assert done.status == "complete" and done.group.lost == ["g/0"] and list(done.group.members) == ["g/1"]


def test_emitted_ids_are_pruned_after_their_ttl_per_partition() -> None:
    st = store(timeout_s=5)
    st.emitted_ttl_s = 100
    add(st, traj("a", 0, 1), 0.0, partition=0)
    add(st, traj("b", 0, 1), 0.0, partition=1)
    assert st.prune_emitted(50.0, 0) == 0
    assert st.prune_emitted(101.0, 0) == 1 and list(st.emitted) == [b"b"]


def test_revoked_partitions_are_forgotten_locally() -> None:
    st = store(timeout_s=5)
    add(st, traj("g1", 0, 2), 0.0, partition=0)
    add(st, traj("g2", 0, 2), 0.0, partition=1)
    add(st, traj("done", 0, 1), 0.0, partition=1)
    assert forget_partitions(st, {1}, lambda m: m) == 1
    assert list(st.groups) == [b"g1"] and len(st.held) == 1 and not st.emitted


def test_each_policy_trains_on_its_own_segments_only() -> None:
    prompt = Segment.context("a", "prompt", [7, 8, 9])
    solver = gen("a", [10, 11], version=3, logp=-0.25)
    seen = Segment.context("b", "prompt", [50, 51])  # the verifier's own prompt (the solver's answer, as text)
    verifier = gen("b", [20], version=5, logp=-1.0)
    tool = Segment.context("a", "tool", [30])
    answer = gen("a", [40, 41], version=4, logp=-0.75)
    t = traj("g", 0, 1, [prompt, solver, seen, verifier, tool, answer], reward=1.0, reward_components={"policy.b": 0.0})
    [a] = train_samples(t, "a", lineage=[StrategyRef("reward", "reward", "exact_match", 1)])
    assert a.sample_id == "g/0#a" and a.policy == "a"
    assert a.token_ids.tolist() == [7, 8, 9, 10, 11, 30, 40, 41]  # no token of b: a never saw them
    assert a.loss_mask.tolist() == [0, 0, 0, 1, 1, 0, 1, 1]
    assert a.behaviour_logprobs.tolist() == [0, 0, 0, -0.25, -0.25, 0, -0.75, -0.75]
    assert a.versions.tolist() == [-1, -1, -1, 3, 3, -1, 4, 4]
    assert a.min_version == 3 and a.reward == 1.0 and a.lineage[0].name == "exact_match"
    [b] = train_samples(t, "b")
    assert b.sample_id == "g/0#b" and b.token_ids.tolist() == [50, 51, 20]
    assert b.loss_mask.tolist() == [0, 0, 1] and b.versions.tolist() == [-1, -1, 5]
    assert b.min_version == 5 and b.reward == 0.0  # the per-policy reward component wins
    assert train_samples(t, "c") == []  # c trained nothing here
    assert trained_policies([t]) == ["a", "b"]


def test_a_rewritten_history_gives_one_sample_per_sequence_with_its_own_context() -> None:
    first = [Segment.context("a", "prompt", [1, 2]), gen("a", [3], version=1), Segment.context("a", "tool", [4]),
             gen("a", [5], version=2)]
    summary = [Segment.context("a", "prompt", [9, 5]), gen("a", [6, 7], version=2)]  # the agent summarised
    idle = [Segment.context("a", "prompt", [8])]  # a sequence that trains nothing: no sample, ids do not shift
    last = [Segment.context("a", "prompt", [9]), gen("a", [10], version=3)]
    t = traj("g", 1, 2, [*first, *summary, *idle, *last], reward=0.5, temperature=0.7)
    samples = train_samples(t, "a", advantage=1.5)
    assert [s.sample_id for s in samples] == ["g/1#a", "g/1#a#1", "g/1#a#3"]
    assert [s.token_ids.tolist() for s in samples] == [[1, 2, 3, 4, 5], [9, 5, 6, 7], [9, 10]]
    assert [s.loss_mask.tolist() for s in samples] == [[0, 0, 1, 0, 1], [0, 0, 1, 1], [0, 1]]
    assert [s.min_version for s in samples] == [1, 2, 3]
    assert {(s.reward, s.advantage, s.temperature, s.trajectory_id) for s in samples} == {(0.5, 1.5, 0.7, "g/1")}
    assert len({s.sample_id for s in samples}) == len(samples)


def test_a_segment_with_arrays_of_unequal_lengths_is_refused_by_name() -> None:
    bad = Segment("a", "assistant", np.array([1, 2], np.int32), np.zeros(1, np.float32), np.ones(2, np.uint8),
                  np.zeros(2, np.int32))
    with pytest.raises(ValueError, match="unequal lengths"):
        train_samples(traj("g", 0, 1, [bad]), "a")


def test_policy_reward_needs_a_reward() -> None:
    t = traj("g", 0, 1, reward=None)
    with pytest.raises(ValueError):
        policy_reward(t, "a")


def test_trained_versions_are_the_oldest_and_newest_of_trained_tokens_per_policy() -> None:
    t = make_trajectory(8, task_id="g")
    t.segments = [
        Segment.context("a", "prompt", [1, 2]),
        Segment("a", "assistant", np.array([3, 4], np.int32), np.zeros(2, np.float32), np.array([1, 0], np.uint8),
                np.array([5, 2], np.int32)),  # the untrained token's version does not count
        Segment("b", "assistant", np.array([5], np.int32), np.zeros(1, np.float32), np.ones(1, np.uint8), np.array([9], np.int32)),
        Segment("a", "assistant", np.array([6], np.int32), np.zeros(1, np.float32), np.ones(1, np.uint8), np.array([7], np.int32)),
    ]
    assert t.trained_versions() == {"a": (5, 7), "b": (9, 9)}
    assert trained_policies([t]) == ["a", "b"]
    t.segments = t.segments[:1]
    assert t.trained_versions() == {}
