"""The reward app and user processors driven by hand on a `FakeWorker` (tests/unit/stream_fakes.py),
without a broker; the datasets the curator reads."""

from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass
from typing import Any

import pytest
from stream_fakes import EXP, FakeWorker, incoming

import astraflow
from astraflow.dataflow.registry import register
from astraflow.dataflow.rewards import RewardResult
from astraflow.kafka.topics import Topics
from astraflow.records import Trajectory
from astraflow.testing import make_trajectory
from stream_apps.handler import StrategyFailed
from stream_apps.process import ProcessorApp
from stream_apps.reward import RewardApp


def scored_traj(i: int, answer: str, group: str = "g", size: int = 4, reference: str = '{"answer": "4"}') -> Trajectory:
    t = make_trajectory(64, task_id=group, sample_index=i, group_size=size, seed=i)
    t.final_answer, t.reference = answer, reference
    return t


def test_reward_scores_with_lineage_and_swaps_strategy_for_later_records_only() -> None:
    w = FakeWorker("reward")
    app = RewardApp()
    app.bind(w)
    for i, ans in enumerate(["4", "4.0000001", "five"]):
        assert app.handle(incoming(scored_traj(i, ans), i)) is None  # fast rewards run inline
    w.control.set("reward", "reward", "numeric", abs_tol="0.001")  # the hot swap
    for i, ans in enumerate(["4", "4.0000001", "five"], start=3):
        app.handle(incoming(scored_traj(i, ans), i))
    names = [out.lineage[-1].name for _, out, _ in w.sent]
    rewards = [out.reward for _, out, _ in w.sent]
    assert names == ["exact_match"] * 3 + ["numeric"] * 3
    assert rewards == [1.0, 0.0, 0.0, 1.0, 1.0, 0.0]
    assert all(topic == Topics(EXP).scored and key == b"g-g" for topic, _, key in w.sent)
    assert w.sent[0][1].reward_components["exact_match"] == 1.0


def test_reward_raising_strategy_is_named_in_the_failure() -> None:
    app = RewardApp()
    app.bind(FakeWorker("reward"))
    bad = scored_traj(0, "4", reference="not json {")
    with pytest.raises(StrategyFailed) as info:
        app.handle(incoming(bad))
    assert info.value.strategy == "exact_match" and "RewardError" in str(info.value)


@register("reward", "unit_slow_reward", version=1)
@dataclass(frozen=True)
class SlowReward:
    """Sleeps `delay_s` in score_async, then gives 1 (a stand-in for sandboxed code)."""

    delay_s: float = 0.2

    def __call__(self, trajectory: Trajectory) -> RewardResult:
        time.sleep(self.delay_s)
        return RewardResult(1.0)

    async def score_async(self, trajectory: Trajectory) -> RewardResult:
        SLOW_RUNNING[0] += 1
        SLOW_RUNNING[1] = max(SLOW_RUNNING[1], SLOW_RUNNING[0])
        try:
            await asyncio.sleep(self.delay_s)
        finally:
            SLOW_RUNNING[0] -= 1
        return RewardResult(1.0, {"slow": 1.0})


SLOW_RUNNING = [0, 0]  # [running now, most at once] across SlowReward.score_async calls


def test_slow_rewards_return_awaitables_that_run_concurrently() -> None:
    w = FakeWorker("reward")
    app = RewardApp()
    app.bind(w)
    w.control.set("reward", "reward", "unit_slow_reward", delay_s="0.3")
    pending = [app.handle(incoming(scored_traj(i, "x"), i)) for i in range(8)]
    assert all(asyncio.iscoroutine(p) for p in pending)

    async def run_all() -> None:
        await asyncio.gather(*pending)

    SLOW_RUNNING[:] = [0, 0]
    asyncio.run(run_all())
    assert len(w.sent) == 8 and all(out.reward_components == {"slow": 1.0} for _, out, _ in w.sent)
    assert SLOW_RUNNING[1] == 8  # overlapped, not one after another


@astraflow.processor(source="scored", sink="picked", version=3)
def pick(t: Trajectory) -> Any:
    if t.sample_index == 0:
        return None
    if t.sample_index == 1:
        return [t, astraflow.Emit(t, key="k2", topic="other")]
    if t.sample_index == 2:
        raise ValueError("no")
    return t


def test_processor_outputs_drops_and_failures() -> None:
    w = FakeWorker("proc.pick")
    app = ProcessorApp(pick)
    app.worker, app.sink = w, Topics(EXP).stream("picked")
    assert app.name == "proc.pick" and app.sources == ("scored",)
    for i in (0, 1, 3):
        app.handle(incoming(scored_traj(i, "4"), i))
    with pytest.raises(StrategyFailed) as info:
        app.handle(incoming(scored_traj(2, "4"), 2))
    assert info.value.strategy == "pick"
    assert w.dropped["pick"] == 1
    assert [(topic, key) for topic, _, key in w.sent] == [
        ("af.unit.picked", b"g-g"), ("af.unit.other", "k2"), ("af.unit.picked", b"g-g")]
    assert w.sent[0][1].lineage[-1].name.endswith("pick") and w.sent[0][1].lineage[-1].version == 3


@astraflow.processor(source="rollouts", sink="out")
async def async_double(t: Trajectory) -> list[Trajectory]:
    await asyncio.sleep(0)
    return [t, t]


def test_async_processor_returns_an_awaitable() -> None:
    w = FakeWorker("proc.async-double")
    app = ProcessorApp(async_double)
    app.worker, app.sink = w, "af.unit.out"
    asyncio.run(app.handle(incoming(scored_traj(0, "4"))))  # type: ignore[arg-type]
    assert len(w.sent) == 2


def test_datasets_from_jsonl_and_parquet(tmp_path: Any) -> None:
    import json

    import pyarrow as pa
    import pyarrow.parquet as pq

    from astraflow.errors import ConfigError
    from stream_apps.datasets import load_datasets

    j = tmp_path / "math.jsonl"
    j.write_text(json.dumps({"prompt": "1+1?", "reference": {"answer": "2"}, "id": "m1", "difficulty": 2}) + "\n\n"
                 + json.dumps({"prompt": "2+2?", "reference": "4"}) + "\n")
    pq.write_table(pa.Table.from_pylist([{"prompt": "code", "answer": "x", "dataset": "code", "workflow": "code"}]),
                   tmp_path / "c.parquet")
    rows = load_datasets([j, tmp_path / "c.parquet"])
    assert [r.prompt.prompt_id for r in rows] == ["m1", "math/1", "code/0"]
    assert [r.reference for r in rows] == ['{"answer": "2"}', '{"answer": "4"}', '{"answer": "x"}']
    assert rows[0].prompt.difficulty == 2.0 and rows[2].prompt.dataset == "code" and rows[2].workflow == "code"
    with pytest.raises(ConfigError, match="twice"):
        load_datasets([j, j])
    (tmp_path / "bad.jsonl").write_text('{"answer": 1}\n')
    with pytest.raises(ConfigError, match="prompt"):
        load_datasets([tmp_path / "bad.jsonl"])
