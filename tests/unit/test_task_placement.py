"""astraflow.dataflow.placement: tasks go where the expected wait is shortest, so work follows speed."""

from __future__ import annotations

import math

import pytest

from astraflow.dataflow.placement import Placement, SpeedMeter


class Sim:
    """Nodes that each own some partitions and finish tasks at their own speed (tasks/s), the
    curator keeping `outstanding` tasks in the system and placing each with the policy. A node
    with a delay d (its round trip: fetch, commit, e.g. a WAN) sees a task d/2 after it is
    written, and its completion is seen d/2 after it ends. A node's refill delay as reported is
    its round trip times `reported_delay` (1: as measured; less: a refill slower than its
    commits show, e.g. a WAN fetch cycle); with `report_speeds`, each node measures its tasks/s
    while it had work (`SpeedMeter`) and reports it split over its partitions, as RaaS nodes do."""

    def __init__(self, owners: dict[int, int], speeds: dict[int, float], outstanding: int = 24,
                 delays: dict[int, float] | None = None, report_delays: bool = True,
                 reported_delay: float = 1.0, report_speeds: bool = False, cycles: dict[int, float] | None = None,
                 delay_of=None, **kw) -> None:
        self.owners, self.speeds = owners, speeds  # partition -> node, node -> tasks/s
        self.delays = delays or {}
        # A node with a fetch cycle c (its round trip, as a Kafka fetch always in flight over a WAN)
        # gets a task at the first broker answer after its write (every c) plus c/2, and its
        # completion is seen after its trajectories' acknowledgement (c), at its next commit (every
        # c) plus c/2: 3 c on average. `delay_of(rtt, dt)`: the refill delay the placement is given for it.
        self.cycles = cycles or {}
        self.delay_of = delay_of
        self.pl = Placement(len(owners), **kw)
        self.written = dict.fromkeys(owners, 0)
        self.done = dict.fromkeys(owners, 0)  # completions the placement can see (committed)
        self.started = dict.fromkeys(owners, 0)
        self.arrive: dict[int, list[float]] = {p: [] for p in owners}  # when each written task reaches its node
        self.seen_at: list[tuple[float, int]] = []  # (when a completion becomes visible, partition)
        self.credit = dict.fromkeys(speeds, 0.0)
        self.by_node = dict.fromkeys(speeds, 0)
        self.idle = dict.fromkeys(speeds, 0)  # steps a node had nothing to run
        self.outstanding = outstanding
        self.report_delays = report_delays  # the refill delays given to the placement (as the nodes' commits say)
        self.reported_delay = reported_delay
        self.meters = {n: SpeedMeter() for n in speeds} if report_speeds else None
        self.t = 0.0
        self.pl.observe(self.t, self.written, self.done)

    def step(self, dt: float = 0.2) -> None:
        self.t += dt
        for node, speed in self.speeds.items():  # each node works through its partitions' backlogs in turn
            half = self.delays.get(node, 0.0) / 2
            mine = [p for p, n in self.owners.items() if n == node]

            def ready(p: int) -> int:
                return sum(1 for at in self.arrive[p] if at <= self.t) - self.started[p]

            self.credit[node] += speed * dt
            if not any(ready(p) for p in mine):
                self.idle[node] += 1
            if self.meters is not None:  # busy through this step if it had work at its start
                self.meters[node].update(self.t - dt, any(ready(p) for p in mine))
            while self.credit[node] >= 1 and any(ready(p) for p in mine):
                # first come, first served (as a node's fetched tasks are)
                p = min((q for q in mine if ready(q)), key=lambda q: self.arrive[q][self.started[q]])
                self.started[p] += 1
                # a cycling node's completion: its trajectories acknowledged (a round trip), then its next commit
                self.seen_at.append((self._after(node, self.t + self.cycles[node]) if node in self.cycles else self.t + half, p))
                self.by_node[node] += 1
                self.credit[node] -= 1
            if not any(ready(p) for p in mine):
                self.credit[node] = min(self.credit[node], 1.0)  # idle: no saved-up work
        for _, p in [x for x in self.seen_at if x[0] <= self.t]:
            self.done[p] += 1
        self.seen_at = [x for x in self.seen_at if x[0] > self.t]
        # refill delay: the round trip, plus this loop's own measuring pace
        measured = ({p: self.delays.get(n, 0.0) * self.reported_delay + dt for p, n in self.owners.items()}
                    if self.report_delays else None)
        if measured is not None and self.delay_of is not None:
            measured.update({p: self.delay_of(self.cycles[n], dt) for p, n in self.owners.items() if n in self.cycles})
        reported = None
        if self.meters is not None:
            node_speed = {n: m.speed(self.t, self.by_node[n]) for n, m in self.meters.items()}
            per = {n: sum(1 for q in self.owners.values() if q == n) for n in self.speeds}
            reported = {p: None if node_speed[n] is None else node_speed[n] / per[n] for p, n in self.owners.items()}
        self.pl.observe(self.t, self.written, self.done, measured, reported)
        while sum(self.written.values()) - sum(self.done.values()) < self.outstanding:
            p = self.pl.choose()
            self.written[p] += 1
            node = self.owners[p]
            self.arrive[p].append(self._after(node, self.t) if node in self.cycles else self.t + self.delays.get(node, 0.0) / 2)
            self.pl.sent(p)

    def _after(self, node: int, t: float) -> float:
        """When something at `t` crosses a fetch-cycle node's link: its next cycle, plus half of one."""
        c = self.cycles[node]
        return (math.floor(t / c + 1e-9) + 1) * c + c / 2

    def run(self, seconds: float) -> None:
        for _ in range(int(seconds / 0.2)):
            self.step()


def shares(counts: dict[int, int]) -> dict[int, float]:
    total = sum(counts.values())
    return {k: v / total for k, v in counts.items()}


def test_a_slow_node_gets_a_share_in_proportion_to_its_speed():
    # three nodes of relative speed 1.0 / 0.34 / 1.0, four partitions each (cf. bench/regions.py)
    owners = {p: p % 3 for p in range(12)}
    sim = Sim(owners, {0: 3.0, 1: 1.0, 2: 3.0})
    sim.run(60)
    before = dict(sim.by_node)
    sim.run(120)
    got = shares({n: sim.by_node[n] - before[n] for n in sim.by_node})
    for node, expected in {0: 3 / 7, 1: 1 / 7, 2: 3 / 7}.items():
        assert abs(got[node] - expected) / expected < 0.15, got


def test_under_light_load_no_node_runs_dry_while_tasks_wait_elsewhere():
    """Few tasks outstanding (fewer than the fast nodes could hold): the slow node still gets its
    share, not nothing; every partition holds a task before any holds two."""
    owners = {p: p % 3 for p in range(12)}
    sim = Sim(owners, {0: 5.0, 1: 1.0, 2: 5.0}, outstanding=8)
    sim.run(60)
    before = dict(sim.by_node)
    sim.run(120)
    got = shares({n: sim.by_node[n] - before[n] for n in sim.by_node})
    for node, expected in {0: 5 / 11, 1: 1 / 11, 2: 5 / 11}.items():
        assert abs(got[node] - expected) / expected < 0.15, got


def test_an_even_spread_would_give_the_slow_node_more_than_its_share():
    """The comparison the policy is for: placing round-robin, the slow node's partitions fill up
    and (with a bounded number of tasks outstanding) the fast nodes run dry."""
    owners = {p: p % 3 for p in range(12)}
    sim = Sim(owners, {0: 3.0, 1: 1.0, 2: 3.0})
    nxt = iter(range(10**9))
    sim.pl.choose = lambda: next(nxt) % 12  # type: ignore[method-assign]
    sim.run(180)
    assert shares(sim.by_node)[1] > 0.25


def test_a_node_behind_a_slow_link_gets_its_share():
    """Node 2 as fast as node 0 but with a 2 s round trip (a WAN): placement keeps its rate x
    delay outstanding there, so its share follows its speed and it does not run dry. (14 tasks
    outstanding: more than the 7 tasks/s x 2 s the WAN node alone would need; with fewer than the
    nodes' rate x delay together, the shortfall falls on some node.)"""
    owners = {p: p % 3 for p in range(12)}
    sim = Sim(owners, {0: 3.0, 1: 1.0, 2: 3.0}, outstanding=14, delays={0: 0.1, 1: 0.1, 2: 2.0})
    sim.run(60)
    before, idle = dict(sim.by_node), dict(sim.idle)
    sim.run(120)
    got = shares({n: sim.by_node[n] - before[n] for n in sim.by_node})
    for node, expected in {0: 3 / 7, 1: 1 / 7, 2: 3 / 7}.items():
        assert abs(got[node] - expected) / expected < 0.15, got
    assert sim.idle[2] - idle[2] <= 0.05 * 120 / 0.2, sim.idle


def test_without_the_refill_delay_a_node_behind_a_slow_link_runs_dry():
    """The comparison: the same nodes with no delay counted (backlog / rate alone, as before):
    the WAN node's partitions run dry between refills, its measured rate falls, so it gets fewer
    tasks and sits idle."""
    owners = {p: p % 3 for p in range(12)}
    sim = Sim(owners, {0: 3.0, 1: 1.0, 2: 3.0}, outstanding=14, delays={0: 0.1, 1: 0.1, 2: 2.0},
              report_delays=False)
    sim.run(60)
    before, idle = dict(sim.by_node), dict(sim.idle)
    sim.run(120)
    assert shares({n: sim.by_node[n] - before[n] for n in sim.by_node})[2] < 0.8 * 3 / 7
    assert sim.idle[2] - idle[2] > 0.25 * 120 / 0.2


def test_max_ahead_must_cover_every_nodes_speed_times_its_refill_delay():
    """The rule bench/regions.py's --max-ahead follows: the tasks outstanding must cover each
    node's speed x its refill delay together (here 3 x 1.2 + 1 x 1.2 + 3 x 2.2 = 11.4). With 8
    the WAN node is short of work and below its share (its measured rate, its throughput, falls
    with it, so the placement cannot tell: the sum of measured rate x delay stays under 8); with
    20 every node gets its share and none is idle."""
    owners = {p: p % 3 for p in range(12)}
    got, idle = {}, {}
    for outstanding in (8, 20):
        sim = Sim(owners, {0: 3.0, 1: 1.0, 2: 3.0}, outstanding=outstanding, delays={0: 1.0, 1: 1.0, 2: 2.0})
        sim.run(60)
        before, idle_before = dict(sim.by_node), dict(sim.idle)
        sim.run(120)
        got[outstanding] = shares({n: sim.by_node[n] - before[n] for n in sim.by_node})
        idle[outstanding] = {n: (sim.idle[n] - idle_before[n]) / (120 / 0.2) for n in sim.idle}
        if outstanding == 8:
            assert sum(sim.pl.reserve(p) for p in range(12)) < outstanding
    assert got[8][2] < 0.7 * 3 / 7 and idle[8][2] > 0.25, (got, idle)
    for node, expected in {0: 3 / 7, 1: 1 / 7, 2: 3 / 7}.items():
        assert abs(got[20][node] - expected) / expected < 0.15, got
        assert idle[20][node] <= 0.05, idle


def test_a_dead_partition_gets_no_new_tasks():
    pl = Placement(3, tau_s=2.0)
    written, committed = {0: 0, 1: 0, 2: 0}, {0: 0, 1: 0, 2: 0}
    pl.observe(0.0, written, committed)
    t = 0.0
    for _ in range(50):  # all three drain 1 task per 0.5 s; each keeps two tasks queued
        t += 0.5
        for p in range(3):
            written[p] += 1
            committed[p] = max(0, written[p] - 2)
        pl.observe(t, written, committed)
    stuck = committed[2]
    placed = {0: 0, 1: 0, 2: 0}
    for _ in range(40):  # partition 2's node dies: its committed offset stops
        t += 0.5
        for p in (0, 1):
            committed[p] = min(written[p], committed[p] + 1)
        committed[2] = stuck
        pl.observe(t, written, committed)
        for _ in range(2):
            p = pl.choose()
            placed[p] += 1
            written[p] += 1
            pl.sent(p)
    assert placed[2] <= 2, placed  # at most what went there before its rate decayed
    assert pl.parts[2].rate < 0.1 * pl.parts[0].rate


def test_a_partition_taken_over_and_drained_gets_work_again():
    pl = Placement(2, tau_s=2.0)
    pl.observe(0.0, {0: 10, 1: 10}, {0: 0, 1: 0})
    for i in range(1, 20):  # partition 1 stalls, partition 0 moves
        pl.observe(i * 0.5, {0: 10 + i, 1: 10}, {0: i, 1: 0})
    assert pl.choose() == 0
    for i in range(20, 30):  # another node took partition 1 over and drains it fast
        pl.observe(i * 0.5, {0: 10 + i, 1: 10}, {0: i, 1: min(10, 2 * (i - 19))})
    assert pl.parts[1].backlog == 0
    assert pl.choose() == 1


def test_new_partitions_are_tried_before_any_measurement():
    pl = Placement(4)
    chosen = []
    for _ in range(8):
        p = pl.choose()
        chosen.append(p)
        pl.sent(p)
    assert sorted(chosen) == [0, 0, 1, 1, 2, 2, 3, 3]


def test_an_idle_partition_keeps_its_rate():
    pl = Placement(1, tau_s=1.0)
    pl.observe(0.0, {0: 5}, {0: 0})
    pl.observe(1.0, {0: 5}, {0: 5})  # 5 tasks/s while busy; now empty
    rate = pl.parts[0].rate
    for i in range(2, 30):
        pl.observe(float(i), {0: 5}, {0: 5})
    assert pl.parts[0].rate == rate


def test_a_dead_node_behind_a_slow_link_keeps_no_reserve():
    """Node 2's delays were measured, then it dies: its rate decays to the floor and its
    partitions stop counting a reserve, so they get next to nothing."""
    owners = {p: p % 3 for p in range(12)}
    sim = Sim(owners, {0: 3.0, 1: 1.0, 2: 3.0}, delays={0: 0.1, 1: 0.1, 2: 2.0}, tau_s=2.0)
    sim.run(60)
    assert all(sim.pl.reserve(p) > 1.5 * sim.pl.rate_of(p) for p in owners if owners[p] == 2)
    sim.speeds[2] = 0.0
    sim.run(20)
    before = dict(sim.written)
    sim.run(40)
    assert sum(sim.written[p] - before[p] for p in owners if owners[p] == 2) <= 4, sim.written
    assert all(sim.pl.reserve(p) == 0.0 for p in owners if owners[p] == 2)


def test_a_delay_is_capped_and_kept_until_measured_again():
    pl = Placement(2, max_delay_s=3.0)
    pl.observe(0.0, {0: 0, 1: 0}, {0: 0, 1: 0}, {0: 0.7, 1: 60.0})
    assert (pl.parts[0].delay, pl.parts[1].delay) == (0.7, 3.0)
    pl.observe(1.0, {0: 0, 1: 0}, {0: 0, 1: 0}, {1: 0.4})
    assert (pl.parts[0].delay, pl.parts[1].delay) == (0.7, 0.4)


def test_bad_settings_are_refused():
    with pytest.raises(ValueError):
        Placement(0)
    with pytest.raises(ValueError):
        Placement(2, max_delay_s=-1.0)
    with pytest.raises(ValueError):
        Placement(2, floor=0.0)


def test_a_node_behind_a_slow_link_gets_a_reserve_by_its_speed_not_its_throughput():
    """Partition 0 (a local node) and partition 1 (a node behind a 2 s refill) both show 2 tasks/s
    committed: that is all the WAN node was fed, but it reports 6 tasks/s while busy. Its
    reserve is speed x delay (12 tasks), not throughput x delay (4), and placement fills it
    before the local partition gets more than its own reserve of 0.2."""
    pl = Placement(2, tau_s=1.0)
    pl.observe(0.0, {0: 0, 1: 0}, {0: 0, 1: 0})
    for i in range(1, 11):  # both busy, each committing 2 tasks/s
        pl.observe(float(i), {0: 2 * i + 1, 1: 2 * i + 1}, {0: 2 * i, 1: 2 * i}, {0: 0.1, 1: 2.0}, {0: 2.0, 1: 6.0})
    assert pl.rate_of(0) == pytest.approx(pl.rate_of(1))
    assert pl.reserve(1) == pytest.approx(6.0 * 2.0, rel=0.01)
    assert pl.reserve(0) == pytest.approx(2.0 * 0.1, rel=0.01)
    placed = []
    for _ in range(12):
        p = pl.choose()
        placed.append(p)
        pl.sent(p)
    assert placed.count(1) >= 10, placed  # by throughput it would have held 4 (3 beyond its one queued)
    pl.observe(11.0, {}, {}, None, {1: None})  # no speed reported any more: back to its rate
    assert pl.reserve(1) == pytest.approx(pl.rate_of(1) * 2.0)


def test_a_reported_speed_below_the_rate_does_not_shrink_the_reserve():
    pl = Placement(1, tau_s=1.0)
    pl.observe(0.0, {0: 0}, {0: 0})
    pl.observe(1.0, {0: 5}, {0: 4}, {0: 1.0}, {0: 0.5})
    assert pl.reserve(0) == pytest.approx(pl.rate_of(0) * 1.0)


def test_reported_speeds_keep_a_node_behind_a_slow_link_busier():
    """The WAN node's refill is twice what its commits show (a fetch cycle longer than the commit
    round trip), with few tasks outstanding: placing its reserve by its reported speed instead of
    its throughput keeps it idle less (the same run side by side)."""
    owners = {p: p % 3 for p in range(12)}
    idle = {}
    for report in (False, True):
        sim = Sim(owners, {0: 3.0, 1: 1.0, 2: 3.0}, outstanding=14, delays={0: 0.1, 1: 0.1, 2: 2.0},
                  reported_delay=0.5, report_speeds=report)
        sim.run(60)
        before = dict(sim.idle)
        sim.run(120)
        idle[report] = (sim.idle[2] - before[2]) / (120 / 0.2)
    assert idle[True] < 0.75 * idle[False], idle


def test_a_node_fetching_in_cycles_needs_three_round_trips_of_reserve():
    """Node 2 works across a 1 s round trip as a RaaS node does: its fetch is always in flight (a
    task waits for the broker's next answer, every round trip, then half of one on the way), its
    trajectories are acknowledged (a round trip) before its commit, which waits for the commit in
    flight and crosses: three round trips on average. With its refill delay at that
    (`refill_delay_s`) it stays busy and every node gets its share; at two round trips (before:
    the acknowledgement left out) it sits idle with its next tasks on the way (side by side)."""
    from astraflow.kafka.task_placer import CommitReport, refill_delay_s

    owners = {p: p % 3 for p in range(12)}

    def run(delay_of) -> tuple[dict[int, float], float]:
        sim = Sim(owners, {0: 3.0, 1: 1.0, 2: 3.0}, outstanding=16, delays={0: 0.1, 1: 0.1},
                  cycles={2: 1.0}, delay_of=delay_of, report_speeds=True)
        sim.run(60)
        before, idle = dict(sim.by_node), sim.idle[2]
        sim.run(120)
        return shares({n: sim.by_node[n] - before[n] for n in sim.by_node}), (sim.idle[2] - idle) / (120 / 0.2)

    got, idle = run(lambda rtt, dt: refill_delay_s(CommitReport(rtt_s=rtt), dt))
    for node, expected in {0: 3 / 7, 1: 1 / 7, 2: 3 / 7}.items():
        assert abs(got[node] - expected) / expected < 0.15, got
    assert idle <= 0.05, idle
    got, idle = run(lambda rtt, dt: 2 * rtt + dt)
    assert idle > 0.25 and got[2] < 3 / 7, (got, idle)  # idle a third of the time, below its share
    assert refill_delay_s(CommitReport(rtt_s=0.3), 0.2) == pytest.approx(1.1)


def test_speed_is_tasks_per_second_while_busy_not_throughput():
    meter = SpeedMeter(window_s=10.0)
    t, done = 0.0, 0
    assert meter.speed(t, done) is None  # nothing measured yet
    for _ in range(20):  # 1 s of work at 6 tasks/s, then 2 s starved: throughput 2 tasks/s
        meter.update(t, True)
        done += 6
        t += 1.0
        meter.update(t, False)
        t += 2.0
        assert meter.speed(t, done) == pytest.approx(6.0)
    assert done / t == pytest.approx(2.0)
    meter.update(t, True)  # slower from here on: the window forgets the old speed
    for _ in range(20):
        t += 1.0
        done += 2
        meter.speed(t, done)
    assert meter.speed(t, done) == pytest.approx(2.0)
    quiet = SpeedMeter(min_busy_s=0.5)
    quiet.speed(0.0, 0)
    quiet.update(0.0, True)
    assert quiet.speed(0.2, 3) is None  # too little busy time to tell
    with pytest.raises(ValueError):
        SpeedMeter(window_s=0.0)


def test_a_nodes_commit_metadata_gives_its_round_trip_and_speed_and_garbage_is_ignored_with_a_reason():
    from astraflow.kafka.task_placer import commit_metadata, read_commit_metadata

    report = read_commit_metadata(commit_metadata(0.3104, 2.5))
    assert (report.rtt_s, report.speed, report.problem) == (pytest.approx(0.310), 2.5, None)
    assert read_commit_metadata(commit_metadata(0.3104)).speed is None  # no speed measured yet
    assert commit_metadata(None) == ""
    assert read_commit_metadata(None) == read_commit_metadata("") == read_commit_metadata(commit_metadata(None))
    assert read_commit_metadata("").problem is None
    for other in ("rtt_ms=", "rtt_ms=abc", "samples=12", "held=8;read=110", "rtt_ms=5;rtt_ms=6", "x" * 300):
        report = read_commit_metadata(other)
        assert (report.rtt_s, report.speed) == (0.0, None) and report.problem, other
    assert read_commit_metadata("rtt_ms=-5").rtt_s == 0.0
    assert read_commit_metadata("rtt_ms=999999999").rtt_s == 60.0  # untrusted: bounded
    for speed in ("nan", "inf", "-1", "0", "1e9", "fast", ""):
        report = read_commit_metadata(f"rtt_ms=300;speed={speed}")
        assert report.speed is None and "speed" in report.problem, speed
        assert report.rtt_s == pytest.approx(0.3)  # the rest of it still counts
