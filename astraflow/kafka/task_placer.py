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
node's own stalls: `rtt_ms=N`) into the metadata of every offset it commits, and the delay is that round trip twice (the task's fetch
and the commit) plus this placer's own lag: the time between its observations and the
`committed()` call itself. A commit without that metadata counts only the placer's lag.
"""

from __future__ import annotations

import logging
import time

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
        delays = {self._index[tp.partition]: 2 * commit_rtt_s(tp.metadata) + lag for tp in got if tp.offset >= 0}
        self.policy.observe(now, {}, committed, delays)

    def choose(self) -> int:
        return self.partitions[self.policy.choose()]

    def sent(self, partition: int) -> None:
        self.policy.sent(self._index[partition])

    def close(self) -> None:
        self._reader.close()


RTT_KEY = "rtt_ms="


def commit_metadata(rtt_s: float | None) -> str:
    """What a RaaS node writes with its commits: its last commit's round trip (empty if none yet)."""
    return "" if rtt_s is None else f"{RTT_KEY}{round(rtt_s * 1000)}"


def commit_rtt_s(metadata: str | None) -> float:
    """The round trip a node reported in its commit's metadata, seconds (0 if none, or not ours)."""
    if not metadata or not metadata.startswith(RTT_KEY):
        return 0.0
    try:
        return max(0.0, min(60.0, int(metadata[len(RTT_KEY):]) / 1000))
    except ValueError:  # untrusted: someone else's metadata
        return 0.0
