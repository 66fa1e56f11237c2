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

Pure: the caller measures (end offsets, committed offsets, the time) and applies the choice.
"""

from __future__ import annotations

import math
from dataclasses import dataclass


@dataclass
class PartitionLoad:
    """What is known of one partition."""

    written: int = 0  # tasks written (the end offset, or what this process wrote since)
    committed: int = 0  # the nodes' group's committed offset
    rate: float | None = None  # tasks/s while busy (EWMA); None: never measured busy
    busy: bool = False  # had a backlog at the last observation

    @property
    def backlog(self) -> int:
        return max(0, self.written - self.committed)


class Placement:
    """Shortest expected wait over the partitions of one tasks topic (see the module doc)."""

    def __init__(self, partitions: int, *, tau_s: float = 5.0, floor: float = 0.05, prior_rate: float = 1.0) -> None:
        if partitions < 1:
            raise ValueError("placement needs at least one partition")
        if tau_s <= 0 or not 0 < floor <= 1 or prior_rate <= 0:
            raise ValueError("tau_s and prior_rate must be > 0, floor in (0, 1]")
        self.parts = [PartitionLoad() for _ in range(partitions)]
        self.tau_s, self.floor, self.prior_rate = tau_s, floor, prior_rate
        self._at: float | None = None  # time of the last observation

    def observe(self, now: float, written: dict[int, int], committed: dict[int, int]) -> None:
        """Takes a measurement at time `now` (seconds, monotonic): end offsets and the group's
        committed offsets per partition (a partition without a commit: its start offset)."""
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
            load.busy = load.backlog > 0

    def expected_wait(self, p: int) -> float:
        """Seconds until a task written to `p` now would be done, as measured."""
        known = [load.rate for load in self.parts if load.rate is not None]
        load = self.parts[p]
        rate = self.default_rate() if load.rate is None else load.rate
        rate = max(rate, self.floor * max(known, default=self.prior_rate), 1e-9)
        return (load.backlog + 1) / rate

    def default_rate(self) -> float:
        """The rate of a partition not measured yet: the mean of the measured ones, or `prior_rate`."""
        known = [load.rate for load in self.parts if load.rate is not None]
        return sum(known) / len(known) if known else self.prior_rate

    def choose(self) -> int:
        """The partition for the next task; call `sent` once written. The one whose backlog is the
        shortest in time (backlog / rate), so that every partition holds work in proportion to its
        rate and none runs dry while another holds tasks; among equals (empty ones) the one where
        the task would be done first ((backlog + 1) / rate), then the lowest number."""
        return min(range(len(self.parts)), key=lambda p: (self._drain_time(p), self.expected_wait(p), p))

    def _drain_time(self, p: int) -> float:
        return self.expected_wait(p) * self.parts[p].backlog / (self.parts[p].backlog + 1)

    def sent(self, p: int) -> None:
        """A task was written to `p` (counts in its backlog until the next observation sees it)."""
        self.parts[p].written += 1
