"""Shares of new tasks that follow the regions' live nodes, their busy speed and the way through a
mirror (astraflow.dataflow.region_shares, stream_apps.region_fleet): a region behind a slow mirror
gets its share, and a region that goes dark gets nothing new and its tasks are given back."""

from __future__ import annotations

import dataclasses
import heapq
import itertools
from collections import deque

import pytest

from astraflow.dataflow.region_shares import (
    RESERVE_FRACTION,
    TRANSIT_MAX_S,
    NodeSeen,
    capacities,
    choose,
    dead_regions,
    limits,
    reserves,
    shares,
    transits,
)
from astraflow.records import Metric, Task
from astraflow.serde import AvroSerde
from stream_apps.region_fleet import RegionFleet, feed_fleet

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


def test_a_nodes_speed_is_what_it_reports_when_busy() -> None:
    node = NodeSeen(A, 0.0)
    node.observe(1.0, 2.0)
    node.observe(6.0)  # nothing to do: no busy speed reported, no sample of its speed
    node.observe(11.0, None)
    assert node.speed == 2.0 and node.last_seen == 11.0
    node.observe(16.0, 1.0)
    assert 1.0 < node.speed < 2.0
    node.observe(21.0, float("nan"))  # untrusted: ignored, but the node was heard from
    node.observe(22.0, -5.0)
    node.observe(23.0, 0.0)
    assert 1.0 < node.speed < 2.0 and node.last_seen == 23.0


def test_a_nodes_way_back_is_the_median_of_its_last_delays_bounded() -> None:
    node = NodeSeen(B, 0.0)
    assert node.delay is None
    for d in (1.5, 1.4, 9.0, 1.6):  # one late batch does not count
        node.observe(1.0, None, d)
    assert node.delay == pytest.approx(1.55)
    for d in (float("inf"), float("nan")):
        node.observe(1.0, None, d)  # untrusted: ignored
    assert node.delay == pytest.approx(1.55)
    far = NodeSeen(B, 0.0)
    far.observe(1.0, None, -3.0)  # a clock ahead of the curator's
    assert far.delay == 0.0
    for _ in range(5):
        far.observe(1.0, None, 1e9)  # a clock far behind: bounded
    assert far.delay == TRANSIT_MAX_S / 2
    assert transits([far, NodeSeen(A, 0.0)], [A, B], now=2.0, dead_after_s=15.0) == {A: 0.0, B: TRANSIT_MAX_S}


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


def test_reserves_cover_the_way_there_and_back_within_part_of_the_window() -> None:
    cap = {A: 10.0, B: 10.0}
    assert reserves(cap, {A: 0.2, B: 1.0}, window=48) == pytest.approx({A: 2.0, B: 10.0})
    # A region far away (30 s: 300 tasks on the way) cannot take more than its part of the window.
    got = reserves(cap, {A: 0.2, B: 30.0}, window=48)
    assert sum(got.values()) == pytest.approx(RESERVE_FRACTION * 48) and got[B] / got[A] == pytest.approx(150)
    assert reserves({A: 0.0, B: 0.0}, {A: 1.0, B: 1.0}, 48) == {A: 0.0, B: 0.0}
    assert limits({A: 0.25, B: 0.75}, {A: 2.0, B: 10.0}, window=48) == {A: 14.0, B: 46.0}


def test_tasks_on_their_way_through_a_mirror_are_not_taken_for_a_queue() -> None:
    # B's 10 tasks outstanding are its reserve (on the way): a new task goes to B, not to A with 2.
    assert choose({A: 0.5, B: 0.5}, {A: 2, B: 10}) == A
    assert choose({A: 0.5, B: 0.5}, {A: 2, B: 10}, reserve={A: 1.0, B: 10.0}) == B
    # A region at its limit gets nothing, whatever its reserve.
    assert choose({A: 0.5, B: 0.5}, {A: 2, B: 10}, {A: 1.0, B: 10.0}, limit={A: 30.0, B: 10.0}) == A
    assert choose({A: 0.5, B: 0.5}, {A: 30, B: 10}, {A: 1.0, B: 10.0}, limit={A: 30.0, B: 10.0}) is None


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
    fleet = RegionFleet({"": A, "b": B}, {A: 0.5, B: 0.5}, n_samples=2, dead_after_s=15.0, now=0.0, window=8)
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
    fleet = RegionFleet({"": A, "b": B}, {A: 0.5, B: 0.5}, n_samples=1, dead_after_s=5.0, now=0.0, window=8)
    fleet.on_metric(beat("a1", "", 1.0), 1.0)
    fleet.on_metric(beat("b1", "b", 1.0), 1.0)
    fleet.refresh(1.0)
    fleet.sent(B, task(1))
    fleet.refresh(30.0)  # every node silent: the configured shares hold, nothing is given back
    assert fleet.dead == set() and fleet.share == {A: 0.5, B: 0.5} and fleet.to_give_back() == []
    assert fleet.next_topic() == A


def test_metrics_of_other_components_and_names_are_ignored() -> None:
    fleet = RegionFleet({"": A, "b": B}, {A: 0.5, B: 0.5}, n_samples=1, dead_after_s=5.0, now=0.0, window=8)
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
    fleet = RegionFleet({"": A, "b": B}, {A: 0.5, B: 0.5}, n_samples=1, dead_after_s=5.0, now=0.0, window=8)
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
    fleet = RegionFleet({"": A, "b": B}, {A: 0.5, B: 0.5}, n_samples=1, dead_after_s=5.0, now=0.0, window=8)
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


def test_a_metric_there_at_the_start_says_nothing_of_the_way_back() -> None:
    serde = AvroSerde()
    fleet = RegionFleet({"": A, "b": B}, {A: 0.5, B: 0.5}, n_samples=1, dead_after_s=15.0, now=0.0, window=8)
    fleet.expect_metrics({0: 2})
    old = Metric("inflight", 1.0, "raas", "b1", {"region": "b", "tasks_region": "b"}, ts=int(990e3))
    new = dataclasses.replace(old, ts=int(999.5e3))
    feed_fleet(fleet, [Msg(METRICS, 0, 1, b"b1", serde.dumps(old)), Msg(METRICS, 0, 2, b"b1", serde.dumps(new))],
               serde, METRICS, now=100.0, wall_now=1000.0)
    assert list(fleet.nodes["b1"].delays) == [pytest.approx(0.5)]  # the one written 10 s ago was waiting there
    assert fleet.nodes["b1"].last_seen == pytest.approx(99.5) and fleet.transit[B] == pytest.approx(1.0)


# A simulation of two regions, B behind a mirror, driving the fleet through `feed_fleet` as the
# curator does: each region's node runs one queue of tasks at its speed (tasks/s), reports its
# metrics every 5 s as RaaS nodes do (`rollouts_per_s`, `inflight`, `busy_tasks_per_s`), and
# everything between it and the curator (tasks there, trajectories and metrics back) takes `way_s`
# each way. The curator keeps `window` tasks outstanding.

METRICS, ROLLOUTS = "af.e.metrics", "af.e.rollouts"


@dataclasses.dataclass
class Msg:
    """The parts of a Kafka message `feed_fleet` reads."""

    t: str
    p: int
    o: int
    k: bytes | None
    v: bytes

    def topic(self) -> str:
        return self.t

    def partition(self) -> int:
        return self.p

    def offset(self) -> int:
        return self.o

    def key(self) -> bytes | None:
        return self.k

    def value(self) -> bytes:
        return self.v

    def headers(self) -> list:
        return []


@dataclasses.dataclass
class SimNode:
    name: str
    region: str  # its --tasks-region ('' for A)
    speed: float  # tasks/s while it has any
    way_s: float  # one way between it and the curator
    alive: bool = True
    queue: deque = dataclasses.field(default_factory=deque)
    progress: float = 0.0
    busy_s: float = 0.0
    done: int = 0
    mark: tuple[int, float] = (0, 0.0)  # done, busy_s at its last metric


def simulate(window: int, b_way_s: float, speeds: tuple[float, float] = (10.0, 10.0), b_dies_at: float | None = None,
             seconds: float = 150.0, measure_from: float = 90.0, n_samples: int = 2) -> tuple[dict[str, float], RegionFleet]:
    """Tasks/s each region did from `measure_from` on, and the fleet at the end."""
    serde, dt, wall0 = AvroSerde(), 0.05, 1.0e9
    fleet = RegionFleet({"": A, "b": B}, {A: 0.5, B: 0.5}, n_samples, dead_after_s=1e6, now=0.0, window=window)
    nodes = {A: SimNode("a1", "", speeds[0], 0.1), B: SimNode("b1", "b", speeds[1], b_way_s)}
    arrivals: list[tuple[float, int, str, object]] = []  # (time, order, what, payload)
    seq, offsets, ids = itertools.count(), itertools.count(), itertools.count()
    inbox: list[Msg] = []
    rate = dict.fromkeys(nodes, 0.0)
    peak_b = 0
    t, next_metric, next_feed = 0.0, 5.0, 0.0
    while t < seconds:
        while arrivals and arrivals[0][0] <= t:
            _, _, what, payload = heapq.heappop(arrivals)
            if what == "task":
                topic, task = payload
                nodes[topic].queue.append(task)
            else:
                inbox.append(payload)
        for topic, n in nodes.items():
            n.alive = n.alive and not (topic == B and b_dies_at is not None and t >= b_dies_at)
            if not (n.alive and n.queue):
                n.progress = 0.0
                continue
            n.busy_s, n.progress = n.busy_s + dt, n.progress + n.speed * dt
            while n.queue and n.progress >= 1.0:
                n.progress, task = n.progress - 1.0, n.queue.popleft()
                n.done += 1
                rate[topic] += t >= measure_from
                for _ in range(n_samples):
                    msg = Msg(ROLLOUTS, 0, next(offsets), task.group_id.encode(), b"")
                    heapq.heappush(arrivals, (t + n.way_s, next(seq), "msg", msg))
        if t >= next_metric:
            next_metric += 5.0
            for n in (n for n in nodes.values() if n.alive):
                (d0, b0), n.mark = n.mark, (n.done, n.busy_s)
                values = {"rollouts_per_s": (n.done - d0) * n_samples / 5.0, "inflight": float(len(n.queue) > 0)}
                if n.busy_s - b0 >= 0.5 and n.done > d0:
                    values["busy_tasks_per_s"] = (n.done - d0) / (n.busy_s - b0)
                for name, v in values.items():
                    m = Metric(name, v, "raas", n.name, {"region": n.region, "tasks_region": n.region}, int((wall0 + t) * 1000))
                    heapq.heappush(arrivals, (t + n.way_s, next(seq), "msg",
                                              Msg(METRICS, 0, next(offsets), n.name.encode(), serde.dumps(m))))
        if t >= next_feed:  # the curator's measuring pace, then it issues what its window allows
            next_feed += 0.2
            feed_fleet(fleet, inbox, serde, METRICS, t, wall0 + t)
            inbox = []
            while sum(len(q) for q in fleet.outstanding.values()) < window:
                topic = fleet.next_topic()
                if topic is None:
                    break
                i = next(ids)
                task = Task(task_id=f"t{i}", group_id=f"g{i}", prompt_id=f"p{i}", dataset="d", workflow="rlvr",
                            prompt="1+1", policies=["policy"], n_samples=n_samples)
                fleet.sent(topic, task)
                heapq.heappush(arrivals, (t + nodes[topic].way_s, next(seq), "task", (topic, task)))
            peak_b = max(peak_b, len(fleet.outstanding[B]))
        t = round(t + dt, 6)
    fleet.peak_b = peak_b  # type: ignore[attr-defined]
    return {r: v / (seconds - measure_from) for r, v in rate.items()}, fleet


def test_a_region_behind_a_slow_mirror_gets_its_share() -> None:
    # B as fast as A, 1.5 s each way through its mirror (3 s for a task there and its trajectories
    # back), 48 tasks outstanding: counting B's tasks on the way as its queue gave it about half of
    # A's rate, and its falling throughput (taken for its speed) a falling share.
    rate, fleet = simulate(window=48, b_way_s=1.5)
    assert rate[A] == pytest.approx(10.0, rel=0.05)
    assert rate[B] >= 0.9 * rate[A]
    assert fleet.share == pytest.approx({A: 0.5, B: 0.5}, abs=0.05)  # its busy speed, not its throughput
    assert fleet.transit[B] == pytest.approx(3.2, abs=0.3) and fleet.reserve[B] > 5 * fleet.reserve[A]


def test_shares_follow_busy_speed_behind_a_mirror() -> None:
    rate, fleet = simulate(window=48, b_way_s=1.5, speeds=(6.0, 12.0))
    assert fleet.share[B] == pytest.approx(2 / 3, abs=0.05)
    assert rate[A] == pytest.approx(6.0, rel=0.05) and rate[B] >= 0.9 * 12.0


def test_a_window_too_small_for_the_mirror_still_leaves_the_far_region_most_of_its_share() -> None:
    # 2.5 s each way: B alone needs about 53 tasks on the way, more than the window.
    rate, _ = simulate(window=48, b_way_s=2.5)
    assert rate[A] == pytest.approx(10.0, rel=0.05) and rate[B] >= 0.5 * rate[A]


def test_a_dark_region_not_yet_known_dark_does_not_soak_up_the_window() -> None:
    # B's node stops at 60 s (its tasks never come back); the fleet is never told it is dead.
    rate, fleet = simulate(window=48, b_way_s=1.5, b_dies_at=60.0)
    assert len(fleet.outstanding[B]) <= fleet.limit[B] and fleet.peak_b <= fleet.limit[B] + 1
    assert rate[A] == pytest.approx(10.0, rel=0.05)  # A keeps the rest of the window, enough for its speed
