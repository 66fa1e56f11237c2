"""Offsets facts of a cluster, read with the admin API: watermarks, offsets by time, group lag,
and reading a bounded range of records without joining a group.

These are the raw measurements behind `astraflow status` and the Prometheus bridge. Each call
batches every partition into one admin request, so a status of a 50-topic experiment costs a
handful of round trips, not hundreds.
"""

from __future__ import annotations

import time
from collections.abc import Iterable
from dataclasses import dataclass, field

from confluent_kafka import ConsumerGroupTopicPartitions, KafkaError, KafkaException, TopicPartition
from confluent_kafka.admin import AdminClient, OffsetSpec

from astraflow.config import KafkaSettings
from astraflow.errors import KafkaLayerError
from astraflow.kafka.clients import reader
from astraflow.kafka.counts import RecordCounter
from astraflow.kafka.offsets import TP
from astraflow.kafka.topics import reader_group


@dataclass
class PartitionOffsets:
    """Where one partition starts and ends, and where it stood `window_s` ago."""

    low: int  # first offset still stored
    high: int  # next offset to be written (high watermark)
    window_start: int  # first offset written within the window (== high when none was)

    @property
    def records(self) -> int:
        return max(0, self.high - self.low)

    @property
    def in_window(self) -> int:
        return max(0, self.high - self.window_start)


@dataclass
class GroupLag:
    """Consumer lag of one group on one topic."""

    group: str
    topic: str
    lag: int  # records between the committed offsets and the ends of the partitions
    partitions: int  # partitions of the topic
    state: str = ""  # STABLE, EMPTY, ... as the coordinator reports it
    members: int = 0  # consumers in the group now


@dataclass
class GroupInfo:
    """What the coordinator says about a group: state, members and their assigned topics."""

    state: str = ""
    members: int = 0
    assigned: set[TP] = field(default_factory=set)


class OffsetReader:
    """Batched admin queries against one cluster."""

    def __init__(self, kafka: KafkaSettings, timeout_s: float = 10.0) -> None:
        self.kafka = kafka
        self.timeout_s = timeout_s
        self.admin = AdminClient(kafka.client_config())
        self._counter: RecordCounter | None = None

    @property
    def counter(self) -> RecordCounter:
        """Committed-record counts (`astraflow.kafka.counts`), kept across calls: a reader used
        again (`status --watch`, the live page) reads only the records written since."""
        if self._counter is None:
            self._counter = RecordCounter(self.kafka)
        return self._counter

    def close(self) -> None:
        if self._counter is not None:
            self._counter.close()

    def topics(self, prefix: str) -> dict[str, int]:
        """Topic name -> partition count, for names starting with `prefix`."""
        try:
            md = self.admin.list_topics(timeout=self.timeout_s)
        except KafkaException as exc:
            raise KafkaLayerError(f"cannot list topics (is Kafka at {self.kafka.bootstrap_servers} reachable?): {exc}") from exc
        return {n: len(t.partitions) for n, t in sorted(md.topics.items()) if n.startswith(prefix) and not t.error}

    def _list(self, specs: dict[TopicPartition, OffsetSpec]) -> dict[TP, int]:
        if not specs:
            return {}
        out: dict[TP, int] = {}
        try:
            futures = self.admin.list_offsets(specs, request_timeout=self.timeout_s)
            for tp, fut in futures.items():
                out[(tp.topic, tp.partition)] = fut.result(timeout=self.timeout_s).offset
        except KafkaException as exc:
            raise KafkaLayerError(f"cannot list offsets: {exc}") from exc
        except TimeoutError as exc:  # the future's own wait: a broker restarting, a leader moving
            raise KafkaLayerError(f"cannot list offsets: no answer within {self.timeout_s:.0f} s "
                                  f"(is Kafka at {self.kafka.bootstrap_servers} up?)") from exc
        return out

    def partition_offsets(self, topics: dict[str, int], window_s: float) -> dict[TP, PartitionOffsets]:
        """Low and high watermarks of every partition, and the first offset of the last `window_s`."""
        tps = [TopicPartition(t, p) for t, n in topics.items() for p in range(n)]
        low = self._list({tp: OffsetSpec.earliest() for tp in tps})
        high = self._list({tp: OffsetSpec.latest() for tp in tps})
        since = int((time.time() - window_s) * 1000)
        at = self._list({tp: OffsetSpec.for_timestamp(since) for tp in tps})
        out = {}
        for key, hi in high.items():
            start = at.get(key, -1)
            out[key] = PartitionOffsets(low.get(key, 0), hi, hi if start < 0 else start)
        return out

    def offsets_at(self, tps: Iterable[TP], ts_ms: int) -> dict[TP, int]:
        """The first offset of each partition whose record timestamp is >= ts_ms (-1: none is)."""
        return self._list({TopicPartition(t, p): OffsetSpec.for_timestamp(ts_ms) for t, p in tps})

    def groups(self, prefix: str) -> dict[str, GroupInfo]:
        """Consumer groups whose id starts with `prefix`, with state and members' assignments."""
        try:
            listed = self.admin.list_consumer_groups(request_timeout=self.timeout_s).result(timeout=self.timeout_s)
        except KafkaException as exc:
            raise KafkaLayerError(f"cannot list consumer groups: {exc}") from exc
        ids = sorted(g.group_id for g in listed.valid if g.group_id.startswith(prefix))
        out = {g: GroupInfo() for g in ids}
        if not ids:
            return out
        for gid, fut in self.admin.describe_consumer_groups(ids, request_timeout=self.timeout_s).items():
            try:
                desc = fut.result(timeout=self.timeout_s)
            except KafkaException:
                continue  # a group deleted between list and describe
            info = out[gid]
            info.state = getattr(desc.state, "name", str(desc.state))
            info.members = len(desc.members)
            for m in desc.members:
                for tp in (m.assignment.topic_partitions if m.assignment else []):
                    info.assigned.add((tp.topic, tp.partition))
        return out

    def committed(self, group: str) -> dict[TP, int]:
        """Every committed offset of `group` (the admin API answers one group per request)."""
        try:
            fut = self.admin.list_consumer_group_offsets([ConsumerGroupTopicPartitions(group)],
                                                         request_timeout=self.timeout_s)[group]
            res = fut.result(timeout=self.timeout_s)
        except KafkaException as exc:
            raise KafkaLayerError(f"cannot read the committed offsets of group {group}: {exc}") from exc
        return {(tp.topic, tp.partition): tp.offset for tp in res.topic_partitions if tp.offset >= 0 and not tp.error}


def group_lags(groups: dict[str, GroupInfo], committed: dict[str, dict[TP, int]],
               offsets: dict[TP, PartitionOffsets], topics: dict[str, int],
               counter: RecordCounter | None = None) -> list[GroupLag]:
    """Lag per (group, topic) over every partition of each topic the group has committed on or is
    assigned: a group reads whole topics, so a partition without a commit yet still waits for it,
    from the log start (where `auto.offset.reset=earliest` reads). With a `counter` that has read
    the partitions, the lag is in records (transaction markers left out), else in offsets."""
    out: list[GroupLag] = []
    for gid, info in groups.items():
        commits = committed.get(gid, {})
        for topic in sorted({t for t, _p in set(commits) | info.assigned if t in topics}):
            lag = 0
            for p in range(topics[topic]):
                po = offsets.get((topic, p))
                if po is None:
                    continue
                start = max(commits.get((topic, p), po.low), po.low)
                if counter is not None:
                    lag += counter.after((topic, p), start, po.high)
                else:
                    lag += max(0, po.high - start)
            out.append(GroupLag(gid, topic, lag, topics[topic], info.state, info.members))
    return out


def read_ranges(kafka: KafkaSettings, ranges: dict[TP, tuple[int, int]],
                timeout_s: float = 10.0) -> list[tuple[TP, int, bytes | None, bytes | None, list]]:
    """(partition, offset, value, key, headers) of the records in [start, end) of each
    partition, read with assign(): no group, no commit.

    Stops at each range's end or at the partition's end (EOF also covers transaction markers,
    which occupy offsets but are never delivered), or when `timeout_s` runs out.
    """
    todo = {tp: r for tp, r in ranges.items() if r[1] > r[0]}
    if not todo:
        return []
    # assign() only: never joins, never commits
    consumer = reader(kafka, reader_group("status"), **{"enable.partition.eof": True})
    out: list[tuple[TP, int, bytes | None, bytes | None, list]] = []
    try:
        consumer.assign([TopicPartition(t, p, start) for (t, p), (start, _end) in todo.items()])
        pending = set(todo)
        deadline = time.monotonic() + timeout_s
        while pending and time.monotonic() < deadline:
            for msg in consumer.consume(500, 0.2):
                key = (msg.topic(), msg.partition())
                err = msg.error()
                if err is not None:
                    if err.code() == KafkaError._PARTITION_EOF:
                        pending.discard(key)
                    continue
                if key not in todo:
                    continue
                if msg.offset() < todo[key][1]:
                    out.append((key, msg.offset(), msg.value(), msg.key(), list(msg.headers() or [])))
                if msg.offset() >= todo[key][1] - 1 and key in pending:
                    pending.discard(key)
                    consumer.pause([TopicPartition(*key)])
    finally:
        consumer.close()
    return out
