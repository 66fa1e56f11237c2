"""Pure parts the stream apps share: offset tracking (exactly-once commits), control state, slots, params, lazy imports."""

from __future__ import annotations

import subprocess
import sys

import pytest
from stream_fakes import FakeControl

from astraflow.control import ControlState, parse_param_args
from astraflow.errors import ConfigError, UnknownStrategyError
from astraflow.kafka.offsets import OffsetTracker
from astraflow.records import Control
from stream_apps.slots import Slot, SlotDefault, parse_default

TP0 = ("t", 0)


def test_offsets_commit_lowest_unfinished_with_out_of_order_finishes() -> None:
    tr = OffsetTracker()
    epochs = {o: tr.received(TP0, o) for o in (10, 11, 12, 13)}
    assert tr.committable(TP0) == 10
    tr.finished(TP0, 11, epochs[11])
    tr.finished(TP0, 13, epochs[13])
    assert tr.committable(TP0) == 10  # 10 still pending
    tr.finished(TP0, 10, epochs[10])
    assert tr.committable(TP0) == 12
    tr.finished(TP0, 12, epochs[12])
    assert tr.committable(TP0) == 14  # everything done: one past the highest
    assert tr.to_commit() == {TP0: 14}
    tr.mark_committed({TP0: 14})
    assert tr.to_commit() == {}


def test_offsets_gaps_and_held_records() -> None:
    tr = OffsetTracker()
    e = tr.received(TP0, 5)
    tr.received(TP0, 9)  # 6-8 absent (compaction / transaction markers)
    e9 = tr.received(TP0, 12)
    tr.finished(TP0, 5, e)
    tr.finished(TP0, 12, e9)
    assert tr.committable(TP0) == 9  # 9 is held (e.g. a pending group)
    assert tr.pending() == 1


def test_offsets_ignore_finishes_from_a_previous_assignment() -> None:
    tr = OffsetTracker()
    old = tr.received(TP0, 3)
    tr.forget({TP0})  # revoked while 3 was in flight
    new = tr.received(TP0, 3)  # assigned again: 3 is read again
    tr.finished(TP0, 3, old)  # the old in-flight copy finishing must not finish the new one
    assert tr.committable(TP0) == 3
    tr.finished(TP0, 3, new)
    assert tr.committable(TP0) == 4


def _c(app: str, slot: str, strategy: str, version: int = 1, **params: str) -> Control:
    return Control(app=app, slot=slot, strategy=strategy, version=version, params=params, issued_at=0)


def test_control_state_latest_wins_app_specific_over_everyone_and_tombstones() -> None:
    st = ControlState()
    assert st.apply("*/advantage", _c("*", "advantage", "rloo"))
    assert st.get("curate", "advantage").strategy == "rloo"
    assert st.apply("curate/advantage", _c("curate", "advantage", "dr_grpo"))
    assert st.get("curate", "advantage").strategy == "dr_grpo"
    assert not st.apply("curate/advantage", _c("curate", "advantage", "dr_grpo"))  # same record: no change
    gen = st.generation
    assert st.apply("curate/advantage", None)  # tombstone: back to the '*' record
    assert st.generation == gen + 1 and st.get("curate", "advantage").strategy == "rloo"
    assert st.get("reward", "reward") is None
    assert set(st.slots("curate")) == {"advantage"}


def test_param_and_default_parsing() -> None:
    assert parse_param_args(["abs_tol=0.5", 'weights={"a": 1}']) == {"abs_tol": "0.5", "weights": '{"a": 1}'}
    with pytest.raises(ConfigError):
        parse_param_args(["oops"])
    slot, d = parse_default('filter.staleness=staleness:{"max_staleness": 2}')
    assert slot == "filter.staleness" and d == SlotDefault("staleness", {"max_staleness": 2})
    with pytest.raises(ConfigError):
        parse_default("reward")


def test_slot_follows_control_and_rejects_bad_records() -> None:
    control = FakeControl()
    slot = Slot(control, "reward", "reward", "reward", SlotDefault("exact_match"))
    first = slot.get()
    assert first.name == "exact_match" and slot.version == 0
    assert slot.get() is first  # built once, not per call
    control.state.apply("reward/reward", _c("reward", "reward", "numeric", 1, abs_tol="0.5"))
    s = slot.get()
    assert (s.name, s.params, slot.version) == ("numeric", {"abs_tol": 0.5}, 1)
    assert slot.ref().name == "numeric" and slot.ref().slot == "reward"
    control.state.apply("reward/reward", _c("reward", "reward", "no_such_reward", 2))
    assert slot.get().name == "numeric" and slot.rejected == 1  # kept the previous one
    control.state.apply("reward/reward", _c("reward", "reward", "none", 3))
    assert slot.get().name == "numeric" and slot.rejected == 2  # the reward slot cannot be switched off
    control.state.apply("reward/reward", None)
    assert slot.get().name == "exact_match" and slot.version == 0


def test_optional_slot_can_be_switched_off_and_unknown_defaults_fail_fast() -> None:
    control = FakeControl()
    slot = Slot(control, "curate", "filter.zero_variance", "filter", SlotDefault("zero_variance"), optional=True)
    control.state.apply("curate/filter.zero_variance", _c("curate", "filter.zero_variance", "off"))
    assert slot.get() is None and slot.ref() is None
    with pytest.raises(UnknownStrategyError):
        Slot(None, "reward", "reward", "reward", SlotDefault("typo"))
    with pytest.raises(ConfigError):
        Slot(None, "reward", "reward", "reward", SlotDefault("none"))


def test_import_astraflow_and_the_decorator_stay_light() -> None:
    code = (
        "import sys, astraflow\n"
        "@astraflow.processor(source='rollouts', sink='x')\n"
        "def f(t):\n    return t\n"
        "heavy = [m for m in ('faust', 'confluent_kafka', 'aiokafka', 'torch', 'fastavro') if m in sys.modules]\n"
        "assert not heavy, heavy\n"
        "import astraflow.processor\n"
        "@astraflow.processor(source='rollouts')\n"  # still the decorator after the submodule import
        "def g(t):\n    return None\n"
        "print(type(f).__name__, g.name)\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    assert out.stdout.split() == ["Processor", "g"]
