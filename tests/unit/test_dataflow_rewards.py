"""Rewards: answer normalisation, exact match, numeric tolerance, tool use, weighting, code tests."""

from __future__ import annotations

import asyncio
import dataclasses
import json

import pytest

from astraflow.dataflow.code_reward import CodeTests, extract_code
from astraflow.dataflow.registry import get
from astraflow.dataflow.rewards import (
    ExactMatch,
    NumericMatch,
    RewardResult,
    ToolUse,
    normalize_answer,
    parse_number,
    score_async,
    with_reward,
)
from astraflow.errors import RewardError
from astraflow.records import StrategyRef, ToolCall, Trajectory
from astraflow.testing import make_trajectory

pytestmark = pytest.mark.unit
BASE = make_trajectory(32)


def answered(answer: str | None, reference: object, **changes: object) -> Trajectory:
    ref = reference if isinstance(reference, str) or reference is None else json.dumps(reference)
    return dataclasses.replace(BASE, final_answer=answer, reference=ref, **changes)  # type: ignore[arg-type]


@pytest.mark.parametrize(
    ("raw", "canon"),
    [
        ("  42 ", "42"),
        ("The answer is: \\boxed{ 42 }.", "42"),
        ("so \\boxed{\\frac{1}{2}}", "\\frac{1}{2}"),
        ("Final answer: Paris.", "paris"),
        ("$x^2$", "x^2"),
        ("'New   York'", "new york"),
    ],
)
def test_normalize_answer(raw: str, canon: str) -> None:
    assert normalize_answer(raw) == canon


@pytest.mark.parametrize(
    ("raw", "value"),
    [
        ("42", 42.0),
        ("the total is 1,234.5 dollars", 1234.5),
        ("-3e-2", -0.03),
        ("3/4", 0.75),
        ("\\boxed{\\frac{3}{4}}", 0.75),
        ("first 7 then 9", 9.0),
        ("no digits", None),
        ("1/0", None),
    ],
)
def test_parse_number(raw: str, value: float | None) -> None:
    assert parse_number(raw) == (pytest.approx(value) if value is not None else None)


def test_exact_match() -> None:
    reward = ExactMatch()
    assert reward(answered("\\boxed{42}", {"answer": "42"})) == RewardResult(
        1.0, {"exact_match": 1.0, "answered": 1.0}
    )
    assert reward(answered("41", {"answer": 42})).reward == 0.0
    assert reward(answered("paris", {"answers": ["Paris", "Paris, France"]})).reward == 1.0
    assert reward(answered(None, {"answer": "42"})) == RewardResult(
        0.0, {"exact_match": 0.0, "answered": 0.0}
    )
    assert ExactMatch(normalize=False)(answered("Paris.", {"answer": "paris"})).reward == 0.0


@pytest.mark.parametrize("reference", [None, "not json", '["a list"]', '{"other": 1}'])
def test_bad_reference_raises_reward_error(reference: str | None) -> None:
    with pytest.raises(RewardError):
        ExactMatch()(answered("42", reference))


def test_numeric_tolerance() -> None:
    strict = NumericMatch(abs_tol=0.0, rel_tol=1e-3)
    assert strict(answered("x = 100.05", {"answer": "100"})).reward == 1.0  # rel error 5e-4
    out = strict(answered("100.2", {"answer": "100"}))  # rel error 2e-3
    assert out.reward == 0.0 and out.components["abs_error"] == pytest.approx(0.2)
    assert NumericMatch(abs_tol=0.5, rel_tol=0.0)(answered("100.2", {"answer": "100"})).reward == 1.0
    assert NumericMatch()(answered("3/4", {"answer": "0.75"})).reward == 1.0
    assert NumericMatch()(answered("I don't know", {"answer": "1"})).components == {
        "numeric_match": 0.0,
        "parsed": 0.0,
    }
    with pytest.raises(RewardError, match="not numeric"):
        NumericMatch()(answered("1", {"answer": "one"}))


def test_tool_use_success_fraction() -> None:
    calls = [
        ToolCall(0, "calc", "{}", "4", 0.1),
        ToolCall(1, "calc", "{}", "", 0.1, error="boom"),
        ToolCall(2, "search", "{}", "ok", 0.1),
        ToolCall(3, "calc", "{}", "", 0.1, error="x"),
    ]
    out = ToolUse()(answered("4", {"answer": "4"}, tool_calls=calls))
    assert out == RewardResult(0.5, {"used_tool": 1.0, "tool_success_rate": 0.5, "tool_calls": 4.0})
    none = ToolUse(no_tool_reward=0.25)(answered("4", {"answer": "4"}, tool_calls=[]))
    assert none.reward == 0.25 and none.components["used_tool"] == 0.0


def test_weighted_combination_and_lineage() -> None:
    t = answered(
        "4",
        {"answer": "4"},
        tool_calls=[ToolCall(0, "calc", "{}", "4", 0.1), ToolCall(1, "calc", "{}", "", 0.1, error="e")],
    )
    reward = get("reward", "weighted", weights={"exact_match": 0.8, "tool_use": 0.2})
    out = reward(t)
    assert out.reward == pytest.approx(0.8 * 1.0 + 0.2 * 0.5)
    assert out.components["exact_match"] == 1.0 and out.components["tool_use"] == 0.5
    assert out.components["tool_use.tool_success_rate"] == 0.5
    assert asyncio.run(score_async(reward, t)) == out
    scored = with_reward(t, out, reward.ref("reward", "score"))
    assert scored.reward == pytest.approx(0.9) and scored.lineage[-1] == StrategyRef(
        "reward", "score", "weighted", 1
    )
    assert t.reward is None  # the input is not modified
    with pytest.raises(RewardError, match="no weight"):
        get("reward", "weighted", weights={"exact_match": 1.0}, params={"numeric": {}})


def test_extract_code_prefers_last_python_block() -> None:
    text = (
        "Plan:\n```text\nnot code\n```\nFirst try:\n```python\nx = 1\n```\nBetter:\n```python\nx = 2\n```\n"
    )
    assert extract_code(text) == "x = 2\n"
    assert extract_code("```\ny = 3\n```") == "y = 3\n"
    assert extract_code("z = 4") == "z = 4"


CODE_REF = {"tests": ["assert add(1, 2) == 3", "assert add(-1, 1) == 0", "assert add(2, 2) == 4"]}
SOLUTIONS = {
    "correct": ("```python\ndef add(a, b):\n    return a + b\n```", 1.0, 3),
    "partly": ("def add(a, b):\n    return a + b if a > 0 else 7", 0.0, 2),
    "exits_early": ("import sys\nsys.exit(0)", 0.0, 0),
    "hard_exit": ("import os\nos._exit(0)", 0.0, 0),
    "loops": ("while True:\n    pass", 0.0, 0),
}


@pytest.mark.parametrize("case", list(SOLUTIONS))
def test_code_tests_in_the_sandbox(case: str) -> None:
    code, expected, passed = SOLUTIONS[case]
    reward = CodeTests(timeout_s=3, cpu_s=1, memory_mb=256)
    out = asyncio.run(reward.score_async(answered(code, CODE_REF)))
    assert out.reward == expected
    assert out.components["tests_passed"] == passed and out.components["tests_total"] == 3


def test_code_tests_partial_credit_sync_and_errors() -> None:
    reward = get("reward", "code_tests", partial_credit=True, timeout_s=5)
    out = reward(answered(SOLUTIONS["partly"][0], CODE_REF))
    assert out.reward == pytest.approx(2 / 3) and out.components["reported"] == 1.0
    assert reward(answered("", CODE_REF)).reward == 0.0
    with pytest.raises(RewardError, match="'tests'"):
        reward(answered("def add(a, b): ...", {"tests": []}))
