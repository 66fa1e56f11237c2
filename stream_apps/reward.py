"""The reward app: rollouts -> scored, with the reward strategy the control topic selects.

    astraflow app run reward --experiment EXP [--max-inflight 16] [--default reward=numeric]
    astraflow control set --experiment EXP reward reward numeric --param abs_tol=0.01

Slot `reward` (kind `reward`, default `exact_match`). Each trajectory is scored by the strategy
in force when it is taken from the topic; the scored copy carries the reward, its components
and a lineage entry `StrategyRef("reward", "reward", name, version)`, keyed like its input
(the group id).

Fast rewards (exact match, numeric, tool use) run inline, in input order. Slow rewards — those
with `score_async`, e.g. `code_tests`, which runs code in the sandbox — run concurrently, up to
`--max-inflight` at once per worker, without blocking the stream: the order of outputs is then
the order in which scoring finished, per key included (curate does not need order: it
assembles groups by id). A trajectory whose reference is unusable, or on which the strategy
raises, goes to the DLQ with the strategy's name; the app goes on.

A strategy that reads no token data (`reads_segments = False`: exact match, numeric, tool use)
gets its trajectories read without their segments, and the scored copy is the input's bytes
with the reward fields written again behind them (`stream_apps.reward_codec`): the token
arrays are neither decoded nor encoded.
"""

from __future__ import annotations

import math
from collections.abc import Awaitable
from typing import Any

from astraflow.dataflow.registry import Strategy
from astraflow.dataflow.rewards import RewardResult, with_reward
from astraflow.kafka.received import Received
from astraflow.records import Trajectory
from stream_apps.handler import AppHandler, StrategyFailed
from stream_apps.reward_codec import RewardCodec, Unscored
from stream_apps.slots import Slot, SlotDefault

DEFAULTS = {"reward": SlotDefault("exact_match")}


class RewardApp(AppHandler):
    """Scores trajectories (see the module doc)."""

    name = "reward"
    expect = Trajectory
    sources = ("rollouts",)

    def __init__(self, defaults: dict[str, SlotDefault] | None = None) -> None:
        self.defaults = {**DEFAULTS, **(defaults or {})}
        self.slot: Slot
        self.scored_topic = ""
        self.codec: RewardCodec | None = None  # the short path (module doc); None with a schema registry

    def bind(self, worker: Any) -> None:
        super().bind(worker)
        self.slot = Slot(worker.control, self.name, "reward", "reward", self.defaults["reward"])
        self.scored_topic = worker.topics.scored
        if worker.serde.framing == "single_object":  # the short path keeps the input's single-object framing
            self.codec = RewardCodec(worker.serde)

    def decode(self, inc: Received[Any]) -> Any:
        strategy = self.slot.get()
        if (self.codec is not None and strategy is not None and not getattr(strategy.impl, "reads_segments", True)
                and self.codec.applies(inc.value)):
            return self.codec.read(inc.value)  # type: ignore[arg-type]
        return super().decode(inc)

    def handle(self, inc: Received[Any]) -> Awaitable[None] | None:
        strategy = self.slot.get()
        assert strategy is not None  # the reward slot cannot be disabled
        if getattr(strategy.impl, "score_async", None) is not None:
            return self._score_async(inc, strategy)
        try:
            result = strategy(_trajectory(inc))
        except Exception as exc:  # a strategy (maybe a plug-in) may raise anything: DLQ it by name
            raise StrategyFailed(strategy.name, exc) from exc
        self._emit(inc, strategy, result)
        return None

    async def _score_async(self, inc: Received[Any], strategy: Strategy[Any]) -> None:
        try:
            result = await strategy.impl.score_async(_trajectory(inc))
        except Exception as exc:
            raise StrategyFailed(strategy.name, exc) from exc
        self._emit(inc, strategy, result)

    def _emit(self, inc: Received[Any], strategy: Strategy[Any], result: Any) -> None:
        if not isinstance(result, RewardResult) or not math.isfinite(result.reward):
            raise StrategyFailed(strategy.name, f"returned {result!r}; a reward must be a RewardResult with a finite reward")
        ref = strategy.ref(self.name, "reward")
        read = inc.record
        if isinstance(read, Unscored):
            assert self.codec is not None and inc.value is not None
            data = self.codec.scored(inc.value, read, result.reward, result.components, ref, result.notes)
            key = inc.key if inc.key is not None else read.trajectory.group_id
            self.worker.send_encoded(self.scored_topic, data, key)
            return
        traj: Trajectory = read
        scored = with_reward(traj, result, ref)
        self.worker.send(self.scored_topic, scored, inc.key if inc.key is not None else traj.group_id)

    def gauges(self) -> dict[str, float]:
        return {"control_version.reward": float(self.slot.version)}


def _trajectory(inc: Received[Any]) -> Trajectory:
    record = inc.record
    return record.trajectory if isinstance(record, Unscored) else record  # type: ignore[no-any-return]
