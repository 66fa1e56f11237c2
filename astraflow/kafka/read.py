"""Reading a partition from a given offset to its end, outside any consumer group.

`assigned_consumer` is the consumer of every such reader (assign() only: it never joins a group
or commits; read_committed, so a transaction's records are visible once it commits; fetches as
large as the largest record). `read_range` reads partition 0 of a topic from an offset to the
end it had when the read started, decoding each record; the compacted `policies` topic and the
tail of a weights topic are read this way (`astraflow.weights.versions`).
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

from confluent_kafka import Consumer, KafkaError, Message, TopicPartition

from astraflow.config import KafkaSettings
from astraflow.errors import KafkaLayerError, SerdeError
from astraflow.kafka.clients import reader_config, watermarks
from astraflow.kafka.topics import READER_GROUPS
from astraflow.serde import AvroSerde


def assigned_consumer(kafka: KafkaSettings, serde: AvroSerde, group_id: str = READER_GROUPS["weights"]) -> Consumer:
    """A consumer for assign() only (`group_id` names it to the broker; it never joins or commits)
    that reports end-of-partition and reads committed records up to `serde`'s largest record."""
    # read_committed: a version is visible once its transaction commits
    return Consumer(reader_config(kafka, group_id, serde.max_record_bytes, **{"enable.partition.eof": True}))


def read_range(
    kafka: KafkaSettings, topic: str, start: int | None, serde: AvroSerde, timeout_s: float, strict: bool = False,
    accept: Callable[[Message], bool] | None = None,
) -> list[Any]:
    """Decoded committed records of partition 0 of `topic` from `start` (None: the last 64
    offsets) to its end; records that do not decode, or that `accept` refuses (a signature
    check), are skipped (not ours to judge here).
    `strict`: raise KafkaLayerError instead of returning what was read by the timeout."""
    consumer = assigned_consumer(kafka, serde)
    try:
        low, high = watermarks(consumer, topic, 0, timeout_s)
        if high <= low:
            return []
        first = max(high - 64, low) if start is None else max(start, low)
        consumer.assign([TopicPartition(topic, 0, first)])
        out: list[Any] = []
        deadline = time.monotonic() + timeout_s
        pos = first
        while pos < high and time.monotonic() < deadline:
            for msg in consumer.consume(500, 0.5):
                if msg.error() is not None:
                    if msg.error().code() == KafkaError._PARTITION_EOF:
                        pos = high
                    continue
                pos = msg.offset() + 1
                if accept is not None and not accept(msg):
                    continue
                try:
                    out.append(serde.loads(msg.value()))
                except SerdeError:
                    continue
        if strict and pos < high:
            raise KafkaLayerError(f"could not read {topic} to its end ({pos} of {high}) in {timeout_s:.0f} s")
        return out
    finally:
        consumer.close()


SEEK_GAP = 256  # offsets between two wanted records above which `read_offsets` seeks instead of reading through


def read_offsets(consumer: Consumer, topic: str, partition: int, offsets: list[int], timeout_s: float = 30.0) -> dict[int, bytes]:
    """Raw values of the committed records at `offsets` of one partition, read with `consumer`
    (assign() only, end-of-partition reported: `assigned_consumer`); reads through runs of close
    offsets, seeks over gaps. An offset the partition no longer has (deleted by retention) or
    never had as a data record is left out of the result; a partition that cannot be read
    within `timeout_s` raises KafkaLayerError."""
    want = sorted(set(offsets))
    out: dict[int, bytes] = {}
    deadline = time.monotonic() + timeout_s
    i = 0
    while i < len(want):
        consumer.assign([TopicPartition(topic, partition, want[i])])
        pos = want[i]
        while i < len(want) and want[i] - pos <= SEEK_GAP:
            if time.monotonic() > deadline:
                raise KafkaLayerError(f"could not read {topic}[{partition}] at offsets {want[i:i + 5]}... in {timeout_s:.0f} s")
            for msg in consumer.consume(64, 0.5):
                err = msg.error()
                if err is not None:
                    if err.code() == KafkaError._PARTITION_EOF:
                        i = len(want)  # the rest is past the end: not there
                        break
                    continue
                off = msg.offset()
                pos = off + 1
                while i < len(want) and want[i] < off:
                    i += 1  # skipped by the broker: deleted, or not a data record
                if i < len(want) and want[i] == off:
                    out[off] = msg.value()
                    i += 1
    consumer.unassign()
    return out


def last_readable(consumer: Consumer, topic: str, partition: int, end: int, timeout_s: float = 30.0) -> int | None:
    """Offset of the last record below `end` (a last stable offset) that `consumer` (read_committed,
    assign() only, end-of-partition reported: `assigned_consumer`) reads, None when there is none.

    Under transactions a partition ends in commit markers (and maybe aborted records) that no
    reader sees, so the last offset a reader gets is not `end - 1`. Reads the tail of the
    partition, a window that grows eightfold back from `end` until it holds a record or starts
    at the partition's first offset."""
    low, _ = watermarks(consumer, topic, partition, timeout_s)
    deadline = time.monotonic() + timeout_s
    window = 64
    while True:
        start = max(low, end - window)
        consumer.assign([TopicPartition(topic, partition, start)])
        last, pos = None, start
        while pos < end:
            if time.monotonic() > deadline:
                raise KafkaLayerError(f"could not read {topic}[{partition}] from {start} to {end} in {timeout_s:.0f} s")
            for msg in consumer.consume(256, 0.5):
                err = msg.error()
                if err is not None:
                    if err.code() == KafkaError._PARTITION_EOF:
                        pos = max(pos, msg.offset())
                        if pos >= end:
                            break
                    continue
                pos = msg.offset() + 1
                if msg.offset() < end:
                    last = msg.offset()
        consumer.unassign()
        if last is not None or start <= low:
            return last
        window *= 8
