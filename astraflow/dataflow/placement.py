"""Which partition of `tasks` the curator writes each task to, so that work follows node speed.

With a classic consumer group a node owns whole partitions and reads only those. Spreading
tasks evenly over partitions (a key hash) makes each node's share follow its number of
partitions: a slow node's partitions fill up while fast nodes run dry. Instead the curator
places every task itself, from what Kafka says about each partition:

* backlog(p) = tasks written to p - the nodes' group committed offset of p (queued, prefetched
  or in flight on the node that owns p);
* rate(p) = an exponentially weighted moving average (time constant `tau_s`) of how fast the
  committed offset of p advances, sampled only while p had a backlog (an idle partition keeps
  the rate it had when it was busy: having nothing to do does not make its node slow);
* the task goes to the partition whose backlog is the shortest in time, backlog(p) / rate(p);
  among equals (empty partitions) to the one where it would be done first, (backlog(p) + 1) / rate(p).

So each partition holds a backlog in proportion to the speed of the node that owns it: an empty
partition is refilled before any other gets a second task, so no node runs dry while tasks wait
elsewhere, and a node's share of the tasks follows its speed (a node owning several partitions
gets their sum). (Shortest expected completion alone, (backlog + 1) / rate, would send every
task to the fast nodes while they hold fewer tasks than speed ratio - 1, and leave slow nodes idle
with tasks waiting: the latency of one task, not the throughput of all.)
A partition not measured yet (a new topic) counts at the mean of the measured rates (or
`prior_rate`), and its first measurement starts from there, so every partition is tried; the rate used is at least `floor` times the fastest
partition's, so a partition whose node has sped up is offered a task now and then and its rate
measured again. A partition whose node died has a backlog that stops moving: its rate decays to
the floor within a few `tau_s`, and it gets no new task until another node takes it over (the
group's session timeout) and drains it, which raises its rate again.

**Refill delay.** A node does not see a task the moment it is written, nor is its completion seen
the moment it ends: the task crosses to the node (a fetch round trip), its commit crosses back (a
commit round trip), and the placement sees it at its next measurement. During that delay D(p) the
partition's backlog is in transit, not work its node can start; by Little's law a partition needs
rate x D(p) tasks outstanding for that alone. Placing by backlog / rate alone keeps every
partition's backlog at the same few tenths of a second: a node whose refill delay is longer
(behind a WAN) runs dry between refills, its measured rate falls, it gets still fewer tasks, and
so on down to the floor (a node behind a 300 ms round trip did exactly that). So the caller gives
each partition's measured refill delay with its observations, and the backlog counted is the part
beyond it: backlog(p) / rate(p) - D(p) (every partition first gets its rate x D, then the rest is
shared in proportion to the rates, as before). The delay is measured, not inferred from task
latencies (by Little's law backlog / rate is the mean latency, so latencies cannot tell a node
starved by its link from one with a queue), at most `max_delay_s`, and not counted for a partition
whose rate is at the floor (a dead node's partition gets no reserve). Placement only chooses the
partition: how many tasks are outstanding in all is the caller's count (the curator's max-ahead),
exactly as before. When that total is smaller than the nodes' reserves together, some node
runs short whatever the choice: the partitions furthest below their reserve in time are filled
first, then, among equals, the one where a task would be done soonest.

**Reserve by speed, not throughput.** A reserve of rate x D is a fixed point: the rate is measured
from commits, so it is a throughput, and a node fed less than it could do (its refill is slower
than measured, e.g. a WAN fetch cycle) shows a lower rate, gets a smaller reserve, and is fed at
the rate it is fed (a node behind a 300 ms link did half its share that way, idle 25% of the time
with its own tasks on the way). So a node also reports its SPEED: tasks per second while it had
rollouts in flight, over a window (`SpeedMeter`), split over the partitions it owns; that does not
fall when the node is starved, only when it is slow. The reserve is max(speed, rate) x D (rate
alone where no speed was reported; the larger, since a node's speed is a measure over its
partitions together and the rate of one of them may exceed its even split). The speed is
untrusted (the caller validates and bounds it, `astraflow.kafka.task_placer`); a node that claims
more than it does only holds more of its own tasks, at most its speed x `max_delay_s`.

Pure: the caller measures (end offsets, committed offsets, refill delays, the time) and applies the choice.
"""

from __future__ import annotations

import math
import threading
from collections import deque
from dataclasses import dataclass


@dataclass
class PartitionLoad:
    """What is known of one partition."""

    written: int = 0  # tasks written (the end offset, or what this process wrote since)
    committed: int = 0  # the nodes' group's committed offset
    rate: float | None = None  # tasks/s while busy (EWMA); None: never measured busy
    busy: bool = False  # had a backlog at the last observation
    delay: float = 0.0  # refill delay, seconds: write to fetched plus done to commit seen (as measured)
    speed: float | None = None  # tasks/s its node reports for it while busy (its speed split over its partitions)

    @property
    def backlog(self) -> int:
        return max(0, self.written - self.committed)


class Placement:
    """Shortest expected wait over the partitions of one tasks topic (see the module doc)."""

    def __init__(self, partitions: int, *, tau_s: float = 5.0, floor: float = 0.05, prior_rate: float = 1.0,
                 max_delay_s: float = 5.0) -> None:
        if partitions < 1:
            raise ValueError("placement needs at least one partition")
        if tau_s <= 0 or not 0 < floor <= 1 or prior_rate <= 0 or max_delay_s < 0:
            raise ValueError("tau_s and prior_rate must be > 0, floor in (0, 1], max_delay_s >= 0")
        self.parts = [PartitionLoad() for _ in range(partitions)]
        self.tau_s, self.floor, self.prior_rate, self.max_delay_s = tau_s, floor, prior_rate, max_delay_s
        self._at: float | None = None  # time of the last observation

    def observe(self, now: float, written: dict[int, int], committed: dict[int, int],
                delays: dict[int, float] | None = None, speeds: dict[int, float | None] | None = None) -> None:
        """Takes a measurement at time `now` (seconds, monotonic): end offsets and the group's
        committed offsets per partition (a partition without a commit: its start offset), the
        refill delays measured and the speeds reported (tasks/s; None: none reported); a
        partition not in `delays` or `speeds` keeps its last one."""
        dt = None if self._at is None else now - self._at
        if dt is not None and dt <= 0:
            return
        self._at = now
        start = self.default_rate()
        alpha = 0.0 if dt is None else 1.0 - math.exp(-dt / self.tau_s)
        for p, load in enumerate(self.parts):
            new_committed = committed.get(p, load.committed)
            advance = max(0, new_committed - load.committed)
            if dt is not None and (load.busy or advance > 0):
                rate = start if load.rate is None else load.rate  # a first measurement starts from the others'
                load.rate = rate + alpha * (advance / dt - rate)
            load.committed = max(load.committed, new_committed)
            load.written = max(load.written, written.get(p, load.written))
            if delays and p in delays:
                load.delay = min(max(0.0, delays[p]), self.max_delay_s)
            if speeds and p in speeds:
                speed = speeds[p]
                load.speed = speed if speed is not None and math.isfinite(speed) and speed > 0 else None
            load.busy = load.backlog > 0

    def rate_of(self, p: int) -> float:
        """The rate placement uses for `p`: measured (or the default), at least the floor."""
        known = [load.rate for load in self.parts if load.rate is not None]
        load = self.parts[p]
        rate = self.default_rate() if load.rate is None else load.rate
        return max(rate, self.floor * max(known, default=self.prior_rate), 1e-9)

    def reserve(self, p: int) -> float:
        """Tasks `p` holds for its refill delay: max(speed, rate) x delay; none while its rate is at the floor."""
        load = self.parts[p]
        known = [x.rate for x in self.parts if x.rate is not None]
        if load.rate is None or load.rate <= self.floor * max(known, default=self.prior_rate):
            return 0.0
        return max(load.rate, load.speed or 0.0) * load.delay

    def expected_wait(self, p: int) -> float:
        """Seconds until a task written to `p` now would be done, as measured."""
        return (self.parts[p].backlog + 1) / self.rate_of(p)

    def default_rate(self) -> float:
        """The rate of a partition not measured yet: the mean of the measured ones, or `prior_rate`."""
        known = [load.rate for load in self.parts if load.rate is not None]
        return sum(known) / len(known) if known else self.prior_rate

    def choose(self) -> int:
        """The partition for the next task; call `sent` once written. The one whose backlog beyond
        its reserve is the shortest in time ((backlog - reserve) / rate), so that every partition
        holds its reserve and then work in proportion to its rate, and none runs dry while
        another holds tasks; among equals the one where the task would be done first
        ((backlog + 1 - reserve) / rate), then the lowest number."""
        def key(p: int) -> tuple[float, float, int]:
            rate, reserve, backlog = self.rate_of(p), self.reserve(p), self.parts[p].backlog
            return (backlog - reserve) / rate, (backlog + 1 - reserve) / rate, p

        return min(range(len(self.parts)), key=key)

    def sent(self, p: int) -> None:
        """A task was written to `p` (counts in its backlog until the next observation sees it)."""
        self.parts[p].written += 1


class SpeedMeter:
    """A node's speed: tasks done per second of the time it had rollouts in flight, over about the
    last `window_s` seconds (a node starved of work is not slow). `update` at every change of
    busy; `speed` when reporting (each call is also a mark the next ones measure from). Thread-safe
    (a node reports from its commit thread)."""

    def __init__(self, window_s: float = 10.0, min_busy_s: float = 0.5) -> None:
        if window_s <= 0 or min_busy_s <= 0:
            raise ValueError("window_s and min_busy_s must be > 0")
        self.window_s, self.min_busy_s = window_s, min_busy_s
        self._lock = threading.Lock()
        self._busy_total = 0.0  # seconds busy before `_since`
        self._since: float | None = None  # busy since then
        self._marks: deque[tuple[float, int, float]] = deque()  # (time, tasks done, busy seconds until then)

    def _busy_at(self, now: float) -> float:
        return self._busy_total + (0.0 if self._since is None else max(0.0, now - self._since))

    def update(self, now: float, busy: bool) -> None:
        """The node has rollouts in flight (`busy`) from `now` on, or none."""
        with self._lock:
            if busy and self._since is None:
                self._since = now
            elif not busy and self._since is not None:
                self._busy_total = self._busy_at(now)
                self._since = None

    def speed(self, now: float, done: int) -> float | None:
        """Tasks/s while busy since the oldest mark in the window (`done`: tasks done so far); None
        until `min_busy_s` of busy time and one task done were seen since a mark."""
        with self._lock:
            busy_now = self._busy_at(now)
            if not self._marks or now - self._marks[-1][0] >= self.window_s / 20:
                self._marks.append((now, done, busy_now))
            while len(self._marks) > 1 and self._marks[1][0] <= now - self.window_s:
                self._marks.popleft()  # keep the newest mark at or before the window's start
            _, d0, b0 = self._marks[0]
            busy = busy_now - b0
            if busy < self.min_busy_s or done <= d0:
                return None
            return (done - d0) / busy
