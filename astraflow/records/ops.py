"""Operational records: Control (operators -> everyone), PromptStats (curate -> curator),
Metric (everyone -> status), DeadLetter (everyone -> operators), and the lineage records that
`astraflow trace` follows: GroupDropped (curate) and TrainedSamples (trainer)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import ClassVar

from astraflow.records.base import FlatRecord, now_ms


@dataclass(slots=True)
class Control(FlatRecord):
    """Selects a strategy (or value) for one slot of one app; keyed '<app>/<slot>' on a compacted topic."""

    SCHEMA: ClassVar[str] = "astraflow.Control"

    app: str
    slot: str
    strategy: str
    version: int
    params: dict[str, str] = field(default_factory=dict)
    issued_by: str = ""
    issued_at: int = field(default_factory=now_ms)

    @property
    def key(self) -> str:
        return f"{self.app}/{self.slot}"


@dataclass(slots=True)
class PromptStats(FlatRecord):
    """Running statistics of one prompt for one policy, which curators choose prompts from."""

    SCHEMA: ClassVar[str] = "astraflow.PromptStats"

    prompt_id: str
    dataset: str
    policy: str
    groups: int
    samples: int
    last_pass_rate: float
    pass_rate_ewma: float
    reward_mean: float
    reward_std: float
    mean_length: float
    zero_variance_streak: int
    last_version: int
    updated_at: int = field(default_factory=now_ms)


@dataclass(slots=True)
class Metric(FlatRecord):
    """One measurement of one component instance."""

    SCHEMA: ClassVar[str] = "astraflow.Metric"

    name: str
    value: float
    component: str
    instance: str
    labels: dict[str, str] = field(default_factory=dict)
    ts: int = field(default_factory=now_ms)


@dataclass(slots=True)
class DeadLetter(FlatRecord):
    """A record that could not be handled: original bytes, origin, and the reason."""

    SCHEMA: ClassVar[str] = "astraflow.DeadLetter"

    original: bytes | None
    topic: str
    partition: int
    offset: int
    error_class: str
    error: str
    component: str
    original_key: bytes | None = None
    strategy: str | None = None
    headers: dict[str, str] = field(default_factory=dict)
    ts: int = field(default_factory=now_ms)


@dataclass(slots=True)
class GroupDropped(FlatRecord):
    """Trajectories of a group that curate dropped instead of training on them, and why (on `lineage`)."""

    SCHEMA: ClassVar[str] = "astraflow.GroupDropped"

    group_id: str
    task_id: str
    prompt_id: str
    policy: str
    trajectory_ids: list[str]
    component: str
    filter: str  # the slot (filter.zero_variance, ...) or rule (timeout)
    strategy: str  # the strategy in the slot, or the rule's name
    reason: str
    ts: int = field(default_factory=now_ms)


@dataclass(slots=True)
class TrainedSamples(FlatRecord):
    """Samples first carried by a published version, with the trainer step of each (on `lineage`,
    in the transaction that publishes the version)."""

    SCHEMA: ClassVar[str] = "astraflow.TrainedSamples"

    policy: str
    version: int
    trainer_step: int
    instance: str
    sample_ids: list[str]
    steps: list[int]
    part: int = 0
    parts: int = 1
    ts: int = field(default_factory=now_ms)
