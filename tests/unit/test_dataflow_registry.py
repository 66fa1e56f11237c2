"""Strategy registry: registration, lookup with params, versions, errors, Control, plug-ins."""

from __future__ import annotations

from dataclasses import dataclass

import pytest

from astraflow.dataflow import registry as registry_module
from astraflow.dataflow.registry import REGISTRY, StrategyRegistry, parse_params
from astraflow.errors import StrategyError, UnknownStrategyError
from astraflow.records import Control, StrategyRef

pytestmark = pytest.mark.unit


def _fresh() -> StrategyRegistry:
    reg = StrategyRegistry()

    @reg.register("reward", "const", version=1)
    def const(*, value: float = 1.0):
        """Always `value`."""
        return lambda _t: value

    @reg.register("reward", "const", version=2)
    def const2(*, value: float = 1.0, scale: float = 2.0):
        """Always `value * scale`."""
        return lambda _t: value * scale

    return reg


def test_get_builds_latest_version_with_params_and_lineage() -> None:
    reg = _fresh()
    s = reg.get("reward", "const", value=3.0)
    assert (s.name, s.version, s(None)) == ("const", 2, 6.0)
    assert s.ref("reward", "score") == StrategyRef("reward", "score", "const", 2)
    assert s.describe() == {"kind": "reward", "name": "const", "version": 2, "params": {"value": "3.0"}}
    old = reg.get("reward", "const", version=1, value=3.0)
    assert (old.version, old(None)) == (1, 3.0)
    assert reg.spec("reward", "const").doc == "Always `value * scale`."
    assert reg.known("reward") == {"const": [1, 2]}


def test_errors_say_what_exists() -> None:
    reg = _fresh()
    with pytest.raises(
        UnknownStrategyError, match=r"no reward strategy named 'nope'; known reward strategies: const"
    ):
        reg.get("reward", "nope")
    with pytest.raises(UnknownStrategyError, match=r"no version 7; registered versions: \[1, 2\]"):
        reg.get("reward", "const", version=7)
    with pytest.raises(StrategyError, match="it takes: value, scale"):
        reg.get("reward", "const", colour="red")
    with pytest.raises(StrategyError, match="unknown strategy kind"):
        reg.register("nonsense", "x")
    with pytest.raises(StrategyError, match="already registered"):

        @reg.register("reward", "const", version=1)
        def other() -> None: ...


def test_from_control_decodes_string_params() -> None:
    reg = _fresh()
    control = Control(app="reward", slot="score", strategy="const", version=1, params={"value": "0.25"})
    s = reg.from_control("reward", control)
    assert (s.version, s(None)) == (1, 0.25)
    assert parse_params({"w": '{"a": 1}', "flag": "true", "name": "plain text"}) == {
        "w": {"a": 1},
        "flag": True,
        "name": "plain text",
    }


@dataclass
class _FakeEntryPoint:
    name: str
    value: str
    action: object

    def load(self) -> object:
        return self.action()  # type: ignore[operator]


def test_plugins_load_lazily_from_entry_points(monkeypatch: pytest.MonkeyPatch) -> None:
    reg = StrategyRegistry(entry_point_group="astraflow.strategies")
    loads: list[str] = []

    def good() -> None:
        loads.append("good")

        @reg.register("filter", "plugin_filter", version=3)
        def plugin_filter():
            """A third-party filter."""
            return lambda items, ctx=None: items

    def broken() -> None:
        raise ImportError("missing dependency 'foo'")

    eps = [_FakeEntryPoint("good", "good_pkg.strategies", good), _FakeEntryPoint("bad", "bad_pkg:x", broken)]
    monkeypatch.setattr(
        registry_module, "entry_points", lambda group: eps if group == "astraflow.strategies" else []
    )
    assert loads == []  # nothing loaded at construction
    assert reg.get("filter", "plugin_filter").version == 3
    assert loads == ["good"]
    with pytest.raises(
        UnknownStrategyError, match=r"bad \(bad_pkg:x\): ImportError: missing dependency 'foo'"
    ):
        reg.get("filter", "absent")
    reg.get("filter", "plugin_filter")
    assert loads == ["good"]  # loaded once


def test_default_registry_has_every_builtin() -> None:
    names = REGISTRY.known()
    for key in (
        "reward/exact_match",
        "reward/numeric",
        "reward/code_tests",
        "reward/tool_use",
        "reward/weighted",
        "filter/staleness",
        "filter/zero_variance",
        "filter/length",
        "filter/dedupe",
        "advantage/grpo",
        "advantage/dr_grpo",
        "advantage/rloo",
        "curator/accept_all",
        "curator/filter_solved",
        "curator/greso",
        "curator/curriculum_target",
        "curator/curriculum_ordered",
        "curator/mix",
    ):
        assert key in names
