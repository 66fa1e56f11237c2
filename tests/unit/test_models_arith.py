"""Calculator tool, answer parsing and the synthetic arithmetic tasks."""

from __future__ import annotations

import json
import warnings

import pytest

from astraflow.errors import CalculatorError, ModelError
from astraflow.models.arith import answers_match, calculate, extract_calc_call, parse_answer, score_answer
from astraflow.models.tasks import arithmetic_dataset, make_problem, random_expression, split_heldout

pytestmark = pytest.mark.unit


@pytest.mark.parametrize(
    ("expression", "value"),
    [
        ("37*12+5", "449"),
        (" 3 + 4 * 2 ", "11"),
        ("(3+4)*2", "14"),
        ("-3+(4*2)", "5"),
        ("7/2", "3.5"),
        ("1/3", "0.333333"),
        ("7//2", "3"),
        ("-7//2", "-4"),
        ("10%3", "1"),
        ("2.5*2", "5"),
        ("0.1+0.2", "0.3"),
        ("6/3", "2"),
    ],
)
def test_calculator_values(expression: str, value: str) -> None:
    assert calculate(expression) == value


@pytest.mark.parametrize(
    "expression",
    [
        "__import__('os').system('echo hi')",
        "2**10",
        "x+1",
        "abs(-3)",
        "(1).real",
        "1 if 1 else 2",
        "[1, 2]",
        "'a'*3",
        "True+1",
        "lambda: 1",
        "1/0",
        "5%0",
        "1;2",
        "1 << 3",
        "",
        "9" * 300,
        "999999999999*999999999999",
        "1j*2",
    ],
)
def test_calculator_rejects_unsafe_or_invalid(expression: str) -> None:
    with pytest.raises(CalculatorError):
        calculate(expression)


def test_calculator_refuses_bad_literals_without_printing_a_warning() -> None:
    # "1or 2" makes Python's tokenizer warn ("invalid decimal literal") before the walk refuses it; a
    # model writes such text often, and the warning went to the node's stderr on every call
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for text in ("3x", "1or 2", "2and 3", "3if 1 else 2"):
            with pytest.raises(CalculatorError):
                calculate(text)
    assert [w for w in caught if issubclass(w.category, SyntaxWarning)] == []


def test_parse_answer_and_calls() -> None:
    text = "<calc>37*12+5</calc><result>449</result>Answer: 449"
    assert extract_calc_call(text) == "37*12+5"
    assert extract_calc_call("<calc>1+1</calc><result>2</result><calc> 2*3 </calc>") == "2*3"
    assert extract_calc_call("<calc>1+1") is None
    assert parse_answer(text) == "449"
    assert parse_answer("Answer:-12") == "-12"
    assert parse_answer("Answer: 1 then Answer: 2.5 done") == "2.5"
    assert parse_answer("the answer is 4") is None


def test_answers_match_and_score() -> None:
    assert answers_match("449", "449") and answers_match("449.0", "449") and answers_match("-0", "0")
    assert not answers_match(None, "1") and not answers_match("12", "13")
    assert answers_match(" abc ", "abc")
    reference = json.dumps({"answer": "449"})
    assert score_answer("<calc>1</calc>Answer: 449", reference) == 1.0
    assert score_answer("Answer: 448", reference) == 0.0
    assert score_answer("Answer: 7", "7") == 1.0


def test_dataset_is_deterministic_distinct_and_correct() -> None:
    a = arithmetic_dataset(50, seed=3, difficulty=2)
    assert a == arithmetic_dataset(50, seed=3, difficulty=2)
    assert a != arithmetic_dataset(50, seed=4, difficulty=2)
    assert len({p.question for p in a}) == 50
    for problem in a:
        assert problem.expression in problem.question
        assert problem.answer == calculate(problem.expression)
        assert problem.prompt == f"Q: {problem.question}\nA:"
        assert json.loads(problem.reference) == {"answer": problem.answer}
        assert problem.demonstration() == (
            f"<calc>{problem.expression}</calc><result>{problem.answer}</result>Answer: {problem.answer}"
        )


@pytest.mark.parametrize("difficulty", [1, 2, 3])
def test_expression_difficulty_shapes(difficulty: int) -> None:
    import random

    rng = random.Random(0)
    for _ in range(20):
        expression = random_expression(rng, difficulty)
        operators = sum(expression.count(op) for op in "+-*")
        assert operators >= 1 and (difficulty > 1 or operators == 1)
        calculate(expression)
    with pytest.raises(ModelError):
        random_expression(rng, 9)


def test_heldout_split_is_disjoint_and_stable() -> None:
    problems = arithmetic_dataset(300, seed=0, difficulty=2)
    train, heldout = split_heldout(problems, 0.25)
    assert len(train) + len(heldout) == 300
    assert 30 < len(heldout) < 120
    other_train, other_heldout = split_heldout(arithmetic_dataset(300, seed=1, difficulty=2), 0.25)
    heldout_expressions = {p.expression for p in heldout + other_heldout}
    assert not heldout_expressions & {p.expression for p in train + other_train}
    # A problem's side depends only on its expression, whatever the template.
    p = problems[0]
    assert split_heldout([make_problem(p.expression, "Compute {e}.")], 0.25)[1] == (
        [make_problem(p.expression, "Compute {e}.")] if p in heldout else []
    )
    with pytest.raises(ModelError):
        split_heldout(problems, 1.5)
