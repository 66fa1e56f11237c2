"""Record counts of partitions: what a read_committed consumer reads, not what offsets span.

Offsets are not records. Every hop of the dataflow writes in Kafka transactions, and each commit
or abort spends one offset per partition on a control record (a transaction marker) that no
consumer ever receives; aborted records take offsets too and are skipped under read_committed. On
a transactional topic `high - low` overcounts by one offset per transaction and partition (a run
of 9,457 scored trajectories spanned 10,650 offsets). So whatever a person is shown as a count
(`astraflow status`, the live page, replay's progress, lag in records) comes from here.

`RecordCounter` reads each partition once with a read_committed, assign()-only consumer (it never
joins a group nor commits), keeping for each record only its offset and timestamp (16 bytes), and
on later calls reads only what was written since: `--watch` and the live page pay for new records
only. From those it answers records stored, records written in a time window, and records between
a consumer group's committed offset and the end (lag in records).
"""

from __future__ import annotations

import time
from array import array
from bisect import bisect_left
from dataclasses import dataclass, field

from confluent_kafka import KafkaError, TopicPartition

from astraflow.config import KafkaSettings
from astraflow.kafka.clients import reader
from astraflow.kafka.offsets import TP
from astraflow.kafka.topics import reader_group


@dataclass
class _Seen:
    """The committed records of one partition read so far."""

    read_to: int = 0  # next offset to read
    offsets: array = field(default_factory=lambda: array("q"))  # offset of each record, increasing
    stamps: array = field(default_factory=lambda: array("q"))  # its timestamp (ms)

    def trim(self, low: int) -> None:
        """Forgets records below `low` (deleted by retention)."""
        cut = bisect_left(self.offsets, low)
        if cut:
            del self.offsets[:cut]
            del self.stamps[:cut]
        self.read_to = max(self.read_to, low)


class RecordCounter:
    """Counts committed records per partition, incrementally (see the module doc)."""

    def __init__(self, kafka: KafkaSettings, budget_s: float = 30.0) -> None:
        self.kafka = kafka
        self.budget_s = budget_s  # most seconds one `update` reads; what is left is read next time
        self._seen: dict[TP, _Seen] = {}
        self._consumer = None

    def _reader(self):
        if self._consumer is None:
            # assign() only: never joins a group, never commits
            self._consumer = reader(self.kafka, reader_group("status"), 1 << 20, **{
                "enable.partition.eof": True, "fetch.max.bytes": 64 << 20})
        return self._consumer

    def update(self, bounds: dict[TP, tuple[int, int]]) -> None:
        """Reads each partition from where the last call stopped to its `(low, high)` watermarks."""
        todo: dict[TP, int] = {}
        for tp, (low, high) in bounds.items():
            seen = self._seen.setdefault(tp, _Seen(read_to=low))
            if low > seen.read_to or (seen.offsets and low > seen.offsets[0]):
                seen.trim(low)
            if high < seen.read_to:  # the topic was deleted and made again: start over
                seen = self._seen[tp] = _Seen(read_to=low)
            if seen.read_to < high:
                todo[tp] = high
        for tp in [tp for tp in self._seen if tp not in bounds]:
            del self._seen[tp]
        if todo:
            self._read(todo)

    def _read(self, todo: dict[TP, int]) -> None:
        consumer = self._reader()
        consumer.assign([TopicPartition(t, p, self._seen[(t, p)].read_to) for t, p in todo])
        pending = set(todo)
        deadline = time.monotonic() + self.budget_s
        try:
            while pending and time.monotonic() < deadline:
                for msg in consumer.consume(5000, 0.2):
                    tp = (msg.topic(), msg.partition())
                    if tp not in pending:
                        continue
                    seen = self._seen[tp]
                    err = msg.error()
                    if err is not None:
                        if err.code() == KafkaError._PARTITION_EOF:
                            # end of what is committed: what follows is in an open transaction (read later)
                            seen.read_to = max(seen.read_to, msg.offset())
                        # any other error (not allowed to read it, say): left unread, counted by
                        # offsets as an upper bound (`behind`)
                        pending.discard(tp)
                        continue
                    off = msg.offset()
                    if off >= todo[tp]:
                        pending.discard(tp)
                        continue
                    if off >= seen.read_to:
                        seen.offsets.append(off)
                        seen.stamps.append(msg.timestamp()[1])
                        seen.read_to = off + 1
                    if off >= todo[tp] - 1:
                        pending.discard(tp)
        finally:
            consumer.unassign()

    def records(self, tp: TP) -> int:
        """Committed records of `tp` read so far."""
        seen = self._seen.get(tp)
        return len(seen.offsets) if seen else 0

    def behind(self, tp: TP, high: int) -> int:
        """Offsets of `tp` below `high` not read yet (0 once a count is exact)."""
        seen = self._seen.get(tp)
        return max(0, high - seen.read_to) if seen else high

    def since(self, tp: TP, ts_ms: int) -> int:
        """Records of `tp` whose timestamp is at or after `ts_ms` (timestamps are taken as
        increasing within a partition, as the producers write them)."""
        seen = self._seen.get(tp)
        if not seen:
            return 0
        n, stamps = 0, seen.stamps
        for i in range(len(stamps) - 1, -1, -1):
            if stamps[i] < ts_ms:
                break
            n += 1
        return n

    def from_offset(self, tp: TP, offset: int) -> int:
        """Records of `tp` at or after `offset` (a group's lag from its committed offset)."""
        seen = self._seen.get(tp)
        if not seen:
            return 0
        return len(seen.offsets) - bisect_left(seen.offsets, offset)

    def start_of_last(self, tp: TP, n: int, high: int) -> int:
        """The offset where the last `n` records of `tp` before `high` begin (offsets when not read)."""
        seen = self._seen.get(tp)
        if not seen or seen.read_to < high:
            return high - n
        end = bisect_left(seen.offsets, high)
        return seen.offsets[end - n] if end >= n else (seen.offsets[0] if end else high)

    def after(self, tp: TP, start: int, high: int) -> int:
        """Records of `tp` in [start, high): those read, plus any offsets not read yet (an upper
        bound for those)."""
        seen = self._seen.get(tp)
        if not seen:
            return max(0, high - start)
        return self.from_offset(tp, start) + max(0, high - max(seen.read_to, start))

    def close(self) -> None:
        if self._consumer is not None:
            self._consumer.close()
            self._consumer = None


def count_records(kafka: KafkaSettings, bounds: dict[TP, tuple[int, int]], budget_s: float = 60.0) -> dict[TP, int]:
    """Committed records in each partition's `(low, high)` offsets, read once."""
    counter = RecordCounter(kafka, budget_s)
    try:
        counter.update(bounds)
        return {tp: counter.records(tp) for tp in bounds}
    finally:
        counter.close()

