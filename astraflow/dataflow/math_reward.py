r"""The `math_verify` reward: the final answer checked against the reference with math-verify.

    astraflow control set -e EXP reward reward math_verify --param format_weight=0.1 --param format=strict

Steps, for a trajectory whose reference is `{"answer": ...}` (or `{"answers": [...]}`):

1. The reference's answer (`math_answers.reference_answer`): a GSM8K solution's `#### n`, a
   MATH solution's `\boxed{}`, or a short answer as it is.
2. The completion's final answer (`math_answers.final_answer`, from `Trajectory.final_answer`):
   `\boxed{}`, `#### n`, "the answer is ...", or the last number.
3. Equivalence by math-verify (numbers, fractions, percentages, sets, intervals, symbolic
   expressions: `0.5` = `\frac{1}{2}`, `x(x+2)` = `x^2+2x`), in a bounded pool of worker
   processes with a deadline per call (`math_verifier`), so a pathological expression costs at
   most `timeout_s` (+ a grace) and never blocks or crashes the reward app.

reward = `correct_weight` x correct + `format_weight` x format, where format is 1 when the
final answer was given in the form asked for: `strict` (a box or `####`) or `lenient` (any
answer that could be found). Components: `correct`, `format`, `answered`, `reference_ok`,
`timeout`.

A reference that cannot be verified (missing, not JSON, no answer in it, math-verify cannot
parse it) scores 0, with the reason in the trajectory's metadata (`reward.reason`, see
`RewardResult.notes`) and `reference_ok` 0: every sample of its group scores 0 alike, so the
group has no variance and curate's dynamic sampling drops it rather than train on it. A timeout
or an unparsable answer scores 0 with its reason too.
"""

from __future__ import annotations

import asyncio
import json
from dataclasses import dataclass, field
from typing import ClassVar, Literal

from astraflow.dataflow.math_answers import MAX_ANSWER_CHARS, final_answer, latex_candidate, reference_answer
from astraflow.dataflow.math_verifier import MathVerifier, Verdict
from astraflow.dataflow.registry import register
from astraflow.dataflow.rewards import RewardResult
from astraflow.errors import RewardError
from astraflow.records import Trajectory


def reference_texts(trajectory: Trajectory, key: str) -> tuple[list[str], str | None]:
    """The reference's answer texts, or ([], why not)."""
    if not trajectory.reference:
        return [], "the task has no reference"
    try:
        ref = json.loads(trajectory.reference)
    except json.JSONDecodeError:
        ref = None
    if not isinstance(ref, dict):
        return [], f"the reference is not a JSON object: {trajectory.reference[:100]!r}"
    if key in ref:
        raw = [ref[key]]
    elif isinstance(ref.get(key + "s"), list) and ref[key + "s"]:
        raw = list(ref[key + "s"])
    else:
        return [], f"the reference has no {key!r} (nor a list {key + 's'!r}); keys: {', '.join(map(str, ref))[:200]}"
    answers = [reference_answer(str(a)) for a in raw if a is not None]
    found = [a for a in answers if a]
    if not found:
        return [], f"no answer found in the reference {str(raw[0])[:100]!r}"
    return found, None


@register("reward", "math_verify", version=1)
@dataclass(frozen=True)
class MathVerify:
    """1 when math-verify finds the final answer equal to the reference's (plus a weighted format part)."""

    reads_segments: ClassVar[bool] = False  # reads final_answer and reference only

    correct_weight: float = 1.0  # weight of the correctness part
    format_weight: float = 0.0  # weight of the format part (0: correctness alone)
    format: Literal["strict", "lenient"] = "strict"  # strict: \boxed{} or '#### n'; lenient: any answer found
    timeout_s: float = 5.0  # per check, in the worker; the worker is replaced 2 s after that
    workers: int = 2  # math-verify processes at most (per reward app worker)
    key: str = "answer"  # field of the reference JSON
    verifier: MathVerifier = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        if self.format not in ("strict", "lenient"):
            raise RewardError(f"math_verify: format must be strict or lenient, got {self.format!r}")
        if not self.timeout_s > 0 or self.workers < 1:
            raise RewardError("math_verify: timeout_s must be above 0 and workers at least 1")
        object.__setattr__(self, "verifier", MathVerifier(self.timeout_s, self.workers))

    def __call__(self, trajectory: Trajectory) -> RewardResult:
        golds, problem = reference_texts(trajectory, self.key)
        pred = final_answer(trajectory.final_answer)
        formatted = pred is not None and (pred.strict or self.format == "lenient")
        parts = {"correct": 0.0, "format": float(formatted), "answered": float(pred is not None),
                 "reference_ok": 1.0, "timeout": 0.0}
        if problem is not None:
            return self._result(parts, reference_ok=False, reason=f"unverifiable reference: {problem}")
        if pred is None:  # still say whether the reference could have been verified
            if all(self.verifier.check(latex_candidate(g), "").status == "unparsable_reference" for g in golds):
                return self._result(parts, reference_ok=False, reason="unverifiable reference: math-verify cannot parse it")
            return self._result(parts, reason="no final answer found in the completion")
        if len(pred.text) > MAX_ANSWER_CHARS:
            return self._result(parts, reason=f"the final answer is longer than {MAX_ANSWER_CHARS} characters")
        verdicts = []
        for gold in golds:
            verdict = self.verifier.check(latex_candidate(gold), latex_candidate(pred.text))
            verdicts.append(verdict)
            if verdict.equal:
                parts["correct"] = 1.0
                return self._result(parts)
        return self._failed(parts, verdicts)

    async def score_async(self, trajectory: Trajectory) -> RewardResult:
        """Scores in a thread (the check waits on a worker process), so the event loop runs on."""
        return await asyncio.to_thread(self, trajectory)

    def _failed(self, parts: dict[str, float], verdicts: list[Verdict]) -> RewardResult:
        if all(v.status == "unparsable_reference" for v in verdicts):
            return self._result(parts, reference_ok=False, reason="unverifiable reference: math-verify cannot parse it")
        odd = next((v for v in verdicts if v.status not in ("verified", "unparsable_reference")), None)
        if odd is None:
            return self._result(parts)  # verified: not equal
        parts["timeout"] = float(odd.status == "timeout")
        what = {"unparsable_answer": "math-verify cannot parse the final answer"}.get(odd.status, odd.detail)
        return self._result(parts, reason=f"{odd.status}: {what}")

    def _result(self, parts: dict[str, float], reference_ok: bool = True, reason: str | None = None) -> RewardResult:
        if not reference_ok:
            parts = {**parts, "reference_ok": 0.0, "format": 0.0}
        reward = self.correct_weight * parts["correct"] + self.format_weight * parts["format"] if reference_ok else 0.0
        return RewardResult(reward, parts, {"reason": reason} if reason else {})
