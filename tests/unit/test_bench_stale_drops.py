from __future__ import annotations

from types import SimpleNamespace

from _stale_drops import stale_dropped

from astraflow.records import GroupDropped


def _dropped(policy: str, slot: str, ids: list[str]) -> GroupDropped:
    return GroupDropped(group_id="g", task_id="t", prompt_id="p", policy=policy, trajectory_ids=ids,
                        component="curate", filter=slot, strategy="staleness", reason="too stale")


def test_counts_distinct_trajectories_the_staleness_slots_dropped_per_policy() -> None:
    trajectories = [SimpleNamespace(trajectory_id=f"t{i}") for i in range(10)] + [SimpleNamespace(trajectory_id="t0")]
    lineage = [_dropped("solver", "filter.staleness", ["t1", "t2"]),
               _dropped("solver", "filter.staleness@solver", ["t2", "t3"]),  # t2 counted once
               _dropped("verifier", "filter.zero_variance", ["t4"]),  # another filter: not counted
               _dropped("verifier", "filter.staleness@verifier", ["t5", "t99"]),  # t99 not given
               SimpleNamespace(filter="filter.staleness", policy="x", trajectory_ids=["t6"])]  # not a GroupDropped
    got = stale_dropped(lineage, trajectories)
    assert got == {"trajectories": 10, "dropped": {"solver": 3, "verifier": 1}, "fraction": {"solver": 0.3, "verifier": 0.1}}


def test_no_trajectories_given_gives_no_fraction() -> None:
    assert stale_dropped([_dropped("a", "filter.staleness", ["t1"])], []) == {
        "trajectories": 0, "dropped": {"a": 0}, "fraction": {"a": None}}
