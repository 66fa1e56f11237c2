"""The seam between the Faust layer and the exactly-once engine: what one may ask of the other.

`stream_apps.faust_app` (the app, its agent and timers), `stream_apps.transactions` (Faust's
transaction manager, subclassed) and `stream_apps.faust_worker` (the Faust-native entry) talk to
the engine (`stream_apps.engine.StreamEngine`) only through `EngineApi`; the engine's
underscored members are its own. A change to how the engine batches, orders or commits stays
inside `engine.py` as long as these keep their meaning.
"""

from __future__ import annotations

import asyncio
import threading
from typing import TYPE_CHECKING, Any, Protocol

if TYPE_CHECKING:
    from astraflow.config import KafkaSettings
    from astraflow.kafka.offsets import OffsetTracker
    from astraflow.serde import AvroSerde
    from stream_apps.handler import AppHandler
    from stream_apps.takeover import Takeover


class EngineApi(Protocol):
    """What the Faust layer uses of a stream engine."""

    handler: AppHandler  # the app's handler: its name, tables and tick interval
    settings: Any  # EngineSettings: intervals, guarantee, compression, topic settings
    kafka: KafkaSettings
    serde: AvroSerde
    group_id: str  # the Faust app id and consumer group
    source: str | None  # the one source topic (None: an app without input, e.g. the curator)
    tables: dict[str, Any]  # name -> the Faust table declared for it
    tracker: OffsetTracker  # per source partition: which offsets finished, what may commit
    takeover: Takeover  # which records an agent holds back or skips around a rebalance
    started: threading.Event  # set once the app runs and the control topic was read

    def tid(self, partition: int) -> str:
        """Transactional id of the producer of a source partition."""

    def gate(self, partition: int) -> asyncio.Lock:
        """The lock that orders a source partition's records, sends and commits; hold it to commit."""

    async def flush_partition(self, partition: int) -> None:
        """Hands the outputs kept for the partition's transaction to its producer (gate held):
        before every commit of the partition, so the offsets never commit without their outputs."""

    def forget_unsent(self, partition: int) -> None:
        """Drops what was kept for a transaction that will not commit (its producer is gone)."""

    def changelog(self, table: Any, key: bytes, value: bytes | None) -> None:
        """A table write, into the current record's (or partition's) transaction."""

    def crash(self, exc: BaseException) -> None:
        """Ends the Faust app with `exc` (the engine rebuilds it; uncommitted records are read again)."""

    async def handle_event(self, event: Any) -> None:
        """One record from the agent's stream: decode, handle, keep its outputs, ack once they are in."""

    def on_revoked(self, partitions: set[int]) -> None:
        """Source partitions were revoked: forget their state."""

    def bind(self) -> None:
        """Reads the control topic and binds the handler (once per engine)."""

    def refresh_control(self) -> None:
        """The control timer: re-reads strategy choices."""

    async def tick(self) -> None:
        """The tick timer: the handler's periodic work."""

    async def commit(self) -> None:
        """The commit timer: commits partitions that produced or finished records."""

    async def publish_metrics(self) -> None:
        """The metrics timer: the worker's metrics to the metrics topic (and its observers)."""
