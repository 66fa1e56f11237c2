"""Registry of data strategies: rewards, filters, advantage estimators and curators, by kind and name.

A strategy is registered as a factory (a function or class) that takes its parameters as keyword
arguments and returns the configured callable:

    @register("reward", "exact_match", version=1)
    def exact_match(*, normalize: bool = True) -> ExactMatch: ...

    reward = get("reward", "exact_match", normalize=False)   # a Strategy
    reward(trajectory)                                       # calls the configured object
    reward.ref("reward", "score")                            # StrategyRef for lineage

Stream apps pick strategies from Control records (`from_control`), whose params are strings;
values that parse as JSON are decoded (`"0.5"` -> 0.5, `'{"a": 1}'` -> dict).

Third-party packages add strategies through the entry-point group `astraflow.strategies`: each
entry point names a module (or object) whose import registers them. Entry points are loaded
lazily, the first time a lookup misses or the known names are listed.
"""

from __future__ import annotations

import importlib
import inspect
import json
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from importlib.metadata import entry_points
from typing import Any, Generic, TypeVar

from astraflow.errors import StrategyError, UnknownStrategyError
from astraflow.records import Control, StrategyRef

T = TypeVar("T")
F = TypeVar("F", bound=Callable[..., Any])

ENTRY_POINT_GROUP = "astraflow.strategies"
KINDS = ("reward", "filter", "advantage", "curator")
# modules whose import registers the built-in strategies, imported on first lookup
BUILTIN_MODULES = (
    "astraflow.dataflow.rewards",
    "astraflow.dataflow.math_reward",
    "astraflow.dataflow.code_reward",
    "astraflow.dataflow.env_rewards",
    "astraflow.dataflow.judge_rewards",
    "astraflow.dataflow.code_pair_reward",
    "astraflow.dataflow.filters",
    "astraflow.dataflow.advantages",
    "astraflow.dataflow.curators",
    "astraflow.dataflow.curriculum",
    "astraflow.dataflow.mixing",
)


@dataclass(frozen=True, slots=True)
class StrategySpec:
    """One registered strategy version: how to build it and what it is."""

    kind: str  # reward | filter | advantage | curator
    name: str  # unique within the kind
    version: int  # bumped whenever its behaviour changes, so lineage tells results apart
    factory: Callable[..., Any]  # keyword params -> configured callable
    doc: str  # first line of the factory's docstring

    def params(self) -> list[str]:
        """Names of the parameters the factory accepts."""
        return [
            p.name for p in inspect.signature(self.factory).parameters.values() if p.kind is not p.VAR_KEYWORD
        ]


@dataclass(frozen=True, slots=True)
class Strategy(Generic[T]):
    """A configured strategy: call it like the object it wraps; it knows its name and version."""

    kind: str  # reward | filter | advantage | curator
    name: str  # registered name
    version: int  # registered version
    params: Mapping[str, Any]  # parameters it was built with
    impl: T  # the configured callable itself

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        return self.impl(*args, **kwargs)  # type: ignore[operator]

    def ref(self, app: str, slot: str) -> StrategyRef:
        """The lineage entry for records this strategy produced in `app`'s `slot`."""
        return StrategyRef(app=app, slot=slot, name=self.name, version=self.version)

    def describe(self) -> dict[str, Any]:
        """JSON-ready description: kind, name, version and params (params as strings)."""
        return {
            "kind": self.kind,
            "name": self.name,
            "version": self.version,
            "params": {
                k: v if isinstance(v, str) else json.dumps(v, default=str) for k, v in self.params.items()
            },
        }


@dataclass(slots=True)
class StrategyRegistry:
    """Strategies by (kind, name) and version. The module-level `REGISTRY` is the default one."""

    specs: dict[tuple[str, str], dict[int, StrategySpec]] = field(
        default_factory=dict
    )  # (kind, name) -> versions
    builtin_modules: tuple[str, ...] = ()  # imported before the first lookup
    entry_point_group: str | None = None  # plug-ins' group, loaded on the first miss
    plugin_errors: list[str] = field(default_factory=list)  # plug-ins that failed to load, with why
    builtins_loaded: bool = field(default=False, init=False)  # built-in modules imported
    plugins_loaded: bool = field(default=False, init=False)  # entry points loaded

    def register(self, kind: str, name: str, *, version: int = 1) -> Callable[[F], F]:
        """Decorator: registers a factory under (kind, name, version)."""
        if kind not in KINDS:
            raise StrategyError(f"unknown strategy kind {kind!r}; use one of {', '.join(KINDS)}")
        if version < 1:
            raise StrategyError(f"{kind} {name!r}: version must be >= 1, got {version}")

        def decorate(factory: F) -> F:
            versions = self.specs.setdefault((kind, name), {})
            old = versions.get(version)
            if old is not None and _qualname(old.factory) != _qualname(factory):
                raise StrategyError(
                    f"{kind} {name!r} v{version} is already registered by {_qualname(old.factory)}; "
                    f"bump the version or choose another name"
                )
            doc = (inspect.getdoc(factory) or "").split("\n", 1)[0]
            versions[version] = StrategySpec(kind, name, version, factory, doc)
            return factory

        return decorate

    def spec(self, kind: str, name: str, version: int | None = None) -> StrategySpec:
        """The registered spec (latest version unless one is given)."""
        self._load_builtins()
        versions = self.specs.get((kind, name))
        if versions is None or (version is not None and version not in versions):
            self._load_plugins()
            versions = self.specs.get((kind, name))
        if not versions:
            raise UnknownStrategyError(self._unknown_message(kind, name))
        if version is None:
            return versions[max(versions)]
        if version not in versions:
            raise UnknownStrategyError(
                f"{kind} {name!r} has no version {version}; registered versions: {sorted(versions)}"
            )
        return versions[version]

    def get(self, kind: str, name: str, *, version: int | None = None, **params: Any) -> Strategy[Any]:
        """Builds the strategy `name` of `kind` with `params`."""
        spec = self.spec(kind, name, version)
        try:
            inspect.signature(spec.factory).bind(**params)
        except TypeError as exc:
            raise StrategyError(
                f"{kind} {name!r} v{spec.version}: {exc}; it takes: {', '.join(spec.params()) or 'no parameters'}"
            ) from exc
        return Strategy(kind, name, spec.version, dict(params), spec.factory(**params))

    def from_control(self, kind: str, control: Control) -> Strategy[Any]:
        """Builds the strategy a Control record selects: its string params are decoded as JSON where
        they parse, and version 0 means the latest registered version."""
        return self.get(
            kind, control.strategy, version=control.version or None, **parse_params(control.params)
        )

    def known(self, kind: str | None = None) -> dict[str, list[int]]:
        """Registered names (as 'kind/name' when `kind` is None) with their versions."""
        self._load_builtins()
        self._load_plugins()
        return {
            (n if kind else f"{k}/{n}"): sorted(v)
            for (k, n), v in sorted(self.specs.items())
            if kind in (None, k)
        }

    def _unknown_message(self, kind: str, name: str) -> str:
        names = ", ".join(sorted(self.known(kind))) or "none"
        msg = f"no {kind} strategy named {name!r}; known {kind} strategies: {names}"
        if self.plugin_errors:
            msg += "; plug-ins that failed to load: " + "; ".join(self.plugin_errors)
        return msg

    def _load_builtins(self) -> None:
        if not self.builtins_loaded:
            self.builtins_loaded = True
            for module in self.builtin_modules:
                importlib.import_module(module)

    def _load_plugins(self) -> None:
        if self.plugins_loaded or self.entry_point_group is None:
            return
        self.plugins_loaded = True
        for ep in entry_points(group=self.entry_point_group):
            try:
                ep.load()
            except Exception as exc:  # third-party code: a broken plug-in must not take the built-ins down
                self.plugin_errors.append(f"{ep.name} ({ep.value}): {type(exc).__name__}: {exc}")


def parse_params(params: Mapping[str, str]) -> dict[str, Any]:
    """Control params are strings: decode each as JSON where it parses, keep it as text otherwise."""
    out: dict[str, Any] = {}
    for key, text in params.items():
        try:
            out[key] = json.loads(text)
        except (json.JSONDecodeError, TypeError):
            out[key] = text
    return out


def _qualname(obj: Any) -> str:
    return f"{getattr(obj, '__module__', '?')}.{getattr(obj, '__qualname__', repr(obj))}"


REGISTRY = StrategyRegistry(builtin_modules=BUILTIN_MODULES, entry_point_group=ENTRY_POINT_GROUP)
register = REGISTRY.register
get = REGISTRY.get
spec = REGISTRY.spec
known = REGISTRY.known
from_control = REGISTRY.from_control
