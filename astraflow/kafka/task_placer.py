"""The curator's partition choice for `tasks`: `astraflow.dataflow.placement` fed from Kafka.

`TaskPlacer(kafka, topic, group, marks)` starts from the topic's watermarks, which the curator
reads once at start (what was written before this process), then on every `observe(now)` reads
the committed offsets of the nodes' consumer group (`af.<experiment>.raas`) with one
`committed()` call; what this process writes it counts
itself (`sent`), since the tasks topic has no transaction markers (the curator writes it
without a transaction) and offsets are task counts. `choose()` names the partition for the next
task. A failed measurement keeps the last one (the placement goes on from what it knew).

Refill delay of each partition (see the placement's module doc), measured: a RaaS node writes
the duration of its shortest recent commit (one round trip to the group coordinator, without the
node's own stalls: `rtt_ms=N`) into the metadata of every offset it commits, and the delay is
three times that round trip plus this placer's own lag (the time between its observations and
the `committed()` call itself): the mean time a task's partition holds it for the link. A node's
fetch is always in flight, so a written task waits for the broker's next answer (half a round
trip on average) and then crosses (half of one); once done, its trajectories must be
acknowledged before its offset may be committed (a produce round trip); then the commit waits
for the node's commit in flight (half a round trip on average) and crosses (half of one). By
Little's law the tasks in transit are speed x that mean. (Twice the round trip, before, left out
the acknowledgement: a node behind a 300 ms link then held what the placement thought its
reserve and still sat idle a third of the time with its next tasks on the way; the simulation in
tests/unit/test_task_placement.py, with those legs, gives the same.) A commit without that
metadata counts only the placer's lag.

Speed of each partition (the placement's reserve is max(speed, rate) x delay): the node also
writes its speed, tasks per second while it had rollouts in flight (`SpeedMeter`), divided by the
number of partitions it owns (`speed=X`). Metadata is untrusted: anything malformed, not finite,
negative or above `MAX_SPEED` is ignored (the partition falls back to its measured rate), and the
first time each reason is seen it is logged.
"""

from __future__ import annotations

import logging
import math
import time
from dataclasses import dataclass

from confluent_kafka import Consumer, KafkaException, TopicPartition

from astraflow.config import KafkaSettings
from astraflow.dataflow.placement import Placement
from astraflow.kafka.clients import reader_config

log = logging.getLogger("astraflow.kafka.task_placer")


class TaskPlacer:
    """Partition of `topic` for each task, from the progress of consumer group `group`."""

    def __init__(self, kafka: KafkaSettings, topic: str, group: str, marks: dict[int, tuple[int, int]], **policy: float) -> None:
        """`marks`: (low, high) watermarks of each partition of `topic`, as read at start."""
        self.topic, self.group = topic, group
        self.partitions = sorted(marks)
        self._index = {p: i for i, p in enumerate(self.partitions)}
        self.policy = Placement(len(self.partitions), **policy)
        # until the group commits, a partition's tasks count from its first offset still held
        self.policy.observe(time.monotonic(), {self._index[p]: hi for p, (_, hi) in marks.items()},
                            {self._index[p]: lo for p, (lo, _) in marks.items()})
        # committed() reads the offsets of the consumer's own group: a reader named after the nodes' group,
        # which never subscribes (so it never joins that group).
        self._reader = Consumer(reader_config(kafka, group))
        self._warned = False
        self._ignored: set[str] = set()  # reasons already logged for metadata ignored
        self._last: float | None = None  # time of the last observation

    def observe(self, now: float) -> None:
        asked = time.monotonic()
        try:
            got = self._reader.committed([TopicPartition(self.topic, p) for p in self.partitions], timeout=5.0)
        except KafkaException as exc:
            if not self._warned:
                log.warning("could not read the committed offsets of %s (%s); placing from the last ones", self.group, exc)
                self._warned = True
            return
        self._warned = False
        committed = {self._index[tp.partition]: tp.offset for tp in got if tp.offset >= 0}
        lag = (time.monotonic() - asked) + (0.0 if self._last is None else max(0.0, now - self._last))
        self._last = now
        delays: dict[int, float] = {}
        speeds: dict[int, float | None] = {}
        for tp in got:
            if tp.offset < 0:
                continue
            report = read_commit_metadata(tp.metadata)
            if report.problem and report.problem not in self._ignored:
                self._ignored.add(report.problem)
                log.warning("commit metadata %r of %s[%d] (partly) ignored: %s (logged once)", tp.metadata[:MAX_METADATA],
                            self.topic, tp.partition, report.problem)
            delays[self._index[tp.partition]] = refill_delay_s(report, lag)
            speeds[self._index[tp.partition]] = report.speed
        self.policy.observe(now, {}, committed, delays, speeds)

    def choose(self) -> int:
        return self.partitions[self.policy.choose()]

    def sent(self, partition: int) -> None:
        self.policy.sent(self._index[partition])

    def close(self) -> None:
        self._reader.close()


RTT_KEY, SPEED_KEY = "rtt_ms", "speed"
MAX_RTT_S = 60.0  # a reported round trip is clipped to this
MAX_SPEED = 10_000.0  # tasks/s per partition; a report above it is ignored
MAX_METADATA = 200  # characters; longer metadata is not ours


def commit_metadata(rtt_s: float | None, speed: float | None = None) -> str:
    """What a RaaS node writes with its commits: its last commit's round trip and its speed per
    partition owned, tasks/s (each left out if not measured yet)."""
    fields = [] if rtt_s is None else [f"{RTT_KEY}={round(rtt_s * 1000)}"]
    fields += [] if speed is None else [f"{SPEED_KEY}={speed:.3f}"]
    return ";".join(fields)


@dataclass(frozen=True)
class CommitReport:
    """What a node's commit metadata says, as far as it can be trusted."""

    rtt_s: float = 0.0  # its commit round trip (0: none reported)
    speed: float | None = None  # tasks/s while busy, per partition (None: none reported, or ignored)
    problem: str | None = None  # why something in it was ignored


def refill_delay_s(report: CommitReport, lag_s: float) -> float:
    """A partition's refill delay from its node's report and the placer's own lag: three round
    trips, the mean of a task's fetch, its trajectories' acknowledgement and its commit's way back
    (see the module doc)."""
    return 3 * report.rtt_s + lag_s


def read_commit_metadata(metadata: str | None) -> CommitReport:
    """Reads `commit_metadata`'s text, untrusted: a round trip is bounded to [0, MAX_RTT_S]; a
    speed that is not a finite number in (0, MAX_SPEED] is ignored, with the reason."""
    if not metadata:
        return CommitReport()
    if len(metadata) > MAX_METADATA:
        return CommitReport(problem=f"longer than {MAX_METADATA} characters")
    fields: dict[str, str] = {}
    for part in metadata.split(";"):
        key, eq, value = part.partition("=")
        if not eq or key not in (RTT_KEY, SPEED_KEY) or key in fields:
            return CommitReport(problem="not a RaaS node's metadata")
        fields[key] = value
    rtt_s, speed, problems = 0.0, None, []
    if RTT_KEY in fields:
        try:
            rtt_s = max(0.0, min(MAX_RTT_S, int(fields[RTT_KEY]) / 1000))
        except ValueError:
            problems.append(f"{RTT_KEY} not an integer")
    if SPEED_KEY in fields:
        try:
            value = float(fields[SPEED_KEY])
        except ValueError:
            value = math.nan
        if math.isfinite(value) and 0 < value <= MAX_SPEED:
            speed = value
        else:
            problems.append(f"{SPEED_KEY} not a number in (0, {MAX_SPEED:g}]")
    return CommitReport(rtt_s, speed, "; ".join(problems) or None)
