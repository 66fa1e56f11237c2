"""Synthetic arithmetic-with-a-calculator tasks: problems, demonstrations and a held-out split.

The demo task for the tiny models: a question such as "What is 37*12+5?" whose best solution
calls the calculator with the expression copied from the question, reads the tool's result and
states it. `arithmetic_dataset` is deterministic in its seed; `split_heldout` assigns problems
to train or held-out by a hash of the expression, so no expression ever lands on both sides,
whatever the seed or size of the dataset.
"""

from __future__ import annotations

import hashlib
import json
import random
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

from astraflow.errors import ModelError
from astraflow.models.arith import calculate
from astraflow.models.protocol import calc_call, final_answer, format_prompt, tool_result

QUESTION_TEMPLATES: tuple[str, ...] = ("What is {e}?", "Compute {e}.", "Calculate {e}.", "Evaluate {e}.")
DIFFICULTIES: dict[int, tuple[int, int, int, bool]] = {
    # difficulty: (min operands, max operands, max digits per number, parentheses allowed)
    1: (2, 2, 2, False),
    2: (3, 3, 2, False),
    3: (3, 4, 3, True),
}


@dataclass(frozen=True, slots=True)
class ArithProblem:
    """One arithmetic question with its reference answer."""

    prompt_id: str  # stable id derived from the question text
    question: str  # e.g. "What is 37*12+5?"
    expression: str  # the arithmetic inside the question, e.g. "37*12+5"
    answer: str  # the calculator's value of `expression`, e.g. "449"
    difficulty: int  # key of DIFFICULTIES

    @property
    def prompt(self) -> str:
        """The formatted prompt, ``"Q: {question}\\nA:"``."""
        return format_prompt(self.question)

    @property
    def reference(self) -> str:
        """The reference as tasks carry it: JSON ``{"answer": "449"}``."""
        return json.dumps({"answer": self.answer})

    def demonstration(self) -> str:
        """The ideal completion: calc call, the tool's result (not trained on), final answer."""
        return calc_call(self.expression) + tool_result(self.answer) + final_answer(self.answer)

    def example(self) -> tuple[str, str]:
        """(prompt, demonstration), the input `sft` takes."""
        return self.prompt, self.demonstration()


def random_expression(rng: random.Random, difficulty: int) -> str:
    """A random expression of the given difficulty, without spaces, e.g. ``"37*12+5"``."""
    if difficulty not in DIFFICULTIES:
        raise ModelError(f"unknown difficulty {difficulty}: choose one of {sorted(DIFFICULTIES)}")
    lo, hi, digits, parens = DIFFICULTIES[difficulty]
    count = rng.randint(lo, hi)
    numbers = [str(rng.randint(0, 10 ** rng.randint(1, digits) - 1)) for _ in range(count)]
    ops = [rng.choice("+-*") for _ in range(count - 1)]
    parts = [numbers[0]]
    for op, number in zip(ops, numbers[1:], strict=True):
        parts += [op, number]
    if parens and count >= 3 and rng.random() < 0.5:
        start = 2 * rng.randint(0, count - 2)  # wrap two neighbouring numbers and their operator
        parts[start : start + 3] = ["(" + "".join(parts[start : start + 3]) + ")"]
    return "".join(parts)


def make_problem(
    expression: str, question_template: str = QUESTION_TEMPLATES[0], difficulty: int = 0
) -> ArithProblem:
    """Builds the problem for one expression; the answer comes from the calculator tool itself."""
    question = question_template.format(e=expression)
    digest = hashlib.sha256(question.encode()).hexdigest()[:12]
    return ArithProblem(f"arith-{digest}", question, expression, calculate(expression), difficulty)


def arithmetic_dataset(n: int, seed: int = 0, difficulty: int = 1) -> list[ArithProblem]:
    """`n` distinct random problems of one difficulty (1 easy .. 3 hard), deterministic in `seed`."""
    rng = random.Random(f"arith:{seed}:{difficulty}")
    problems: dict[str, ArithProblem] = {}
    attempts = 0
    while len(problems) < n:
        attempts += 1
        if attempts > 50 * n + 1000:
            raise ModelError(f"cannot draw {n} distinct problems at difficulty {difficulty}: ask for fewer")
        problem = make_problem(random_expression(rng, difficulty), rng.choice(QUESTION_TEMPLATES), difficulty)
        problems.setdefault(problem.question, problem)
    return list(problems.values())


def is_heldout(expression: str, fraction: float, salt: str = "heldout") -> bool:
    """Whether an expression belongs to the held-out side; depends only on the expression."""
    digest = hashlib.sha256(f"{salt}:{expression}".encode()).digest()
    return int.from_bytes(digest[:8], "big") / 2**64 < fraction


def split_heldout(
    problems: Iterable[ArithProblem], fraction: float = 0.2, salt: str = "heldout"
) -> tuple[list[ArithProblem], list[ArithProblem]]:
    """Splits problems into (train, heldout) by a hash of the expression (see `is_heldout`)."""
    if not 0.0 <= fraction <= 1.0:
        raise ModelError(f"held-out fraction must be within [0, 1], got {fraction}")
    train: list[ArithProblem] = []
    heldout: list[ArithProblem] = []
    for problem in problems:
        (heldout if is_heldout(problem.expression, fraction, salt) else train).append(problem)
    return train, heldout


def as_eval_items(problems: Sequence[ArithProblem]) -> list[tuple[str, str]]:
    """(prompt, reference answer) pairs, the input `evaluate_tool_use` takes."""
    return [(p.prompt, p.answer) for p in problems]
