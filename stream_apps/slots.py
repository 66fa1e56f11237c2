"""Strategy slots: the strategy the control topic selects for one slot of one app, built once.

A slot (`reward`, `advantage`, `filter.staleness`, `curator`, ...) has a kind (which registry
section its strategies come from) and a default. `Slot.get()` returns the configured
`Strategy`, rebuilding it only when the slot's control record changed, so reading it per
record costs an integer comparison. The strategy names `none`, `off` and `disabled` switch an
optional slot off (`get()` returns None).

A control record that cannot be built (unknown name, bad parameters) is rejected: the slot
keeps its previous strategy, logs the reason and counts it in `rejected` (the CLI validates
before writing, so this only happens with hand-written records or a plug-in missing on a
worker).
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from typing import Any

from astraflow.control import ControlReader
from astraflow.dataflow.registry import REGISTRY, Strategy, StrategyRegistry, parse_params
from astraflow.errors import ConfigError
from astraflow.records import Control, StrategyRef

log = logging.getLogger("astraflow.stream.slots")

DISABLED = frozenset({"none", "off", "disabled"})


@dataclass(frozen=True)
class SlotDefault:
    """What a slot uses while the control topic says nothing about it."""

    strategy: str  # registered name, or one of DISABLED
    params: dict[str, Any] = field(default_factory=dict)  # keyword params (already typed)


def parse_default(text: str) -> tuple[str, SlotDefault]:
    """`slot=name` or `slot=name:{"json": "params"}` (the CLI's --default) -> (slot, SlotDefault)."""
    import json

    slot, sep, rest = text.partition("=")
    if not sep or not slot or not rest:
        raise ConfigError(f"--default {text!r} must look like slot=strategy or slot=strategy:{{json params}}")
    name, _, params = rest.partition(":")
    try:
        decoded = json.loads(params) if params else {}
    except json.JSONDecodeError as exc:
        raise ConfigError(f"--default {text!r}: params after ':' must be a JSON object ({exc})") from exc
    if not isinstance(decoded, dict):
        raise ConfigError(f"--default {text!r}: params after ':' must be a JSON object")
    return slot.strip(), SlotDefault(name.strip(), decoded)


def build_strategy(kind: str, name: str, params: dict[str, Any], registry: StrategyRegistry = REGISTRY) -> Strategy[Any] | None:
    """The strategy `name` of `kind` with `params`, or None for a disabled slot (raises StrategyError)."""
    if name.lower() in DISABLED:
        return None
    return registry.get(kind, name, **params)


class Slot:
    """One strategy slot of one app, following the control topic."""

    def __init__(
        self,
        control: ControlReader | None,
        app: str,
        slot: str,
        kind: str,
        default: SlotDefault,
        *,
        optional: bool = False,
        registry: StrategyRegistry = REGISTRY,
    ) -> None:
        if default.strategy.lower() in DISABLED and not optional:
            raise ConfigError(f"slot {app}/{slot} cannot be disabled; give a {kind} strategy")
        self.control = control
        self.app = app
        self.slot = slot
        self.kind = kind
        self.optional = optional
        self.registry = registry
        self.rejected = 0  # control records that could not be built
        self.source: Control | None = None  # the control record the current strategy came from (None: default)
        self._generation = -1
        self._seen: Control | None = None  # the latest control record looked at (applied or rejected)
        self._strategy = build_strategy(kind, default.strategy, dict(default.params), registry)
        self._default = self._strategy

    def get(self) -> Strategy[Any] | None:
        """The strategy to apply now (None when this optional slot is switched off)."""
        if self.control is not None and self.control.generation != self._generation:
            self._generation = self.control.generation
            self._follow(self.control.get_for(self.app, self.slot))
        return self._strategy

    def ref(self) -> StrategyRef | None:
        s = self.get()
        return None if s is None else s.ref(self.app, self.slot)

    @property
    def version(self) -> int:
        """The control version in force (0: the default)."""
        return self.source.version if self.source is not None else 0

    def _follow(self, control: Control | None) -> None:
        if control is self._seen or (control is not None and control == self._seen):
            return
        self._seen = control
        if control is None:
            self._strategy, self.source = self._default, None
            log.info("%s/%s back to its default: %s", self.app, self.slot, _describe(self._strategy))
            return
        if control.strategy.lower() in DISABLED and not self.optional:
            self._reject(control, f"slot {self.slot} cannot be disabled")
            return
        try:
            strategy = build_strategy(self.kind, control.strategy, parse_params(control.params), self.registry)
        except Exception as exc:  # any plug-in factory may raise anything: keep the previous strategy
            self._reject(control, f"{type(exc).__name__}: {exc}")
            return
        self._strategy, self.source = strategy, control
        log.info("%s/%s -> %s (control version %d)", self.app, self.slot, _describe(strategy), control.version)

    def _reject(self, control: Control, why: str) -> None:
        self.rejected += 1
        log.error(
            "%s/%s: control version %d (%s) rejected, keeping %s: %s",
            self.app, self.slot, control.version, control.strategy, _describe(self._strategy), why,
        )


def _describe(strategy: Strategy[Any] | None) -> str:
    if strategy is None:
        return "off"
    params = ", ".join(f"{k}={v!r}" for k, v in strategy.params.items())
    return f"{strategy.name} v{strategy.version}" + (f" ({params})" if params else "")
