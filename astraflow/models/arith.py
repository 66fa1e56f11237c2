"""Calculator tool and answer checking for arithmetic tasks, shared by evaluation and RaaS.

`calculate` is the calculator tool: it parses the expression with `ast` and walks only numbers,
unary ``+``/``-`` and the binary operators ``+ - * / // %`` (no names, calls, attributes, powers
or anything else), using exact rational arithmetic with bounds on length and magnitude, so model
output can be evaluated in-process without `eval`. The other functions pull a calculator call or
a final answer out of generated text and compare answers numerically. All are pure.
"""

from __future__ import annotations

import ast
import json
import re
import warnings
from fractions import Fraction

from astraflow.errors import CalculatorError
from astraflow.models.protocol import ANSWER_PREFIX, CALC_CLOSE, CALC_OPEN

MAX_EXPRESSION_CHARS = 200  # longer input is refused before parsing
MAX_MAGNITUDE = 10**18  # any intermediate value beyond this is refused
DECIMALS = 6  # non-integer results are rounded to this many decimals

_BINARY = {
    ast.Add: lambda a, b: a + b,
    ast.Sub: lambda a, b: a - b,
    ast.Mult: lambda a, b: a * b,
    ast.Div: lambda a, b: a / b,
    ast.FloorDiv: lambda a, b: Fraction(a // b),
    ast.Mod: lambda a, b: a % b,
}
_UNARY = {ast.UAdd: lambda a: a, ast.USub: lambda a: -a}
_CALL_RE = re.compile(re.escape(CALC_OPEN) + r"(.*?)" + re.escape(CALC_CLOSE), re.DOTALL)
_ANSWER_RE = re.compile(re.escape(ANSWER_PREFIX) + r"\s*(-?\d+(?:\.\d+)?)")
_NUMBER_RE = re.compile(r"-?\d+(?:\.\d+)?")


def calculate(expression: str) -> str:
    """Evaluates an arithmetic expression safely and returns the value as text.

    Integers print as integers (``"449"``); other values are rounded to `DECIMALS` decimals with
    trailing zeros removed (``"2.5"``). Raises `CalculatorError` for anything else: disallowed
    syntax, division by zero, values beyond `MAX_MAGNITUDE`, over-long input.
    """
    text = expression.strip()
    if not text:
        raise CalculatorError("empty expression: give the calculator something like 12*7")
    if len(text) > MAX_EXPRESSION_CHARS:
        raise CalculatorError(f"expression longer than {MAX_EXPRESSION_CHARS} characters")
    try:
        with warnings.catch_warnings():  # model text like "1or 2" warns, then the walk refuses it
            warnings.simplefilter("ignore", SyntaxWarning)
            tree = ast.parse(text, mode="eval")
    except (SyntaxError, ValueError) as exc:
        raise CalculatorError(f"not an arithmetic expression: {text!r}") from exc
    return format_number(_evaluate(tree.body))


def format_number(value: Fraction) -> str:
    """Formats an exact value: integers as such, others rounded to `DECIMALS` decimals."""
    if value.denominator == 1:
        return str(value.numerator)
    rounded = round(value, DECIMALS)
    text = f"{float(rounded):.{DECIMALS}f}".rstrip("0").rstrip(".")
    return "0" if text in ("-0", "") else text


def _evaluate(node: ast.AST) -> Fraction:
    """Walks the allowed subset of the expression tree; raises `CalculatorError` otherwise."""
    if isinstance(node, ast.Constant):
        value = node.value
        if isinstance(value, bool) or not isinstance(value, int | float):
            raise CalculatorError(f"only numbers are allowed, not {value!r}")
        result = Fraction(str(value)) if isinstance(value, float) else Fraction(value)
    elif isinstance(node, ast.UnaryOp) and type(node.op) in _UNARY:
        result = _UNARY[type(node.op)](_evaluate(node.operand))
    elif isinstance(node, ast.BinOp) and type(node.op) in _BINARY:
        left, right = _evaluate(node.left), _evaluate(node.right)
        if right == 0 and isinstance(node.op, ast.Div | ast.FloorDiv | ast.Mod):
            raise CalculatorError("division by zero")
        result = _BINARY[type(node.op)](left, right)
    else:
        raise CalculatorError(f"{type(node).__name__} is not allowed: use numbers, + - * / // % and ( )")
    if abs(result) > MAX_MAGNITUDE:
        raise CalculatorError(f"value exceeds {MAX_MAGNITUDE:.0e}")
    return result


def extract_calc_call(text: str) -> str | None:
    """The expression of the last complete ``<calc>...</calc>`` call in `text`, or None."""
    calls = _CALL_RE.findall(text)
    return calls[-1].strip() if calls else None


def parse_answer(text: str) -> str | None:
    """The number after the last ``Answer:`` in `text` (``"-12"``, ``"2.5"``), or None."""
    found = _ANSWER_RE.findall(text)
    return found[-1] if found else None


def answers_match(predicted: str | None, reference: str) -> bool:
    """Whether two answers are equal: numerically when both are numbers, else as stripped text."""
    if predicted is None:
        return False
    a, b = predicted.strip(), reference.strip()
    if _NUMBER_RE.fullmatch(a) and _NUMBER_RE.fullmatch(b):
        return Fraction(a) == Fraction(b)
    return a == b


def reference_answer(reference: str) -> str:
    """The answer held in a task reference: JSON ``{"answer": "449"}`` or the bare answer text."""
    try:
        data = json.loads(reference)
    except json.JSONDecodeError:
        return reference.strip()
    if isinstance(data, dict) and "answer" in data:
        return str(data["answer"]).strip()
    return reference.strip()


def score_answer(completion: str, reference: str) -> float:
    """Reward of a completion: 1.0 when its ``Answer:`` matches the reference, else 0.0."""
    return 1.0 if answers_match(parse_answer(completion), reference_answer(reference)) else 0.0
