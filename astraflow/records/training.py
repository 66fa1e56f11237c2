"""Training-side records: TrainSample (curate -> trainer), PolicyVersion and WeightChunk (trainer -> RaaS)."""

from __future__ import annotations

import enum
from dataclasses import dataclass, field
from typing import Any, ClassVar

import numpy as np

from astraflow.records.base import FLOAT32, INT32, UINT8, FlatRecord, field_names, now_ms, pack, unpack
from astraflow.records.rollout import StrategyRef


@dataclass(slots=True)
class TrainSample:
    """One sequence to train one policy on, with behaviour logprobs and an advantage."""

    SCHEMA: ClassVar[str] = "astraflow.TrainSample"

    sample_id: str
    trajectory_id: str
    group_id: str
    prompt_id: str
    policy: str
    token_ids: np.ndarray  # int32, whole sequence
    loss_mask: np.ndarray  # uint8, 1 where this policy generated the token
    behaviour_logprobs: np.ndarray  # float32
    versions: np.ndarray  # int32, -1 where masked
    advantage: float
    reward: float
    min_version: int  # oldest version among trained tokens
    lineage: list[StrategyRef] = field(default_factory=list)
    created_at: int = field(default_factory=now_ms)
    temperature: float = 1.0  # sampling temperature of the behaviour logprobs (schema v2; v1 reads as 1.0)

    def to_avro(self) -> dict[str, Any]:
        return {
            "sample_id": self.sample_id,
            "trajectory_id": self.trajectory_id,
            "group_id": self.group_id,
            "prompt_id": self.prompt_id,
            "policy": self.policy,
            "token_ids": pack(self.token_ids, INT32),
            "loss_mask": pack(self.loss_mask, UINT8),
            "behaviour_logprobs": pack(self.behaviour_logprobs, FLOAT32),
            "versions": pack(self.versions, INT32),
            "advantage": self.advantage,
            "reward": self.reward,
            "min_version": self.min_version,
            "lineage": [s.to_avro() for s in self.lineage],
            "created_at": self.created_at,
            "temperature": self.temperature,
        }

    @classmethod
    def from_avro(cls, d: dict[str, Any]) -> TrainSample:
        return cls(
            sample_id=d["sample_id"],
            trajectory_id=d["trajectory_id"],
            group_id=d["group_id"],
            prompt_id=d["prompt_id"],
            policy=d["policy"],
            token_ids=unpack(d["token_ids"], INT32),
            loss_mask=unpack(d["loss_mask"], UINT8),
            behaviour_logprobs=unpack(d["behaviour_logprobs"], FLOAT32),
            versions=unpack(d["versions"], INT32),
            advantage=d["advantage"],
            reward=d["reward"],
            min_version=d["min_version"],
            lineage=[StrategyRef.from_avro(s) for s in d["lineage"]],
            created_at=d["created_at"],
            temperature=float(d.get("temperature", 1.0)),
        )


class WeightKind(enum.StrEnum):
    """Whether a version's payload is a whole state dict or a delta against `base_version`."""

    SNAPSHOT = "SNAPSHOT"
    DELTA = "DELTA"


@dataclass(slots=True)
class PolicyVersion:
    """Manifest of one published version; chunks follow in-band, or `uri` points to the store."""

    SCHEMA: ClassVar[str] = "astraflow.PolicyVersion"

    policy: str
    version: int
    kind: WeightKind
    dtype: str
    num_chunks: int
    payload_bytes: int
    sha256: str
    state_checksum: str
    trainer_step: int
    trained_samples: int
    base_version: int | None = None
    uri: str | None = None
    latest_snapshot: int | None = None
    latest_snapshot_uri: str | None = None
    metadata: dict[str, str] = field(default_factory=dict)
    created_at: int = field(default_factory=now_ms)

    def to_avro(self) -> dict[str, Any]:
        d = {name: getattr(self, name) for name in field_names(PolicyVersion)}
        d["kind"] = str(self.kind)
        return d

    @classmethod
    def from_avro(cls, d: dict[str, Any]) -> PolicyVersion:
        kw = {name: d[name] for name in field_names(cls)}
        kw["kind"] = WeightKind(kw["kind"])
        return cls(**kw)


@dataclass(slots=True)
class WeightChunk(FlatRecord):
    """A slice of an in-band weight payload."""

    SCHEMA: ClassVar[str] = "astraflow.WeightChunk"

    policy: str
    version: int
    index: int
    count: int
    data: bytes
    crc32: int
