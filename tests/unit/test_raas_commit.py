"""A RaaS node's commits: the main loop's asynchronous ones, and the blocking ones that ride out a
broker outage (`commit_offsets`).

The loop's commit is sent without waiting (one at a time) and its offsets count as committed
only once librdkafka reports them taken; a failed one goes again with the next offsets. The
consumer here fails blocking commits as librdkafka does while the group coordinator is
unreachable (_TRANSPORT), then recovers; the blocking commit must wait for it, not drop the
commit, and must give up (without raising) only when the partitions were revoked.

A node also reports its commit round trip in its commits' metadata (the placement's refill
delay, astraflow.kafka.task_placer): the shortest of its recent commits, none before the first.
"""

from __future__ import annotations

import asyncio
import time
from types import SimpleNamespace

import pytest
from confluent_kafka import KafkaError, KafkaException, TopicPartition

from astraflow.kafka.offsets import OffsetTracker
from astraflow.kafka.task_placer import read_commit_metadata
from astraflow.raas.node import RaasNode


class OutageConsumer:
    """Fails the first `failures` commits with `code`, then accepts them."""

    def __init__(self, failures: int, code: int = KafkaError._TRANSPORT) -> None:
        self.failures, self.code = failures, code
        self.attempts = 0
        self.committed: list[list[tuple[str, int, int]]] = []

    def commit(self, offsets: list[TopicPartition], asynchronous: bool = True) -> None:
        assert not asynchronous
        self.attempts += 1
        if self.attempts <= self.failures:
            raise KafkaException(KafkaError(self.code))
        self.committed.append([(tp.topic, tp.partition, tp.offset) for tp in offsets])


def _bare_node(consumer: object) -> RaasNode:
    """A node with only what committing uses (no broker in unit tests), nothing finished yet."""
    node = RaasNode.__new__(RaasNode)
    node.offsets = OffsetTracker()
    node.consumer = SimpleNamespace(raw=consumer)  # type: ignore[assignment]
    node.dlq = SimpleNamespace(count=0)  # type: ignore[assignment]
    node.tasks_done = 0
    return node


def _finish(node: RaasNode, off: int) -> None:
    node.offsets.finished(("tasks", 0), off, node.offsets.received(("tasks", 0), off))


def _node(consumer: OutageConsumer) -> RaasNode:
    """A node with three tasks finished, ready to commit them."""
    node = _bare_node(consumer)
    for off in range(3):
        _finish(node, off)
    return node


class AsyncCommits:
    """Records the asynchronous commits it is asked for; their reports come when the test says."""

    def __init__(self) -> None:
        self.sent: list[list[TopicPartition]] = []

    def commit(self, offsets: list[TopicPartition], asynchronous: bool = True) -> None:
        assert asynchronous
        self.sent.append(offsets)


def _report(node: RaasNode, offsets: list[TopicPartition], err: KafkaError | None = None) -> None:
    node._on_commit(err, [TopicPartition(tp.topic, tp.partition, tp.offset) for tp in offsets])


def test_the_loops_commit_is_sent_without_waiting_and_counts_once_reported() -> None:
    consumer = AsyncCommits()
    node = _node(consumer)  # type: ignore[arg-type]
    asyncio.run(node._commit_async())
    assert [[(tp.partition, tp.offset) for tp in c] for c in consumer.sent] == [[(0, 3)]]
    assert node.offsets.to_commit() == {("tasks", 0): 3}  # not answered yet: not counted
    _finish(node, 3)
    asyncio.run(node._commit_async())
    assert len(consumer.sent) == 1  # one at a time: what finished meanwhile goes with the next
    _report(node, consumer.sent[0])
    asyncio.run(node._commit_async())
    assert [[(tp.partition, tp.offset) for tp in c] for c in consumer.sent] == [[(0, 3)], [(0, 4)]]
    _report(node, consumer.sent[1])
    node._take_commit_reports()
    assert node.offsets.to_commit() == {} and node._commit_sent is None


def test_a_commit_that_failed_goes_again_with_the_next_offsets() -> None:
    consumer = AsyncCommits()
    node = _node(consumer)  # type: ignore[arg-type]
    asyncio.run(node._commit_async())
    _finish(node, 3)
    _report(node, consumer.sent[0], KafkaError(KafkaError._TRANSPORT))  # the coordinator was away
    asyncio.run(node._commit_async())
    assert [[(tp.partition, tp.offset) for tp in c] for c in consumer.sent] == [[(0, 3)], [(0, 4)]]
    assert node.offsets.to_commit() == {("tasks", 0): 4}


def test_a_blocking_commits_report_is_not_taken_for_the_loops() -> None:
    """librdkafka reports every commit; one of other offsets (the rebalance's, made in its
    callback) neither counts the loop's as answered nor marks anything."""
    consumer = AsyncCommits()
    node = _node(consumer)  # type: ignore[arg-type]
    asyncio.run(node._commit_async())
    _report(node, [TopicPartition("tasks", 0, 2)])
    node._take_commit_reports()
    assert node._commit_sent is not None and node.offsets.to_commit() == {("tasks", 0): 3}


def test_the_blocking_commit_waits_out_an_outage() -> None:
    consumer = OutageConsumer(failures=2, code=KafkaError.COORDINATOR_LOAD_IN_PROGRESS)
    node = _node(consumer)
    node._commit()
    assert consumer.committed == [[("tasks", 0, 3)]] and node.offsets.to_commit() == {}


def test_revoked_partitions_are_not_marked_committed_and_do_not_stop_the_node() -> None:
    consumer = OutageConsumer(failures=1, code=KafkaError.ILLEGAL_GENERATION)
    node = _node(consumer)
    node._commit()
    assert consumer.committed == [] and consumer.attempts == 1
    assert node.offsets.to_commit() == {("tasks", 0): 3}  # still to commit (if the partition stays)


class SlowCommits:
    """Each commit takes the next of `delays` seconds; keeps the metadata it was given."""

    def __init__(self, delays: list[float]) -> None:
        self.delays, self.metadata = list(delays), []

    def commit(self, offsets: list[TopicPartition], asynchronous: bool = True) -> None:
        self.metadata.append({tp.metadata for tp in offsets})
        time.sleep(self.delays.pop(0))


def test_each_commit_carries_the_shortest_round_trip_of_the_ones_before() -> None:
    consumer = SlowCommits([0.20, 0.05, 0.30, 0.0])
    node = _bare_node(consumer)
    for off in range(4):
        _finish(node, off)
        node._commit()
    first, *rest = consumer.metadata
    assert first == {""}  # nothing measured yet
    reported = [read_commit_metadata(next(iter(m))).rtt_s for m in rest]
    assert reported[0] >= 0.2 and 0.05 <= reported[1] < 0.2 and 0.05 <= reported[2] < 0.2  # a stall is not kept


def test_each_commit_carries_the_nodes_speed_while_busy_split_over_its_partitions() -> None:
    import asyncio
    import collections

    consumer = SlowCommits([0.0, 0.0])
    node = _bare_node(consumer)
    node._owned = frozenset({("tasks", 0), ("tasks", 1)})
    began = time.monotonic() - 2.0
    node._speed().speed(began, 0)
    node._speed().update(began, True)  # rollouts in flight for 2 s
    node.tasks_done = 8
    _finish(node, 0)
    node._commit()
    assert read_commit_metadata(next(iter(consumer.metadata[0]))).speed == pytest.approx(8 / 2 / 2, rel=0.05)
    # its last rollout ends (the node's own hook): idle time after it does not lower the speed
    node.inflight, node._waiting, node._slot_freed = 1, collections.deque(), asyncio.Event()
    node._release()
    time.sleep(0.3)
    _finish(node, 1)
    node._commit()
    assert read_commit_metadata(next(iter(consumer.metadata[1]))).speed == pytest.approx(8 / 2 / 2, rel=0.05)
