"""Which offset each partition may commit, when records finish out of order or are held.

A stream app commits a record's offset in the transaction that holds its outputs
(`stream_apps.engine`), but records do not finish in the order they arrive: slow rewards and
async user processors run concurrently. `OffsetTracker` keeps, per partition, the offsets received
and not yet finished; the committable offset is the smallest of those (everything below it
is finished), or one past the highest offset seen when none is pending. Offsets may have gaps
(compaction, transaction markers): only offsets actually received count.
"""

from __future__ import annotations

import heapq
from dataclasses import dataclass, field

TP = tuple[str, int]  # (topic, partition)


@dataclass
class _PartitionState:
    pending: set[int] = field(default_factory=set)  # received, not finished
    heap: list[int] = field(default_factory=list)  # pending offsets (lazy deletion)
    highest: int = -1  # highest offset received
    committed: int = -1  # last offset handed to commit (the next offset to read)
    epoch: int = 0  # which assignment of the partition this state belongs to
    seen: set[int] = field(default_factory=set)  # received, not below `committed` (read twice: skip)


class OffsetTracker:
    """Pending offsets per partition; what is safe to commit (pure, no Kafka)."""

    def __init__(self) -> None:
        self._parts: dict[TP, _PartitionState] = {}
        self._epochs = 0

    def received(self, tp: TP, offset: int) -> int:
        """A record was taken from the consumer; returns the epoch to hand back to `finished`."""
        st = self._parts.get(tp)
        if st is None:
            self._epochs += 1
            st = self._parts[tp] = _PartitionState(epoch=self._epochs)
        st.pending.add(offset)
        st.seen.add(offset)
        heapq.heappush(st.heap, offset)
        st.highest = max(st.highest, offset)
        return st.epoch

    def finished(self, tp: TP, offset: int, epoch: int) -> None:
        """The record's outputs are queued (or it was dropped or dead-lettered).

        A record of an earlier assignment of the partition (revoked, then assigned again while
        it was still being processed) is ignored: the new assignment reads it again.
        """
        st = self._parts.get(tp)
        if st is not None and st.epoch == epoch:
            st.pending.discard(offset)

    def committable(self, tp: TP) -> int | None:
        """The offset to commit for `tp` (next to read), or None if nothing was received."""
        st = self._parts.get(tp)
        if st is None or st.highest < 0:
            return None
        while st.heap and st.heap[0] not in st.pending:
            heapq.heappop(st.heap)
        return st.heap[0] if st.heap else st.highest + 1

    def to_commit(self, tps: set[TP] | None = None) -> dict[TP, int]:
        """Offsets that advanced since the last `mark_committed`, per partition."""
        out = {}
        for tp in list(self._parts) if tps is None else [t for t in tps if t in self._parts]:
            off = self.committable(tp)
            if off is not None and off > self._parts[tp].committed:
                out[tp] = off
        return out

    def mark_committed(self, offsets: dict[TP, int]) -> None:
        for tp, off in offsets.items():
            st = self._parts.get(tp)
            if st is not None:
                st.committed = max(st.committed, off)
                st.seen = {o for o in st.seen if o >= st.committed}

    def redelivered(self, tp: TP, offset: int) -> bool:
        """True if this assignment of `tp` already received `offset` (Faust handed it over again)."""
        st = self._parts.get(tp)
        return st is not None and (offset < st.committed or offset in st.seen)

    def pending(self, tp: TP | None = None) -> int:
        """Records received and not finished (for one partition or all)."""
        if tp is not None:
            st = self._parts.get(tp)
            return len(st.pending) if st else 0
        return sum(len(st.pending) for st in self._parts.values())

    def forget(self, tps: set[TP]) -> None:
        """Partitions were revoked or lost: stop tracking them (late finishes are ignored)."""
        for tp in tps:
            self._parts.pop(tp, None)

    def owns(self, tp: TP) -> bool:
        return tp in self._parts

    def committed(self, tp: TP) -> int | None:
        """The offset last handed to commit for `tp` (-1: none yet; None: `tp` is not tracked)."""
        st = self._parts.get(tp)
        return None if st is None else st.committed

    def epoch(self, tp: TP) -> int | None:
        """Which assignment of `tp` is tracked now (None: none); `received` returns it per record."""
        st = self._parts.get(tp)
        return None if st is None else st.epoch
