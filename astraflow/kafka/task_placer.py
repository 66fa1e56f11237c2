"""The curator's partition choice for `tasks`: `astraflow.dataflow.placement` fed from Kafka.

`TaskPlacer(consumer, kafka, topic, group)` reads the topic's end offsets once (what was written
before this process), then on every `observe(now)` the committed offsets of the nodes' consumer
group (`af.<experiment>.raas`) with one `committed()` call; what this process writes it counts
itself (`sent`), since the tasks topic has no transaction markers (the curator writes it
without a transaction) and offsets are task counts. `choose()` names the partition for the next
task. A failed measurement keeps the last one (the placement goes on from what it knew).
"""

from __future__ import annotations

import logging
import time
from typing import Any

from confluent_kafka import Consumer, KafkaException, TopicPartition

from astraflow.config import KafkaSettings
from astraflow.dataflow.placement import Placement
from astraflow.errors import AstraflowError
from astraflow.kafka.clients import reader_config, watermarks

log = logging.getLogger("astraflow.kafka.task_placer")


class TaskPlacer:
    """Partition of `topic` for each task, from the progress of consumer group `group`."""

    def __init__(self, consumer: Any, kafka: KafkaSettings, topic: str, group: str, **policy: float) -> None:
        md = consumer.list_topics(topic, timeout=10.0)
        meta = md.topics.get(topic)
        if meta is None or meta.error is not None:
            raise AstraflowError(f"topic {topic} does not exist; create the experiment's topics with `astraflow topics create`")
        self.topic, self.group = topic, group
        self.partitions = sorted(meta.partitions)
        self.policy = Placement(len(self.partitions), **policy)
        marks = {i: watermarks(consumer, topic, p) for i, p in enumerate(self.partitions)}
        # until the group commits, a partition's tasks count from its first offset still held
        self.policy.observe(time.monotonic(), {i: hi for i, (_, hi) in marks.items()}, {i: lo for i, (lo, _) in marks.items()})
        # committed() reads the offsets of the consumer's own group: a reader named after the nodes' group,
        # which never subscribes (so it never joins that group).
        self._reader = Consumer(reader_config(kafka, group))
        self._warned = False

    def observe(self, now: float) -> None:
        try:
            got = self._reader.committed([TopicPartition(self.topic, p) for p in self.partitions], timeout=5.0)
        except KafkaException as exc:
            if not self._warned:
                log.warning("could not read the committed offsets of %s (%s); placing from the last ones", self.group, exc)
                self._warned = True
            return
        self._warned = False
        index = {p: i for i, p in enumerate(self.partitions)}
        committed = {index[tp.partition]: tp.offset for tp in got if tp.offset >= 0}
        self.policy.observe(now, {}, committed)

    def choose(self) -> int:
        return self.partitions[self.policy.choose()]

    def sent(self, partition: int) -> None:
        self.policy.sent(self.partitions.index(partition))

    def close(self) -> None:
        self._reader.close()
