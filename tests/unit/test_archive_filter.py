"""Replay filters are safe (no eval) and do what they say; time arguments parse."""

from __future__ import annotations

import pytest

from astraflow.archive.errors import FilterError
from astraflow.archive.filter import RecordFilter, parse_time, record_env
from astraflow.serde import AvroSerde
from astraflow.testing import make_trajectory


@pytest.fixture(scope="module")
def env() -> dict:
    name, datum = AvroSerde().decode(AvroSerde().dumps(make_trajectory(32, reward=0.75)))
    return record_env(name, datum, "af.e.rollouts", 2, 41, 1_700_000_000_000, b"g-task-0")


@pytest.mark.parametrize(
    ("expr", "want"),
    [
        ("reward > 0.5 and workflow == 'tool_use'", True),
        ("reward > 0.8 or workflow == 'rlvr'", False),
        ("not reward < 0.5", True),
        ("node.region == 'local' and node.hardware in ('cpu:2', 'cuda')", True),
        ("reward_components['exact_match'] >= 0.75", True),
        ("reward_components['missing'] > 0", False),  # None > 0 is false, not an error
        ("reward_components['missing'] is None", True),
        ("segments[0].role == 'prompt' and segments[-1].role == 'assistant'", True),
        ("segments[99].role == 'x'", False),
        ("0.5 < reward <= 1", True),
        ("status != 'ERROR' and error is None", True),
        ("_partition == 2 and _offset >= 40 and _key == 'g-task-0'", True),
        ("_schema == 'astraflow.Trajectory' and _topic == 'af.e.rollouts'", True),
        ("sample_index in [1, 2, 3]", False),
        ("final_answer", True),
        ("timings.generate_s > -1", True),
    ],
)
def test_filter_evaluates(env: dict, expr: str, want: bool) -> None:
    assert RecordFilter(expr)(env) is want


@pytest.mark.parametrize(
    "expr",
    [
        "__import__('os').system('true')",
        "open('/etc/passwd')",
        "reward.__class__.__bases__[0].__subclasses__()",
        "(lambda: 1)()",
        "[x for x in segments]",
        "reward + 1 > 2",
        "(y := 1)",
        "reward > f'{1}'",
        "reward if True else 0",
    ],
)
def test_filter_refuses_anything_but_comparisons(expr: str) -> None:
    with pytest.raises(FilterError):
        RecordFilter(expr)


def test_dunder_attributes_are_only_dict_lookups(env: dict) -> None:
    assert RecordFilter("node.__class__ == None")(env) is True  # a missing key, never a Python attribute


def test_unknown_field_names_the_fields(env: dict) -> None:
    f = RecordFilter("rewrad > 0.5")
    with pytest.raises(FilterError, match="rewrad.*fields: .*reward"):
        f(env)


def test_syntax_error_is_a_filter_error() -> None:
    with pytest.raises(FilterError, match="not a valid expression"):
        RecordFilter("reward >")


def test_parse_time_forms() -> None:
    now = 1_800_000_000_000
    assert parse_time("now", now) == now
    assert parse_time("2h", now) == now - 7_200_000
    assert parse_time("90s", now) == now - 90_000
    assert parse_time("1.5d", now) == now - 129_600_000
    assert parse_time("1700000000") == 1_700_000_000_000
    assert parse_time("1700000000123") == 1_700_000_000_123
    assert parse_time("2023-11-14T22:13:20Z") == 1_700_000_000_000
    assert parse_time("2023-11-14T22:13:20") == 1_700_000_000_000  # UTC when no zone
    assert parse_time("2023-11-15T00:13:20+02:00") == 1_700_000_000_000
    with pytest.raises(FilterError, match="ISO datetime"):
        parse_time("yesterday-ish")
