"""The verifier's side of the arithmetic task: judging a proposed answer, warm start and held-out set.

A verifier reads ``verification_prompt(question, proposed)`` and says whether the proposed
answer is right (``Answer: yes`` / ``Answer: no``, `astraflow.models.protocol`). Its best
solution asks the calculator for the difference, ``<calc>EXPR-(PROPOSED)</calc>``, and says yes
exactly when the result is 0; a 400k-parameter model cannot check the arithmetic in its head. `warm_start_verifier` teaches the format with
demonstrations of which only `tool_fraction` use the calculator (the others state the right
verdict directly, which the tiny model can only guess), so RL has a decision to learn, as for
the solver. `heldout_items` is the fixed, balanced held-out set: half of its proposals are the
right answer, half a wrong one, so a verifier that always says yes (or no) scores 50%.
"""

from __future__ import annotations

import hashlib
import random
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING

from astraflow.models.arith import calculate
from astraflow.models.protocol import calc_call, final_answer, tool_result, verification_prompt
from astraflow.models.tasks import ArithProblem, arithmetic_dataset, split_heldout

if TYPE_CHECKING:
    from astraflow.models.sft import SftMetrics


def wrong_answer(answer: str, rng: random.Random) -> str:
    """A plausible wrong answer: off by a little, by a power of ten, or another number of its size."""
    value = int(answer)
    kind = rng.random()
    if kind < 0.5:
        delta = rng.choice([-1, 1]) * rng.randint(1, 9)
    elif kind < 0.7:
        delta = rng.choice([-1, 1]) * 10 ** rng.randint(1, 2)
    else:
        size = max(1, len(str(abs(value))))
        delta = rng.randint(1, 10**size) * rng.choice([-1, 1])
    return str(value + delta)


def judgement(problem: ArithProblem, proposed: str, *, use_tool: bool) -> tuple[str, str]:
    """(prompt, completion) of the ideal verifier for `proposed`: with the calculator, or a direct verdict."""
    verdict = "yes" if proposed == problem.answer else "no"
    check = f"{problem.expression}-({proposed})"  # 0 exactly when the proposal is right
    completion = calc_call(check) + tool_result(calculate(check)) if use_tool else ""
    return verification_prompt(problem.prompt, proposed), completion + final_answer(verdict)


def verifier_examples(problems: Sequence[ArithProblem], tool_fraction: float, seed: int) -> list[tuple[str, str]]:
    """Warm-start demonstrations: one per problem, a right proposal or a wrong one with equal odds."""
    rng = random.Random(f"verifier:{seed}")
    out = []
    for p in problems:
        proposed = p.answer if rng.random() < 0.5 else wrong_answer(p.answer, rng)
        out.append(judgement(p, proposed, use_tool=rng.random() < tool_fraction))
    return out


def heldout_items(problems: Sequence[ArithProblem]) -> list[tuple[str, str]]:
    """(verifier prompt, right verdict) per problem: even positions propose the right answer, odd ones
    a wrong one (drawn from the problem's id, so the set is fixed)."""
    out = []
    for i, p in enumerate(problems):
        rng = random.Random(hashlib.sha256(p.prompt_id.encode()).hexdigest())
        proposed = p.answer if i % 2 == 0 else wrong_answer(p.answer, rng)
        out.append((verification_prompt(p.prompt, proposed), "yes" if i % 2 == 0 else "no"))
    return out


def warm_start_verifier(model_dir: str | Path, *, n_examples: int = 2000, steps: int = 300, difficulty: int = 2,
                        seed: int = 0, tool_fraction: float = 0.5, heldout_fraction: float = 0.2) -> SftMetrics:
    """SFT of a fresh `init_tiny` model on verifier demonstrations of the train side of the split."""
    from astraflow.models.sft import sft

    train, _ = split_heldout(arithmetic_dataset(n_examples, seed=seed, difficulty=difficulty), heldout_fraction)
    return sft(model_dir, verifier_examples(train, tool_fraction, seed), steps=steps, seed=seed)
