"""Synthetic text on which the tiny tokenizer is trained; nothing is downloaded.

The corpus mixes what the tiny models will see: full tool-use conversations for every task
difficulty, bare expressions and results, and generic English sentences from a small grammar so
that ordinary words also get merged tokens. Deterministic in its seed.
"""

from __future__ import annotations

import random

from astraflow.models.tasks import DIFFICULTIES, QUESTION_TEMPLATES, make_problem, random_expression

_SUBJECTS = [
    "the model",
    "a student",
    "the teacher",
    "my friend",
    "the agent",
    "a robot",
    "the team",
    "our system",
    "the cat",
    "a scientist",
    "the trainer",
    "every node",
    "the reader",
    "this policy",
    "the calculator",
]
_VERBS = [
    "writes",
    "reads",
    "checks",
    "computes",
    "learns",
    "finds",
    "solves",
    "explains",
    "counts",
    "adds",
    "multiplies",
    "compares",
    "returns",
    "answers",
    "asks",
    "uses",
    "builds",
    "tests",
    "sends",
    "keeps",
]
_OBJECTS = [
    "the answer",
    "a number",
    "the question",
    "a short story",
    "the result",
    "every problem",
    "the sum",
    "a simple plan",
    "the product",
    "the next step",
    "a new message",
    "the data",
    "the tool",
    "an example",
]
_ENDINGS = [
    "today",
    "again",
    "quickly",
    "with care",
    "before lunch",
    "in the morning",
    "every day",
    "at night",
    "without help",
    "one more time",
    "step by step",
    "for the first time",
    "as expected",
    "in order",
]
_WORDS = [
    "what",
    "is",
    "the",
    "of",
    "and",
    "to",
    "in",
    "it",
    "that",
    "for",
    "you",
    "with",
    "on",
    "this",
    "as",
    "be",
    "at",
    "by",
    "from",
    "or",
    "have",
    "an",
    "they",
    "which",
    "one",
    "all",
    "there",
    "when",
    "can",
    "two",
    "three",
    "four",
    "five",
    "plus",
    "minus",
    "times",
    "equals",
    "number",
    "sum",
    "total",
    "value",
    "question",
    "answer",
    "result",
    "tool",
    "call",
    "compute",
    "calculate",
    "evaluate",
    "step",
    "think",
]


def generic_sentence(rng: random.Random) -> str:
    """One sentence of simple English from a tiny grammar or a bag of frequent words."""
    if rng.random() < 0.7:
        text = f"{rng.choice(_SUBJECTS)} {rng.choice(_VERBS)} {rng.choice(_OBJECTS)} {rng.choice(_ENDINGS)}"
        return text[0].upper() + text[1:] + rng.choice(".!?")
    words = [rng.choice(_WORDS) for _ in range(rng.randint(4, 12))]
    return " ".join(words).capitalize() + "."


def synthetic_corpus(n_lines: int = 4000, seed: int = 0) -> list[str]:
    """`n_lines` lines: about half tool-use conversations and expressions, half generic text."""
    rng = random.Random(f"corpus:{seed}")
    lines: list[str] = []
    for _ in range(n_lines):
        kind = rng.random()
        if kind < 0.45:
            difficulty = rng.choice(sorted(DIFFICULTIES))
            problem = make_problem(
                random_expression(rng, difficulty), rng.choice(QUESTION_TEMPLATES), difficulty
            )
            lines.append(problem.prompt + problem.demonstration())
        elif kind < 0.55:
            expression = random_expression(rng, rng.choice(sorted(DIFFICULTIES)))
            lines.append(f"{expression} = {make_problem(expression).answer}")
        else:
            lines.append(generic_sentence(rng))
    return lines
