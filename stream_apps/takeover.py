"""Which records an exactly-once agent must not handle around a rebalance (issue 13's race).

After every assignment Faust recovers the app's tables from their changelogs, and it hands
the agent records of the source partitions meanwhile: those it fetched between the
assignment and the pause of the source partitions (`faust.app.base._on_partitions_assigned`
pauses them only after awaiting the agents and the subscriptions) wait in the agent's queue,
and the recovery resumes the flow to read the changelogs. A record handled then reads tables
that are not recovered yet, and the recovery then applies older changelog records of the same
keys over what it wrote; once its offset commits nobody reads it again (samples lost, groups
split). At the end of the recovery Faust seeks every source partition back to its committed
offset (`Recovery.on_recovery_completed` -> `Consumer.perform_seek`), so each of those records
comes again.

`Takeover` decides, per record, before the agent takes it:

* **held back** while the tables of the current rebalance are not recovered: not handled, not
  tracked, not committed; the seek hands it over again. Once a partition held a record back,
  every later record of that partition is held back too, until a record at or below the first
  one held back arrives (the seek's re-read): handling a later one first would let its offset
  commit past records not handled yet.
* **redelivered**: a record this assignment already took (its offset was received, or is below
  what it committed), e.g. one handled after the recovery and read again after the seek, or
  one of an app without tables handled before Faust's seek: skipped, its outputs are already in
  the transaction.

Only exactly-once apps do this: at-least-once keeps Faust's own acks and commits (a record
skipped there would be acked, and committed, without being handled).
"""

from __future__ import annotations

import logging
from typing import Any

from astraflow.kafka.offsets import OffsetTracker

log = logging.getLogger("astraflow.stream.takeover")


class Takeover:
    """Holds records back while tables recover, and skips records read twice (see the module doc)."""

    def __init__(self, tracker: OffsetTracker, has_tables: bool) -> None:
        self.tracker = tracker
        self.has_tables = has_tables
        self._assigned_at = -1  # Faust's rebalance count when the tables were last assigned
        self._ready_at = -1  # the rebalance count whose recovery completed
        self._held_from: dict[tuple[str, int], int] = {}  # partition -> first offset held back
        self.held_back = 0  # records held back (counts, for the logs and tests)
        self.redelivered = 0  # records skipped as read twice

    def tables_assigned(self, rebalance: int) -> None:
        """The tables got the assignment of rebalance number `rebalance` (their recovery starts)."""
        self._assigned_at = rebalance

    def tables_recovered(self, rebalance: int) -> None:
        """The recovery started at `tables_assigned` completed, if no rebalance began since."""
        if self._assigned_at == rebalance:
            self._ready_at = rebalance

    def recovering(self, rebalance: int) -> bool:
        """True while the tables of rebalance number `rebalance` (Faust's count now) are not recovered."""
        return self.has_tables and self._ready_at != rebalance

    def skip(self, topic: str, partition: int, offset: int, rebalance: int) -> bool:
        """True when the agent must not handle this record now (held back or redelivered)."""
        tp = (topic, partition)
        if self.tracker.redelivered(tp, offset):
            self.redelivered += 1
            return True
        first = self._held_from.get(tp)
        if self.recovering(rebalance):
            if first is None:
                log.info("%s[%d]@%d: held back while the tables recover; read again after the recovery", topic,
                         partition, offset)
            self._held_from[tp] = offset if first is None else min(first, offset)
            self.held_back += 1
            return True
        if first is not None:
            if offset > first:
                self.held_back += 1
                return True
            del self._held_from[tp]  # the re-read after the recovery's seek: from here in order
            log.info("%s[%d]@%d: read again after the recovery; handled from here", topic, partition, offset)
        return False

    def forget(self, tps: Any) -> None:
        """Partitions revoked: whatever was held back is read again by their next owner."""
        for tp in tps:
            self._held_from.pop(tp, None)
