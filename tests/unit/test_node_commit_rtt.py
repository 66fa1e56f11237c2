"""A RaaS node reports its commit round trip in its commits' metadata (the placement's refill
delay, astraflow.kafka.task_placer): the shortest of its recent commits, none before the first."""

from __future__ import annotations

import time
from types import SimpleNamespace

from confluent_kafka import TopicPartition

from astraflow.kafka.offsets import OffsetTracker
from astraflow.kafka.task_placer import commit_rtt_s
from astraflow.raas.node import RaasNode


class SlowCommits:
    """Each commit takes the next of `delays` seconds; keeps the metadata it was given."""

    def __init__(self, delays: list[float]) -> None:
        self.delays, self.metadata = list(delays), []

    def commit(self, offsets: list[TopicPartition], asynchronous: bool = True) -> None:
        self.metadata.append({tp.metadata for tp in offsets})
        time.sleep(self.delays.pop(0))


def test_each_commit_carries_the_shortest_round_trip_of_the_ones_before() -> None:
    consumer = SlowCommits([0.20, 0.05, 0.30, 0.0])
    node = RaasNode.__new__(RaasNode)
    node.offsets = OffsetTracker()
    node.consumer = SimpleNamespace(raw=consumer)  # type: ignore[assignment]
    node.dlq = SimpleNamespace(count=0)  # type: ignore[assignment]
    for off in range(4):
        node.offsets.finished(("tasks", 0), off, node.offsets.received(("tasks", 0), off))
        node._commit()
    first, *rest = consumer.metadata
    assert first == {""}  # nothing measured yet
    reported = [commit_rtt_s(next(iter(m))) for m in rest]
    assert reported[0] >= 0.2 and 0.05 <= reported[1] < 0.2 and 0.05 <= reported[2] < 0.2  # a stall is not kept
