"""The app interface: what a stream app implements (`AppHandler`) and what it is handed (`Incoming`).

An app is a handler object run by a `stream_apps.runtime.StreamWorker`; it never touches Kafka
clients itself. It sends outputs, holds and releases records, counts drops and dead-letters
through the worker it is bound to, and raises `StrategyFailed` to say which strategy failed on
a record (the DLQ entry then names it).
"""

from __future__ import annotations

from collections.abc import Awaitable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from astraflow.errors import AstraflowError
from astraflow.kafka.offsets import TP

if TYPE_CHECKING:
    from confluent_kafka import Message

    from stream_apps.runtime import StreamWorker


class StrategyFailed(AstraflowError):
    """Raised by an app when a strategy raised on a record; the DLQ entry names the strategy."""

    def __init__(self, strategy: str, cause: BaseException | str) -> None:
        self.strategy = strategy
        self.cause = cause
        super().__init__(f"{strategy}: {type(cause).__name__ + ': ' if isinstance(cause, BaseException) else ''}{cause}")


@dataclass(slots=True, eq=False)
class Incoming:
    """A decoded input record with where it came from."""

    record: Any  # the typed record (astraflow.records)
    topic: str
    partition: int
    offset: int
    key: bytes | None
    timestamp_ms: int
    message: Message  # the raw message, kept for dead-lettering the original bytes
    epoch: int  # assignment epoch of its partition (OffsetTracker)
    held: bool = False  # the handler keeps it unfinished until `release`

    @property
    def tp(self) -> TP:
        return (self.topic, self.partition)

    @property
    def key_str(self) -> str | None:
        return self.key.decode(errors="replace") if isinstance(self.key, bytes) else self.key


class AppHandler:
    """What an app implements; the defaults do nothing. `worker` is set by `bind`."""

    name: str = "app"  # component name: consumer group suffix, metrics component, DLQ component
    expect: type | None = None  # record class of the input (others are dead-lettered); None = any
    sources: tuple[str, ...] = ()  # stream names read (empty: a source app driven by `tick`)
    tick_interval_s: float = 0.5  # how often `tick` runs
    worker: StreamWorker

    def bind(self, worker: StreamWorker) -> None:
        """Called once before the first record: build slots, open readers, check topics."""
        self.worker = worker

    def handle(self, inc: Incoming) -> Awaitable[None] | None:
        """Handles one record: send outputs through the worker; may return an awaitable."""
        raise NotImplementedError

    def tick(self, now: float) -> None:
        """Periodic work (timeouts, source apps' production)."""

    def on_revoke(self, tps: set[TP]) -> None:
        """Partitions are leaving this worker: drop state kept for them (it is re-read elsewhere)."""

    def gauges(self) -> dict[str, float]:
        """App-specific values for the metrics topic."""
        return {}

    def close(self) -> None:
        """The worker stops: release resources (pending state is simply not committed)."""
