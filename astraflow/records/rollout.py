"""Rollout records: Task (what to roll out) and Trajectory (what came back)."""

from __future__ import annotations

import enum
from dataclasses import dataclass, field, replace
from typing import Any, ClassVar

import numpy as np

from astraflow.records.base import FLOAT32, INT32, UINT8, FlatRecord, now_ms, pack, unpack


@dataclass(slots=True)
class StrategyRef(FlatRecord):
    """Lineage entry: the strategy (and its version) that an app slot applied to a record."""

    app: str
    slot: str
    name: str
    version: int


@dataclass(slots=True)
class SamplingParams(FlatRecord):
    """Decoding parameters for every model call of a task."""

    temperature: float = 1.0  # 0 means greedy
    top_p: float = 1.0  # nucleus sampling mass
    max_tokens: int = 256  # per model call
    stop: list[str] = field(default_factory=list)  # stop strings, checked on decoded text
    max_turns: int = 1  # model turns allowed in multi-turn workflows


@dataclass(slots=True)
class Task:
    """A prompt to sample `n_samples` times as one group (see schemas/task)."""

    SCHEMA: ClassVar[str] = "astraflow.Task"

    task_id: str
    group_id: str
    prompt_id: str
    dataset: str
    workflow: str
    prompt: str
    policies: list[str]
    n_samples: int
    reference: str | None = None  # JSON the reward needs
    sampling: SamplingParams = field(default_factory=SamplingParams)
    metadata: dict[str, str] = field(default_factory=dict)
    lineage: list[StrategyRef] = field(default_factory=list)
    created_at: int = field(default_factory=now_ms)

    def to_avro(self) -> dict[str, Any]:
        return {
            "task_id": self.task_id,
            "group_id": self.group_id,
            "prompt_id": self.prompt_id,
            "dataset": self.dataset,
            "workflow": self.workflow,
            "prompt": self.prompt,
            "reference": self.reference,
            "policies": list(self.policies),
            "n_samples": self.n_samples,
            "sampling": self.sampling.to_avro(),
            "metadata": dict(self.metadata),
            "lineage": [s.to_avro() for s in self.lineage],
            "created_at": self.created_at,
        }

    def copy(self) -> Task:
        """A copy sharing nothing mutable with this task: its lists, dict and nested records are new
        (strings and numbers are immutable), so changes to one never reach the other."""
        return replace(self, policies=list(self.policies), sampling=replace(self.sampling, stop=list(self.sampling.stop)),
                       metadata=dict(self.metadata), lineage=[replace(ref) for ref in self.lineage])

    @classmethod
    def from_avro(cls, d: dict[str, Any]) -> Task:
        # Positional, in field order; the lists and dicts are fresh from the decoder (no copies).
        return cls(d["task_id"], d["group_id"], d["prompt_id"], d["dataset"], d["workflow"], d["prompt"],
                   d["policies"], d["n_samples"], d["reference"], SamplingParams.from_avro(d["sampling"]),
                   d["metadata"], [StrategyRef.from_avro(s) for s in d["lineage"]], d["created_at"])


class Segment:
    """A run of tokens with one policy and role; arrays are numpy, packed on the wire.

    Decoded segments keep the wire bytes and wrap them as numpy arrays only when an array is
    first read (zero-copy either way); re-encoding an untouched array reuses its bytes, so an
    app that passes trajectories through (reward, curate) never copies token arrays.
    """

    __slots__ = ("_logprobs", "_loss_mask", "_raw", "_token_ids", "_versions", "policy", "role", "text")

    _ARRAYS = (("token_ids", INT32), ("logprobs", FLOAT32), ("loss_mask", UINT8), ("versions", INT32))

    def __init__(self, policy: str, role: str, token_ids: Any, logprobs: Any, loss_mask: Any, versions: Any,
                 text: str = "") -> None:
        self.policy = policy  # policy that generated (or, for context, is trained with) these tokens
        self.role = role  # prompt | assistant | tool | user | system
        self._token_ids = np.asarray(token_ids, dtype=INT32)  # int32 ids
        self._logprobs = np.asarray(logprobs, dtype=FLOAT32)  # behaviour logprobs (0 where not sampled)
        self._loss_mask = np.asarray(loss_mask, dtype=UINT8)  # 1 = trained on
        self._versions = np.asarray(versions, dtype=INT32)  # policy version per token (-1 where not sampled)
        self._raw: dict[str, bytes] | None = None  # wire bytes of arrays not yet materialised
        self.text = text  # decoded text, for people and text rewards

    def _get(self, name: str, dtype: np.dtype) -> np.ndarray:
        arr = getattr(self, "_" + name)
        if arr is None:
            arr = unpack(self._raw[name], dtype)  # type: ignore[index]
            setattr(self, "_" + name, arr)
        return arr

    token_ids = property(lambda self: self._get("token_ids", INT32), lambda self, v: self._set("token_ids", v, INT32))
    logprobs = property(lambda self: self._get("logprobs", FLOAT32), lambda self, v: self._set("logprobs", v, FLOAT32))
    loss_mask = property(lambda self: self._get("loss_mask", UINT8), lambda self, v: self._set("loss_mask", v, UINT8))
    versions = property(lambda self: self._get("versions", INT32), lambda self, v: self._set("versions", v, INT32))

    def _set(self, name: str, value: Any, dtype: np.dtype) -> None:
        setattr(self, "_" + name, np.asarray(value, dtype=dtype))
        if self._raw is not None:
            self._raw.pop(name, None)

    @classmethod
    def context(cls, policy: str, role: str, token_ids: Any, text: str = "") -> Segment:
        """A segment of tokens the policy did not sample (prompt, tool output): masked out."""
        ids = np.asarray(token_ids, dtype=INT32)
        n = len(ids)
        return cls(policy, role, ids, np.zeros(n, FLOAT32), np.zeros(n, UINT8), np.full(n, -1, INT32), text)

    def __len__(self) -> int:
        if self._token_ids is None:
            return len(self._raw["token_ids"]) // 4  # type: ignore[index]
        return len(self._token_ids)

    def __repr__(self) -> str:
        return f"Segment(policy={self.policy!r}, role={self.role!r}, tokens={len(self)}, text={self.text[:40]!r})"

    def __eq__(self, other: object) -> bool:
        if not isinstance(other, Segment):
            return NotImplemented
        return (self.policy, self.role, self.text) == (other.policy, other.role, other.text) and all(
            np.array_equal(getattr(self, n), getattr(other, n)) for n, _ in self._ARRAYS)

    __hash__ = None  # type: ignore[assignment]

    def to_avro(self) -> dict[str, Any]:
        raw = self._raw
        if raw is None:  # the arrays already have their wire dtypes (constructor, setters): bytes as they are
            return {"policy": self.policy, "role": self.role, "text": self.text,
                    "token_ids": self._token_ids.tobytes(), "logprobs": self._logprobs.tobytes(),  # type: ignore[union-attr]
                    "loss_mask": self._loss_mask.tobytes(), "versions": self._versions.tobytes()}  # type: ignore[union-attr]
        out: dict[str, Any] = {"policy": self.policy, "role": self.role, "text": self.text}
        for name, dtype in self._ARRAYS:
            cached = raw.get(name)
            out[name] = cached if cached is not None else pack(getattr(self, "_" + name), dtype)
        return out

    @classmethod
    def from_avro(cls, d: dict[str, Any]) -> Segment:
        seg = cls.__new__(cls)
        seg.policy, seg.role, seg.text = d["policy"], d["role"], d["text"]
        seg._raw = {"token_ids": d["token_ids"], "logprobs": d["logprobs"], "loss_mask": d["loss_mask"],
                    "versions": d["versions"]}
        seg._token_ids = seg._logprobs = seg._loss_mask = seg._versions = None
        return seg


@dataclass(slots=True)
class ToolCall(FlatRecord):
    """One tool invocation inside a rollout; failures are recorded, never fatal."""

    turn: int
    name: str
    arguments: str
    result: str
    latency_s: float
    error: str | None = None


class TrajectoryStatus(enum.StrEnum):
    """How a rollout ended."""

    OK = "OK"
    TRUNCATED = "TRUNCATED"
    ERROR = "ERROR"


_STATUS = {s.value: s for s in TrajectoryStatus}  # faster than calling the enum per record


@dataclass(slots=True)
class Timings(FlatRecord):
    """Wall-clock milestones (ms since epoch) and time spent (s) of a rollout."""

    queued_at: int
    started_at: int
    finished_at: int
    generate_s: float = 0.0
    tool_s: float = 0.0


@dataclass(slots=True)
class NodeInfo(FlatRecord):
    """Which RaaS node produced a trajectory, on what hardware, where, with which backend."""

    node_id: str
    hardware: str
    region: str
    backend: str


@dataclass(slots=True)
class Trajectory:
    """One sample of one task: segments, tool calls, reward and provenance (see schemas/trajectory)."""

    SCHEMA: ClassVar[str] = "astraflow.Trajectory"

    trajectory_id: str
    task_id: str
    group_id: str
    prompt_id: str
    dataset: str
    workflow: str
    sample_index: int
    group_size: int
    segments: list[Segment]
    timings: Timings
    node: NodeInfo
    tool_calls: list[ToolCall] = field(default_factory=list)
    final_answer: str | None = None
    reference: str | None = None
    status: TrajectoryStatus = TrajectoryStatus.OK
    error: str | None = None
    reward: float | None = None
    reward_components: dict[str, float] = field(default_factory=dict)
    lineage: list[StrategyRef] = field(default_factory=list)
    metadata: dict[str, str] = field(default_factory=dict)
    created_at: int = field(default_factory=now_ms)
    temperature: float = 1.0  # sampling temperature of its model calls (schema v2; v1 reads as 1.0)

    @staticmethod
    def make_id(task_id: str, sample_index: int) -> str:
        """Deterministic id, so a redelivered task yields the same trajectory ids."""
        return f"{task_id}/{sample_index}"

    @property
    def num_tokens(self) -> int:
        return sum(len(s) for s in self.segments)

    def trained_versions(self) -> dict[str, tuple[int, int]]:
        """Per policy that trained tokens (loss_mask 1) here: the (oldest, newest) version among them."""
        out: dict[str, tuple[int, int]] = {}
        for seg in self.segments:
            mask = seg.loss_mask
            if not mask.any():
                continue
            v = seg.versions if mask.all() else seg.versions[mask.astype(bool)]
            lo, hi = int(v.min()), int(v.max())
            old = out.get(seg.policy)
            out[seg.policy] = (lo, hi) if old is None else (min(old[0], lo), max(old[1], hi))
        return out

    def to_avro(self) -> dict[str, Any]:
        return {
            "trajectory_id": self.trajectory_id,
            "task_id": self.task_id,
            "group_id": self.group_id,
            "prompt_id": self.prompt_id,
            "dataset": self.dataset,
            "workflow": self.workflow,
            "sample_index": self.sample_index,
            "group_size": self.group_size,
            "segments": [s.to_avro() for s in self.segments],
            "tool_calls": [t.to_avro() for t in self.tool_calls],
            "final_answer": self.final_answer,
            "reference": self.reference,
            "status": self.status.value,
            "error": self.error,
            "reward": self.reward,
            "reward_components": self.reward_components,  # read, never kept, by the encoder
            "timings": self.timings.to_avro(),
            "node": self.node.to_avro(),
            "lineage": [s.to_avro() for s in self.lineage],
            "metadata": self.metadata,
            "created_at": self.created_at,
            "temperature": self.temperature,
        }

    @classmethod
    def from_avro(cls, d: dict[str, Any]) -> Trajectory:
        # Positional, in field order; the lists and dicts are fresh from the decoder (no copies).
        return cls(
            d["trajectory_id"], d["task_id"], d["group_id"], d["prompt_id"], d["dataset"], d["workflow"],
            d["sample_index"], d["group_size"], [Segment.from_avro(s) for s in d["segments"]],
            Timings.from_avro(d["timings"]), NodeInfo.from_avro(d["node"]),
            [ToolCall.from_avro(t) for t in d["tool_calls"]], d["final_answer"], d["reference"], _STATUS[d["status"]],
            d["error"], d["reward"], d["reward_components"], [StrategyRef.from_avro(s) for s in d["lineage"]],
            d["metadata"], d["created_at"], float(d.get("temperature", 1.0)),
        )
