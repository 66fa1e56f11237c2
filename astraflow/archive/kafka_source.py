"""Reads a Kafka topic between two times, for replay and `logs show`.

The offset range of each partition comes from the broker's time index (`offsets_for_times`):
from the first offset with a timestamp at or after `since` up to (excluding) the first one after
`until`; records inside that range whose own timestamps fall outside it are dropped too, since
CreateTime timestamps need not be monotonic. The consumer is assigned partitions directly and
never commits: reading for replay or inspection leaves no trace in any consumer group.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator
from typing import Any

from confluent_kafka import KafkaError, KafkaException, TopicPartition

from astraflow.archive.errors import ReplayError
from astraflow.archive.format import ArchivedRecord
from astraflow.config import KafkaSettings
from astraflow.kafka.clients import reader
from astraflow.kafka.topics import reader_group


class TopicSource:
    """The records of one topic in a time range; each partition in offset order."""

    def __init__(
        self,
        kafka: KafkaSettings,
        topic: str,
        *,
        since_ms: int | None = None,
        until_ms: int | None = None,
        follow: bool = False,
        tail: int | None = None,
        max_record_bytes: int = 16 * 1024 * 1024,
        timeout_s: float = 15.0,
    ) -> None:
        self.topic = topic
        self.since_ms = since_ms
        self.until_ms = until_ms
        self.follow = follow
        self.timeout_s = timeout_s
        self._total: int | None = None
        self.consumer = reader(kafka, reader_group("archive_source"), max_record_bytes,
                               **{"enable.auto.offset.store": False, "enable.partition.eof": True})
        try:
            self.ranges = self._plan(tail, timeout_s)
        except BaseException:
            self.consumer.close()
            raise

    def _plan(self, tail: int | None, timeout_s: float) -> dict[int, tuple[int, int]]:
        """partition -> [start, end) offsets."""
        try:
            md = self.consumer.list_topics(self.topic, timeout=timeout_s)
        except KafkaException as exc:
            raise ReplayError(f"cannot read metadata of topic {self.topic} (is Kafka reachable?): {exc}") from exc
        tmd = md.topics.get(self.topic)
        if tmd is None or tmd.error is not None or not tmd.partitions:
            raise ReplayError(f"topic {self.topic} does not exist; list topics with `astraflow topics list`")
        ranges: dict[int, tuple[int, int]] = {}
        for p in sorted(tmd.partitions):
            low, high = self.consumer.get_watermark_offsets(TopicPartition(self.topic, p), timeout=timeout_s)
            start, end = low, high
            if self.since_ms is not None:
                start = self._offset_for(p, self.since_ms, high, timeout_s)
            if self.until_ms is not None:
                end = self._offset_for(p, self.until_ms + 1, high, timeout_s)
            if tail is not None:
                start = self._tail_start(p, start, end, tail, timeout_s)
            ranges[p] = (start, max(start, end))
        return ranges

    def _tail_start(self, partition: int, low: int, end: int, tail: int, timeout_s: float) -> int:
        """An offset after which at least `tail` records lie before `end` (or `low`). Offsets are not
        records: a transactional topic (scored, train) spends one on every commit marker, and aborted
        records are skipped under read_committed; so the window grows until it holds `tail` records."""
        window = max(tail, 1)
        while True:
            start = max(low, end - window)
            if start <= low or self._count(partition, start, end, timeout_s) >= tail:
                return start
            window *= 4

    def _count(self, partition: int, start: int, end: int, timeout_s: float) -> int:
        """Records a read_committed reader gets from [start, end) of `partition`."""
        self.consumer.assign([TopicPartition(self.topic, partition, start)])
        n, deadline = 0, time.monotonic() + timeout_s
        try:
            while time.monotonic() < deadline:
                msgs = self.consumer.consume(500, 0.5)
                for msg in msgs:
                    err = msg.error()
                    if err is not None:
                        if err.code() == KafkaError._PARTITION_EOF:
                            return n
                        if err.fatal():
                            raise ReplayError(f"fatal Kafka error reading {self.topic}: {err.str()}")
                        continue
                    if msg.offset() >= end:
                        return n
                    n += 1
                    if msg.offset() >= end - 1:
                        return n
            return n
        finally:
            self.consumer.unassign()

    def _offset_for(self, partition: int, ts_ms: int, high: int, timeout_s: float) -> int:
        tps = self.consumer.offsets_for_times([TopicPartition(self.topic, partition, ts_ms)], timeout=timeout_s)
        off = tps[0].offset
        return off if off >= 0 else high  # -1: no record at or after ts

    @property
    def total(self) -> int:
        """Records a read_committed reader gets from the ranges (counted once, before reading them:
        a transactional topic spends an offset on every commit marker, so offsets overcount)."""
        if self._total is None:
            self._total = sum(self._count(p, s, e, self.timeout_s) for p, (s, e) in self.ranges.items() if e > s)
        return self._total

    @property
    def partitions(self) -> int:
        return len(self.ranges)

    def __iter__(self) -> Iterator[ArchivedRecord]:
        return self.records()

    def records(
        self, stop: Callable[[], bool] | None = None, on_caught_up: Callable[[], None] | None = None
    ) -> Iterator[ArchivedRecord]:
        """Yields the records; with `follow`, calls `on_caught_up` once the planned range is read."""
        todo = {p for p, (s, e) in self.ranges.items() if s < e}
        caught_up = not todo  # reported after the record that completes the range is yielded

        def reached(p: int) -> None:
            nonlocal caught_up
            if p in todo:
                todo.discard(p)
                caught_up = not todo

        if caught_up and on_caught_up is not None:
            on_caught_up()
            caught_up = False
        if not todo and not self.follow:
            return
        parts = sorted(self.ranges) if self.follow else sorted(todo)
        self.consumer.assign([TopicPartition(self.topic, p, self.ranges[p][0]) for p in parts])
        while (todo or self.follow) and not (stop and stop()):
            for msg in self.consumer.consume(500, 0.5):
                p = msg.partition()
                err = msg.error()
                if err is not None:
                    if err.code() == KafkaError._PARTITION_EOF:
                        reached(p)
                        if caught_up and on_caught_up is not None:
                            on_caught_up()
                        caught_up = False
                        continue
                    if err.fatal():
                        raise ReplayError(f"fatal Kafka error reading {self.topic}: {err.str()}")
                    continue
                off = msg.offset()
                end = self.ranges[p][1]
                if off >= end - 1:
                    reached(p)
                rec = ArchivedRecord.from_message(msg)
                in_range = (self.since_ms is None or rec.timestamp_ms >= self.since_ms) and (
                    self.until_ms is None or rec.timestamp_ms <= self.until_ms
                )
                if in_range and (off < end or self.follow):
                    yield rec
                if caught_up:
                    caught_up = False
                    if on_caught_up is not None:
                        on_caught_up()

    def close(self) -> None:
        self.consumer.close()

    def __enter__(self) -> TopicSource:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()
