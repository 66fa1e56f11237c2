"""Reward functions: Trajectory -> RewardResult (a float and named components).

The reference is JSON in `Trajectory.reference` (e.g. {"answer": "42"}, or {"answers": [...]} for
several accepted answers); the model's answer is `Trajectory.final_answer`. A missing or malformed
reference raises `RewardError` (the record belongs in the DLQ); a missing or unparsable model
answer scores 0.

Every reward is a small frozen object with `__call__(trajectory)`. Slow ones (code run in the
sandbox) also offer `async score_async(trajectory)`; `score_async(reward, trajectory)` awaits
that when present and calls the function directly otherwise, so a stream app can always await.
A reward that reads nothing of the token data says so with `reads_segments = False` (a class
attribute; absent means True): the reward app then reads its trajectories without their
segments (`stream_apps.reward_codec`).
"""

from __future__ import annotations

import asyncio
import json
import math
import re
from collections.abc import Mapping
from dataclasses import dataclass, field, replace
from typing import Any, ClassVar, Protocol

from astraflow.data.columns import last_boxed
from astraflow.dataflow.registry import REGISTRY, Strategy, register
from astraflow.errors import RewardError
from astraflow.records import StrategyRef, Trajectory

NOTE_PREFIX = "reward."  # metadata keys of a reward's notes
MAX_NOTE_CHARS = 500


@dataclass(frozen=True, slots=True)
class RewardResult:
    """A scalar reward and the named components it was made of (for metrics and weighting)."""

    reward: float  # the training signal
    components: dict[str, float] = field(default_factory=dict)  # named parts, e.g. {"exact_match": 1.0}
    notes: dict[str, str] = field(default_factory=dict)  # why, in words (e.g. {"reason": "reference unparsable"}):
    # written into the trajectory's metadata as `reward.<key>` (no new schema field)


class RewardFn(Protocol):
    """What a reward strategy is: a callable from a trajectory to its result."""

    def __call__(self, trajectory: Trajectory) -> RewardResult: ...


async def score_async(reward: RewardFn | Strategy[Any], trajectory: Trajectory) -> RewardResult:
    """Scores without blocking the event loop when the reward is slow (it then has `score_async`)."""
    impl = reward.impl if isinstance(reward, Strategy) else reward
    scorer = getattr(impl, "score_async", None)
    if scorer is not None:
        return await scorer(trajectory)
    return impl(trajectory)


def note_metadata(metadata: Mapping[str, str], notes: Mapping[str, str]) -> dict[str, str]:
    """`metadata` with a reward's notes as `reward.<key>` entries (earlier reward notes replaced)."""
    kept = {k: v for k, v in metadata.items() if not k.startswith(NOTE_PREFIX)} if notes else dict(metadata)
    return {**kept, **{NOTE_PREFIX + k: v[:MAX_NOTE_CHARS] for k, v in notes.items()}}


def with_reward(trajectory: Trajectory, result: RewardResult, ref: StrategyRef | None = None) -> Trajectory:
    """A copy of `trajectory` carrying the reward, its components, its notes (metadata `reward.<key>`)
    and (if given) the lineage entry."""
    lineage = [*trajectory.lineage, ref] if ref is not None else list(trajectory.lineage)
    return replace(
        trajectory, reward=result.reward, reward_components=dict(result.components), lineage=lineage,
        metadata=note_metadata(trajectory.metadata, result.notes),
    )


def load_reference(trajectory: Trajectory) -> dict[str, Any]:
    """The trajectory's reference JSON object; `RewardError` if absent or not a JSON object."""
    if not trajectory.reference:
        raise RewardError(f"trajectory {trajectory.trajectory_id} has no reference; the task must carry one")
    try:
        ref = json.loads(trajectory.reference)
    except json.JSONDecodeError as exc:
        raise RewardError(
            f"trajectory {trajectory.trajectory_id}: reference is not valid JSON: {exc}"
        ) from exc
    if not isinstance(ref, dict):
        raise RewardError(
            f"trajectory {trajectory.trajectory_id}: reference must be a JSON object, got {ref!r}"
        )
    return ref


def reference_answers(ref: Mapping[str, Any], key: str, trajectory_id: str) -> list[str]:
    """Accepted answers: ref[key] or the list ref[key + 's']."""
    if key in ref:
        return [str(ref[key])]
    many = ref.get(key + "s")
    if isinstance(many, list) and many:
        return [str(a) for a in many]
    raise RewardError(f"trajectory {trajectory_id}: reference has no {key!r} (nor a list {key + 's'!r})")


_ANSWER_PREFIX = re.compile(r"^(?:the\s+)?(?:final\s+)?answer\s*(?:is\s*)?:?\s*", re.IGNORECASE)


def normalize_answer(text: str) -> str:
    r"""Canonical form for exact match: \boxed{} content, no 'the answer is', lower case, single
    spaces, no surrounding $ or quotes, no trailing period."""
    s = text.strip()
    boxed = last_boxed(s)
    if boxed is not None:
        s = boxed
    s = _ANSWER_PREFIX.sub("", s.strip())
    s = re.sub(r"\s+", " ", s.strip().strip("$").strip()).lower()
    s = s.rstrip(".").strip()
    if len(s) >= 2 and s[0] == s[-1] and s[0] in "\"'`":
        s = s[1:-1].strip()
    return s


_NUMBER = re.compile(r"[-+]?(?:\d+(?:\.\d*)?|\.\d+)(?:[eE][-+]?\d+)?(?:\s*/\s*[-+]?\d+(?:\.\d*)?)?")
_FRAC = re.compile(r"\\[dt]?frac\{([^{}]+)\}\{([^{}]+)\}")


def parse_number(text: str) -> float | None:
    r"""The last number in `text` (after normalisation): 1,234.5 / -3e-2 / 3/4 / \frac{3}{4}; None if none."""
    s = _FRAC.sub(r"\1/\2", normalize_answer(text))
    s = re.sub(r"(?<=\d),(?=\d{3}\b)", "", s)
    matches = _NUMBER.findall(s)
    if not matches:
        return None
    token = matches[-1].replace(" ", "")
    if "/" in token:
        num, den = token.split("/")
        return float(num) / float(den) if float(den) != 0 else None
    return float(token)


@register("reward", "exact_match", version=1)
@dataclass(frozen=True, slots=True)
class ExactMatch:
    """1 if the normalised final answer equals a normalised reference answer, else 0."""

    reads_segments: ClassVar[bool] = False  # the reward app may read it without its token arrays

    normalize: bool = True  # compare normalize_answer() forms; False compares stripped text
    key: str = "answer"  # field of the reference JSON

    def __call__(self, trajectory: Trajectory) -> RewardResult:
        answers = reference_answers(load_reference(trajectory), self.key, trajectory.trajectory_id)
        if trajectory.final_answer is None:
            return RewardResult(0.0, {"exact_match": 0.0, "answered": 0.0})
        canon = normalize_answer if self.normalize else str.strip
        hit = canon(trajectory.final_answer) in {canon(a) for a in answers}
        return RewardResult(float(hit), {"exact_match": float(hit), "answered": 1.0})


@register("reward", "numeric", version=1)
@dataclass(frozen=True, slots=True)
class NumericMatch:
    """1 if the last number of the answer is within tolerance of a reference number, else 0."""

    reads_segments: ClassVar[bool] = False

    abs_tol: float = 1e-6  # absolute tolerance
    rel_tol: float = 1e-4  # relative tolerance (math.isclose semantics: either one suffices)
    key: str = "answer"  # field of the reference JSON

    def __call__(self, trajectory: Trajectory) -> RewardResult:
        answers = reference_answers(load_reference(trajectory), self.key, trajectory.trajectory_id)
        targets = [parse_number(a) for a in answers]
        if any(t is None for t in targets):
            raise RewardError(f"trajectory {trajectory.trajectory_id}: reference {answers!r} is not numeric")
        got = parse_number(trajectory.final_answer) if trajectory.final_answer is not None else None
        if got is None:
            return RewardResult(0.0, {"numeric_match": 0.0, "parsed": 0.0})
        error = min(abs(got - t) for t in targets if t is not None)
        hit = any(
            math.isclose(got, t, rel_tol=self.rel_tol, abs_tol=self.abs_tol) for t in targets if t is not None
        )
        return RewardResult(float(hit), {"numeric_match": float(hit), "parsed": 1.0, "abs_error": error})


@register("reward", "tool_use", version=1)
@dataclass(frozen=True, slots=True)
class ToolUse:
    """Fraction of tool calls that returned without error; `no_tool_reward` when none was made."""

    reads_segments: ClassVar[bool] = False

    no_tool_reward: float = 0.0  # reward of a trajectory that used no tool at all

    def __call__(self, trajectory: Trajectory) -> RewardResult:
        calls = trajectory.tool_calls
        if not calls:
            return RewardResult(
                self.no_tool_reward, {"used_tool": 0.0, "tool_success_rate": 0.0, "tool_calls": 0.0}
            )
        rate = sum(c.error is None for c in calls) / len(calls)
        return RewardResult(
            rate, {"used_tool": 1.0, "tool_success_rate": rate, "tool_calls": float(len(calls))}
        )


@register("reward", "weighted", version=1)
@dataclass(frozen=True, slots=True)
class Weighted:
    """Sum of named reward strategies times their weights; components keep every part.

    weights={"exact_match": 1.0, "tool_use": 0.2}, params={"exact_match": {"normalize": false}}.
    Component names: '<name>' (that reward) and '<name>.<component>' (its components).
    """

    weights: Mapping[str, float]  # reward strategy name -> weight
    params: Mapping[str, Mapping[str, Any]] = field(default_factory=dict)  # name -> its params
    parts: dict[str, Strategy[Any]] = field(init=False, repr=False, compare=False)  # built sub-rewards

    def __post_init__(self) -> None:
        if not self.weights:
            raise RewardError("weighted reward needs at least one component in 'weights'")
        unknown = set(self.params) - set(self.weights)
        if unknown:
            raise RewardError(f"weighted reward: params given for {sorted(unknown)}, which have no weight")
        parts = {n: REGISTRY.get("reward", n, **dict(self.params.get(n, {}))) for n in self.weights}
        object.__setattr__(self, "parts", parts)

    @property
    def reads_segments(self) -> bool:
        return any(getattr(p.impl, "reads_segments", True) for p in self.parts.values())

    def combine(self, results: Mapping[str, RewardResult]) -> RewardResult:
        total = 0.0
        components: dict[str, float] = {}
        notes: dict[str, str] = {}
        for name, weight in self.weights.items():
            r = results[name]
            total += weight * r.reward
            components[name] = r.reward
            components.update({f"{name}.{k}": v for k, v in r.components.items()})
            notes.update({f"{name}.{k}": v for k, v in r.notes.items()})
        return RewardResult(total, components, notes)

    def __call__(self, trajectory: Trajectory) -> RewardResult:
        return self.combine({name: part(trajectory) for name, part in self.parts.items()})

    async def score_async(self, trajectory: Trajectory) -> RewardResult:
        names = list(self.parts)
        results = await asyncio.gather(*(score_async(self.parts[n], trajectory) for n in names))
        return self.combine(dict(zip(names, results, strict=True)))
