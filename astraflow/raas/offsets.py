"""Per-partition commit points for work that finishes out of order.

Tasks of one partition can finish in any order, but Kafka commits one position per partition:
offset N+1 may only be committed once every offset <= N is done. `OffsetTracker` keeps the
outstanding offsets and says how far each partition can safely be committed.
"""

from __future__ import annotations

import heapq


class OffsetTracker:
    """Tracks started and finished offsets; `committable()` gives the safe position per partition."""

    def __init__(self) -> None:
        self._pending: dict[tuple[str, int], list[int]] = {}  # min-heap of started, unfinished offsets
        self._done: dict[tuple[str, int], set[int]] = {}
        self._high: dict[tuple[str, int], int] = {}  # highest offset started
        self._committed: dict[tuple[str, int], int] = {}

    def start(self, topic: str, partition: int, offset: int) -> None:
        key = (topic, partition)
        heapq.heappush(self._pending.setdefault(key, []), offset)
        self._high[key] = max(self._high.get(key, -1), offset)

    def finish(self, topic: str, partition: int, offset: int) -> None:
        self._done.setdefault((topic, partition), set()).add(offset)

    def committable(self) -> dict[tuple[str, int], int]:
        """Partition -> next offset to commit, for partitions whose position advanced."""
        out = {}
        for key, heap in self._pending.items():
            done = self._done.get(key, set())
            while heap and heap[0] in done:
                done.discard(heapq.heappop(heap))
            position = heap[0] if heap else self._high[key] + 1
            if position > self._committed.get(key, -1):
                out[key] = position
        return out

    def mark_committed(self, positions: dict[tuple[str, int], int]) -> None:
        self._committed.update(positions)

    def forget(self, topic: str, partition: int) -> None:
        """Drops a revoked partition: its unfinished work will be redelivered elsewhere."""
        key = (topic, partition)
        for d in (self._pending, self._done, self._high, self._committed):
            d.pop(key, None)

    @property
    def outstanding(self) -> int:
        return sum(len(h) for h in self._pending.values())
