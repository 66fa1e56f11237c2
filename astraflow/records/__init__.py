"""Typed Python counterparts of the Avro schemas in `schemas/`.

Each record is a small dataclass with `to_avro()` (a dict the serde's compiled encoder writes)
and `from_avro(d)` (from what fastavro's reader decoded). Token arrays are numpy arrays; on the
wire they are packed little-endian bytes, and `from_avro` wraps those bytes without copying. Timestamps are
integer milliseconds since the epoch (the serde strips Avro logical types internally, so no
datetime conversion costs time on the hot path).
"""

from astraflow.records.base import Record, now_ms
from astraflow.records.ops import Control, DeadLetter, GroupDropped, Metric, PromptStats, TrainedSamples
from astraflow.records.rollout import (
    NodeInfo,
    SamplingParams,
    Segment,
    StrategyRef,
    Task,
    Timings,
    ToolCall,
    Trajectory,
    TrajectoryStatus,
)
from astraflow.records.training import PolicyVersion, TrainSample, WeightChunk, WeightKind

RECORD_TYPES: dict[str, type[Record]] = {
    cls.SCHEMA: cls
    for cls in (Task, Trajectory, TrainSample, PolicyVersion, WeightChunk, Control, PromptStats, Metric, DeadLetter,
                GroupDropped, TrainedSamples)
}

__all__ = [
    "RECORD_TYPES",
    "Control",
    "DeadLetter",
    "GroupDropped",
    "Metric",
    "NodeInfo",
    "PolicyVersion",
    "PromptStats",
    "Record",
    "SamplingParams",
    "Segment",
    "StrategyRef",
    "Task",
    "Timings",
    "ToolCall",
    "TrainSample",
    "TrainedSamples",
    "Trajectory",
    "TrajectoryStatus",
    "WeightChunk",
    "WeightKind",
    "now_ms",
]
