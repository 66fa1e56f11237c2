"""The app interface: what a stream app implements (`AppHandler`) and what it is handed (a
`astraflow.kafka.received.Received`, its `record` decoded).

An app is a handler object that `stream_apps.engine.StreamEngine` wires into a Faust app; it
never touches Kafka clients itself. It sends outputs, counts drops and dead-letters through the
engine it is bound to (everything it sends while handling a record joins that record's
transaction), keeps state in the engine's tables, and raises `StrategyFailed` to say which
strategy failed on a record (the DLQ entry then names it).
"""

from __future__ import annotations

from collections.abc import Awaitable
from typing import TYPE_CHECKING, Any

from astraflow.errors import AstraflowError
from astraflow.kafka.received import Received

if TYPE_CHECKING:
    from stream_apps.engine import StreamEngine


class StrategyFailed(AstraflowError):
    """Raised by an app when a strategy raised on a record; the DLQ entry names the strategy."""

    def __init__(self, strategy: str, cause: BaseException | str, detail: str | None = None) -> None:
        self.strategy = strategy
        self.cause = cause
        self.detail = detail  # more for the dead letter's `error` (a user processor's traceback)
        super().__init__(f"{strategy}: {type(cause).__name__ + ': ' if isinstance(cause, BaseException) else ''}{cause}")


class AppHandler:
    """What an app implements; the defaults do nothing. `worker` is set by `bind`."""

    name: str = "app"  # component name: consumer group suffix, metrics component, DLQ component
    expect: type | None = None  # record class of the input (others are dead-lettered); None = any
    sources: tuple[str, ...] = ()  # stream name read (at most one; empty: a source app driven by `tick`)
    tick_interval_s: float = 0.5  # how often `tick` runs
    tables: tuple[str, ...] = ()  # Faust tables (bytes -> bytes, changelog-backed) the app keeps state in
    metric_labels: dict[str, str] = {}  # labels on every metric of the app (a processor's source and sink)
    worker: StreamEngine

    def bind(self, worker: StreamEngine) -> None:
        """Called once the app started, before the first record: build slots, open readers, check topics."""
        self.worker = worker

    def decode(self, inc: Received[Any]) -> Any:
        """The record of `inc` for `handle` (a SerdeError sends it to the DLQ): by default the typed
        record its bytes hold, of class `expect`."""
        return self.worker.serde.loads(inc.value, self.expect)  # type: ignore[arg-type]

    def handle(self, inc: Received[Any]) -> Awaitable[None] | None:
        """Handles one record: send outputs through the worker; may return an awaitable (runs concurrently)."""
        raise NotImplementedError

    def tick(self, now: float) -> Awaitable[None] | None:
        """Periodic work (timeouts, source apps' production); may return an awaitable."""

    def on_recovered(self, table: str) -> None:
        """Faust recovered table `table` after a start or a rebalance (its content is complete now)."""

    def on_revoke(self, partitions: set[int]) -> None:
        """Partitions of the source are leaving this worker: drop what is kept for them."""

    def gauges(self) -> dict[str, float]:
        """App-specific values for the metrics topic."""
        return {}

    def close(self) -> None:
        """The worker stops: release resources."""
