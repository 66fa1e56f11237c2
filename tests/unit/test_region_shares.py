"""Shares of new tasks that follow the regions' live nodes and backlog (astraflow.dataflow.region_shares,
stream_apps.region_fleet): a region that goes dark gets nothing new and its tasks are given back."""

from __future__ import annotations

import pytest

from astraflow.dataflow.region_shares import NodeSeen, capacities, choose, dead_regions, shares
from astraflow.records import Metric, Task
from stream_apps.region_fleet import RegionFleet

pytestmark = pytest.mark.unit

A, B = "af.e.tasks", "af.e.tasks.b"


def test_shares_follow_live_capacity() -> None:
    nodes = [NodeSeen(A, 10.0, 2.0), NodeSeen(A, 10.0, 2.0), NodeSeen(B, 10.0, 2.0)]
    cap = capacities(nodes, [A, B], now=12.0, dead_after_s=15.0)
    assert cap == {A: 4.0, B: 2.0}
    assert shares(cap, {A, B}, {A: 0.5, B: 0.5}) == pytest.approx({A: 2 / 3, B: 1 / 3})


def test_a_node_never_seen_working_counts_at_the_mean_speed() -> None:
    nodes = [NodeSeen(A, 10.0, 3.0), NodeSeen(B, 10.0, None)]
    assert capacities(nodes, [A, B], 11.0, 15.0) == {A: 3.0, B: 3.0}
    assert capacities([NodeSeen(A, 10.0), NodeSeen(B, 10.0)], [A, B], 11.0, 15.0) == {A: 1.0, B: 1.0}


def test_a_starved_node_keeps_the_speed_it_showed_when_fed() -> None:
    node = NodeSeen(A, 0.0)
    node.observe(1.0, 2.0, 4)
    node.observe(6.0, 0.0, 0)  # nothing to do: no sample of its speed
    node.observe(11.0, 0.0, 0)
    assert node.speed == 2.0 and node.last_seen == 11.0
    node.observe(16.0, 1.0, 4)
    assert 1.0 < node.speed < 2.0
    node.observe(21.0, float("nan"), 4)  # untrusted: ignored, but the node was heard from
    node.observe(22.0, -5.0, 4)
    assert 1.0 < node.speed < 2.0 and node.last_seen == 22.0


def test_the_configured_share_holds_until_a_regions_nodes_are_seen() -> None:
    prior = {A: 0.6, B: 0.4}
    assert shares({A: 0.0, B: 0.0}, set(), prior) == pytest.approx(prior)
    # A's nodes measured at 3 tasks/s, B not heard from yet: B keeps 0.4 of the whole.
    got = shares({A: 3.0, B: 0.0}, {A}, prior)
    assert got == pytest.approx({A: 0.6, B: 0.4})


def test_a_dark_region_gets_no_share_and_is_dead_after_the_bound() -> None:
    nodes = [NodeSeen(A, 100.0, 1.0), NodeSeen(B, 90.0, 1.0)]
    assert dead_regions(nodes, [A, B], now=104.0, started=0.0, dead_after_s=15.0) == set()
    assert capacities(nodes, [A, B], 104.0, 15.0)[B] == 1.0
    assert dead_regions(nodes, [A, B], now=106.0, started=0.0, dead_after_s=15.0) == {B}
    cap = capacities(nodes, [A, B], 106.0, 15.0)
    assert shares(cap, {A, B}, {A: 0.5, B: 0.5}) == {A: 1.0, B: 0.0}
    # A region never heard from is dead only once the curator has waited the bound for it.
    assert dead_regions([NodeSeen(A, 5.0, 1.0)], [A, B], now=10.0, started=0.0, dead_after_s=15.0) == set()
    assert dead_regions([NodeSeen(A, 20.0, 1.0)], [A, B], now=20.0, started=0.0, dead_after_s=15.0) == {B}


def test_the_next_task_goes_where_it_waits_least_for_its_share() -> None:
    share = {A: 0.5, B: 0.5}
    assert choose(share, {A: 0, B: 0}) == A
    assert choose(share, {A: 3, B: 1}) == B
    assert choose({A: 0.75, B: 0.25}, {A: 5, B: 1}) == A  # 6/0.75 = 8 < 2/0.25 = 8? tie -> first
    assert choose({A: 0.8, B: 0.2}, {A: 8, B: 1}) == B  # 9/0.8 = 11.25 > 2/0.2 = 10
    assert choose({A: 1.0, B: 0.0}, {A: 100, B: 0}) == A
    assert choose({A: 0.0, B: 0.0}, {}) is None
    # Filling an empty system: every prefix holds close to the shares.
    out = {A: 0, B: 0}
    for _ in range(100):
        out[choose({A: 0.7, B: 0.3}, out)] += 1
    assert out == {A: 70, B: 30}


def task(i: int) -> Task:
    return Task(task_id=f"t{i}", group_id=f"g{i}", prompt_id=f"p{i}", dataset="d", workflow="rlvr", prompt="1+1",
                policies=["policy"], n_samples=2)


def beat(node: str, region: str, rate: float) -> Metric:
    return Metric("rollouts_per_s", rate, "raas", node, {"region": region, "tasks_region": region})


def test_a_dark_regions_tasks_are_given_back_with_their_group_ids_and_its_share_returns() -> None:
    fleet = RegionFleet({"": A, "b": B}, {A: 0.5, B: 0.5}, n_samples=2, dead_after_s=15.0, now=0.0)
    fleet.on_metric(beat("a1", "", 2.0), 1.0)
    fleet.on_metric(beat("b1", "b", 2.0), 1.0)
    fleet.refresh(1.0)
    for i in range(6):
        topic = fleet.next_topic()
        assert topic is not None
        fleet.sent(topic, task(i))
    assert {t: len(q) for t, q in fleet.outstanding.items()} == {A: 3, B: 3}
    b_groups = set(fleet.outstanding[B])
    done = next(iter(b_groups))  # B finished one task before it went dark: not given back
    fleet.on_trajectory(done)
    fleet.on_trajectory(done)
    fleet.on_trajectory("not-ours")
    assert len(fleet.outstanding[B]) == 2
    fleet.on_metric(beat("a1", "", 2.0), 15.0)
    fleet.refresh(15.0)
    assert fleet.dead == set() and fleet.to_give_back() == []
    fleet.on_metric(beat("a1", "", 2.0), 20.0)
    fleet.refresh(20.0)  # b1's last metric 19 s old
    assert fleet.dead == {B} and fleet.share == {A: 1.0, B: 0.0}
    back = fleet.to_give_back()
    assert {t.group_id for t, _ in back} == b_groups - {done}
    assert all(topic == A and t.metadata["given_back_from"] == B for t, topic in back)
    for t, topic in back:
        fleet.sent(topic, t)
    assert fleet.outstanding[B] == {} and len(fleet.outstanding[A]) == 5
    assert fleet.next_topic() == A
    # B is back: its share returns, and a late trajectory of a given-back group still completes it.
    fleet.on_metric(beat("b1", "b", 2.0), 40.0)
    fleet.on_metric(beat("a1", "", 2.0), 40.0)
    fleet.refresh(40.0)
    assert fleet.dead == set() and fleet.share == pytest.approx({A: 0.5, B: 0.5})
    assert fleet.next_topic() == B
    g = back[0][0].group_id
    fleet.on_trajectory(g)
    fleet.on_trajectory(g)
    assert g not in fleet.outstanding[A]


def test_with_no_region_live_the_configured_shares_hold() -> None:
    fleet = RegionFleet({"": A, "b": B}, {A: 0.5, B: 0.5}, n_samples=1, dead_after_s=5.0, now=0.0)
    fleet.on_metric(beat("a1", "", 1.0), 1.0)
    fleet.on_metric(beat("b1", "b", 1.0), 1.0)
    fleet.refresh(1.0)
    fleet.sent(B, task(1))
    fleet.refresh(30.0)  # every node silent: the configured shares hold, nothing is given back
    assert fleet.dead == set() and fleet.share == {A: 0.5, B: 0.5} and fleet.to_give_back() == []
    assert fleet.next_topic() == A


def test_metrics_of_other_components_and_names_are_ignored() -> None:
    fleet = RegionFleet({"": A, "b": B}, {A: 0.5, B: 0.5}, n_samples=1, dead_after_s=5.0, now=0.0)
    fleet.on_metric(Metric("rollouts_per_s", 9.0, "trainer", "t", {"region": "b"}), 1.0)
    fleet.on_metric(Metric("tokens_per_s", 9.0, "raas", "x", {"region": "b"}), 1.0)
    assert fleet.nodes == {}
    # A node without the tasks_region label counts for its region when that is one of the shares.
    fleet.on_metric(Metric("rollouts_per_s", 1.0, "raas", "old-b", {"region": "b"}), 1.0)
    fleet.on_metric(Metric("rollouts_per_s", 1.0, "raas", "old-a", {"region": "eu"}), 1.0)
    assert fleet.nodes["old-b"].region == B and fleet.nodes["old-a"].region == A


def test_no_region_is_dark_until_the_metrics_there_at_the_start_are_read() -> None:
    # The reader starts a few seconds back: B's oldest metric may be read before its newer ones
    # (or before B's partition is fetched at all); B must not look dark meanwhile.
    fleet = RegionFleet({"": A, "b": B}, {A: 0.5, B: 0.5}, n_samples=1, dead_after_s=5.0, now=0.0)
    fleet.expect_metrics({0: 3, 1: 10, 2: 0})  # partition 2 empty: nothing to wait for
    fleet.sent(B, task(1))
    fleet.on_metric(beat("a1", "", 1.0), 20.0)
    fleet.on_metric(beat("b1", "b", 1.0), 1.0)  # old: 19 s before now
    fleet.read_metric_at(0, 2, 20.0)
    fleet.refresh(20.0)
    assert fleet.dead == set() and fleet.to_give_back() == []
    fleet.read_metric_at(1, 9, 21.0)  # caught up: from now on B's silence counts
    fleet.refresh(21.0)
    assert fleet.dead == {B} and [t.group_id for t, _ in fleet.to_give_back()] == [task(1).group_id]


def test_a_region_never_seen_gets_its_grace_from_when_the_metrics_are_read() -> None:
    fleet = RegionFleet({"": A, "b": B}, {A: 0.5, B: 0.5}, n_samples=1, dead_after_s=5.0, now=0.0)
    fleet.expect_metrics({0: 1})
    fleet.on_metric(beat("a1", "", 1.0), 9.0)
    fleet.read_metric_at(0, 0, 9.0)  # caught up at 9 s (and first refreshed at 12 s, as a curator
    fleet.refresh(12.0)  # recovering its tables reads nothing before): B, no node yet, is not dark before 17 s
    assert fleet.dead == set()
    fleet.on_metric(beat("a1", "", 1.0), 16.0)
    fleet.refresh(16.0)
    assert fleet.dead == set()
    fleet.refresh(17.5)
    assert fleet.dead == {B}
