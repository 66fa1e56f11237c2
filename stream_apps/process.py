"""Runs a user processor (`@astraflow.processor`) as a Faust stream worker (`stream_apps.engine`).

    astraflow process run my_module:my_function --experiment EXP

The consumer group is `af.<experiment>.proc.<name>`: start the same command several times and
the workers split the source's partitions. The sink topic is created (as many partitions as
the source, delete policy) if it does not exist. What the function returns:

* a record -> one output to the sink, keyed like the input;
* a list (or tuple) -> one output per item; an empty list drops the input;
* `None` -> the input is dropped (counted in `dropped_total{reason="<name>"}`);
* `Emit(record, key=..., topic=...)` -> that key and/or topic (a stream name or a full name).

An exception raised by the function dead-letters the input with the processor's name as the
strategy. Outputs that have a `lineage` list get `StrategyRef(<name>, "process", <qualified
function name>, <version>)` appended.
"""

from __future__ import annotations

import inspect
from collections.abc import Awaitable
from typing import Any

from astraflow.errors import ConfigError
from astraflow.kafka.received import Received
from astraflow.processor import Emit, Processor
from astraflow.records import StrategyRef
from stream_apps.handler import AppHandler, StrategyFailed


class ProcessorApp(AppHandler):
    """Wraps one `Processor` (see the module doc)."""

    def __init__(self, proc: Processor) -> None:
        self.proc = proc
        self.name = f"proc.{proc.name}"
        self.expect = proc.expect
        self.sources = (proc.source,)
        self.ref = StrategyRef(proc.name, "process", f"{proc.fn.__module__}.{proc.fn.__qualname__}", proc.version)

    def bind(self, worker: Any) -> None:
        super().bind(worker)
        self.sink = worker.topics.stream(self.proc.sink) if self.proc.sink else None
        if self.sink is not None:
            self._ensure_topic(self.sink, worker.topics.stream(self.proc.source))

    def _ensure_topic(self, topic: str, like: str) -> None:
        from astraflow.kafka.topics import TopicAdmin, TopicSpec

        admin = TopicAdmin(self.worker.kafka)
        existing = admin.list(topic)
        if topic in existing:
            return
        source = admin.list(like).get(like)
        if source is None:
            raise ConfigError(f"source topic {like} does not exist; create the experiment's topics with `astraflow topics create`")
        admin.create([TopicSpec(topic, source, {"cleanup.policy": "delete"})])

    def handle(self, inc: Received[Any]) -> Awaitable[None] | None:
        if self.proc.is_async:
            return self._call_async(inc)
        try:
            result = self.proc.fn(inc.record)
        except Exception as exc:  # user code: any exception dead-letters the record, by processor name
            raise StrategyFailed(self.proc.name, exc) from exc
        if inspect.isawaitable(result):  # a sync function that returned a coroutine
            return self._finish_async(inc, result)
        self._emit(inc, result)
        return None

    async def _call_async(self, inc: Received[Any]) -> None:
        await self._finish_async(inc, self.proc.fn(inc.record))

    async def _finish_async(self, inc: Received[Any], awaitable: Awaitable[Any]) -> None:
        try:
            result = await awaitable
        except Exception as exc:
            raise StrategyFailed(self.proc.name, exc) from exc
        self._emit(inc, result)

    def _emit(self, inc: Received[Any], result: Any) -> None:
        items = list(result) if isinstance(result, list | tuple) else ([] if result is None else [result])
        if not items:
            self.worker.drop(self.proc.name)
            return
        for item in items:
            emit = item if isinstance(item, Emit) else Emit(item)
            topic = self.worker.topics.stream(emit.topic) if emit.topic else self.sink
            if topic is None:
                raise StrategyFailed(self.proc.name, "returned a record but the processor has no sink; use Emit(record, topic=...)")
            record = emit.record
            if not hasattr(record, "SCHEMA"):
                raise StrategyFailed(self.proc.name, f"returned a {type(record).__name__}, not an astraflow record")
            lineage = getattr(record, "lineage", None)
            if isinstance(lineage, list) and self.ref not in lineage:
                lineage.append(self.ref)
            self.worker.send(topic, record, emit.key if emit.key is not None else inc.key)
