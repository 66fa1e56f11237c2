"""`@astraflow.processor`: turn a plain function into a stream processor over an experiment's topics.

    import astraflow
    from astraflow.records import Trajectory

    @astraflow.processor(source="scored", sink="long-answers")
    def long_answers(t: Trajectory) -> Trajectory | None:
        return t if t.num_tokens > 2048 else None

    $ astraflow process run my_module:long_answers --experiment EXP

The function gets one decoded record (the typed class of its schema) and returns a record, a
list of records, `None` to drop it, or `Emit(...)` to choose the key or topic of an output.
It may be `async def` (then up to `concurrency` calls run at once, order not kept). The runner
(`stream_apps.process`, a Faust app per worker) gives it decoding, the DLQ (undecodable input,
or the function raised: the dead letter names the processor), metrics, exactly-once delivery
(its outputs and the input's offset commit in one Kafka transaction) and scaling: every worker
started with the same processor joins one consumer group and takes a share of the source's
partitions.

This module stays import-light (no Kafka client, no stream framework): decorating costs
nothing. The module object is callable and forwards to `processor()`, so `astraflow.processor`
is the decorator whether Python resolved it to this function or to the submodule itself
(importing a submodule rebinds the package attribute of the same name).
"""

from __future__ import annotations

import importlib
import inspect
import re
import sys
import types
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from astraflow.errors import ConfigError

_NAME = re.compile(r"^[A-Za-z0-9_.-]{1,120}$")
COMPONENT_PREFIX = "proc."  # a processor's component (metrics, dead letters, consumer group): proc.<name>


def component_of(name: str) -> str:
    """The component a processor named `name` reports as (metrics) and dead-letters as (DLQ)."""
    return f"{COMPONENT_PREFIX}{name}"


@dataclass(frozen=True, slots=True)
class Emit:
    """An output with an explicit key and/or topic (default: the input's key, the processor's sink)."""

    record: Any  # a typed record (astraflow.records)
    key: str | bytes | None = None  # None keeps the input record's key
    topic: str | None = None  # a stream name (`my-topic` -> af.<experiment>.my-topic) or a full topic name


@dataclass(frozen=True)
class Processor:
    """A function wired to a source stream and an optional sink stream."""

    fn: Callable[..., Any]  # record -> record | list | None | Emit (sync or async)
    source: str  # stream name (`rollouts`, `scored`, `solver.train`) or full topic name
    sink: str | None  # stream name or full topic name; None: outputs must use Emit(topic=...)
    name: str  # consumer group suffix, metrics component, DLQ strategy name
    version: int = 1  # bump when behaviour changes; recorded in outputs' lineage
    expect: type | None = None  # record class the source must hold (others go to the DLQ); None = any
    concurrency: int = 16  # async calls in flight at once (sync functions run one at a time)
    options: dict[str, Any] = field(default_factory=dict)  # free-form, for the function's own use

    @property
    def is_async(self) -> bool:
        return inspect.iscoroutinefunction(self.fn)

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        return self.fn(*args, **kwargs)


def processor(
    *,
    source: str,
    sink: str | None = None,
    name: str | None = None,
    version: int = 1,
    expect: type | None = None,
    concurrency: int = 16,
    **options: Any,
) -> Callable[[Callable[..., Any]], Processor]:
    """Decorator: makes `fn` a `Processor` reading `source` and writing `sink` (see the module doc)."""
    if concurrency < 1:
        raise ConfigError(f"processor concurrency must be >= 1, got {concurrency}")
    if version < 1:
        raise ConfigError(f"processor version must be >= 1, got {version}")

    def decorate(fn: Callable[..., Any]) -> Processor:
        pname = name or fn.__name__.replace("_", "-")
        if not _NAME.match(pname):
            raise ConfigError(f"processor name {pname!r} may only use letters, digits, '.', '_' and '-'")
        return Processor(fn, source, sink, pname, version, expect, concurrency, dict(options))

    return decorate


def load_processor(spec: str) -> Processor:
    """Imports `module:attribute` (or `module.attribute`) and returns the Processor it names."""
    module_name, sep, attr = spec.partition(":")
    if not sep:
        module_name, _, attr = spec.rpartition(".")
    if not module_name or not attr:
        raise ConfigError(f"processor {spec!r} must look like my_module:my_function")
    try:
        module = importlib.import_module(module_name)
    except ImportError as exc:
        raise ConfigError(f"cannot import {module_name!r} for processor {spec!r}: {exc}; is it on PYTHONPATH?") from exc
    obj: Any = module
    for part in attr.split("."):
        try:
            obj = getattr(obj, part)
        except AttributeError:
            raise ConfigError(f"module {module_name!r} has no attribute {attr!r}") from None
    if not isinstance(obj, Processor):
        raise ConfigError(
            f"{spec} is a {type(obj).__name__}, not a processor; decorate it with "
            "@astraflow.processor(source=..., sink=...)"
        )
    return obj


class _CallableModule(types.ModuleType):
    """This module's type: calling the module calls `processor()` (see the module doc)."""

    def __call__(self, *args: Any, **kwargs: Any) -> Callable[[Callable[..., Any]], Processor]:
        return processor(*args, **kwargs)


sys.modules[__name__].__class__ = _CallableModule
