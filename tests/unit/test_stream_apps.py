"""The reward app and user processors driven by hand on a `FakeWorker` (tests/unit/stream_fakes.py),
without a broker; the datasets the curator reads."""

from __future__ import annotations

import asyncio
import io
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
from astraflow.serde import AvroSerde
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


# ---- the reward app's short path (stream_apps/reward_codec.py) ----------------------------------


def decoded(app: RewardApp, record: Trajectory, offset: int = 0) -> Any:
    """What the engine does with a record's bytes: the app decodes them, then handles the result."""
    inc = incoming(record, offset)
    inc.record = app.decode(inc)
    return inc


def test_reward_short_path_writes_the_bytes_of_the_full_path() -> None:
    from astraflow.dataflow.rewards import with_reward
    from astraflow.records import StrategyRef, ToolCall
    from stream_apps.reward_codec import Unscored

    serde = AvroSerde()
    for name, params in [("exact_match", {}), ("numeric", {"abs_tol": "0.001"}), ("tool_use", {})]:
        w = FakeWorker("reward")
        app = RewardApp()
        app.bind(w)
        w.control.set("reward", "reward", name, **params)
        for i, ans in enumerate(["4", "4.0000001", None]):
            t = scored_traj(i, ans or "")
            t.final_answer = ans
            t.lineage = [StrategyRef("node", "workflow", "math", 1)]
            t.metadata = {"k": "v"}
            t.tool_calls = [ToolCall(0, "calc", "{}", "4", 0.1, None if i else "boom")]
            inc = decoded(app, t, i)
            assert isinstance(inc.record, Unscored)  # read without its segments
            assert app.handle(inc) is None
            strategy = app.slot.get()
            assert strategy is not None and strategy.name == name
            full = with_reward(t, strategy(t), strategy.ref("reward", "reward"))  # the full path's record
            assert w.encoded[-1] == serde.dumps(full)
            got = w.sent[-1][1]
            assert got.reward == full.reward and got.segments[0].token_ids.tolist() == t.segments[0].token_ids.tolist()


def test_reward_reads_segments_for_strategies_that_may_read_them() -> None:
    from stream_apps.reward_codec import Unscored

    w = FakeWorker("reward")
    app = RewardApp()
    app.bind(w)
    w.control.set("reward", "reward", "unit_segment_reader")
    t = scored_traj(0, "4")
    inc = decoded(app, t)
    assert isinstance(inc.record, Trajectory) and inc.record.num_tokens == t.num_tokens > 0  # the full decode
    app.handle(inc)
    assert w.sent[-1][1].reward == float(t.num_tokens) and not w.encoded
    w.control.set("reward", "reward", "unit_segment_liar")  # says it reads none, reads them
    inc = decoded(app, scored_traj(1, "4"))
    assert isinstance(inc.record, Unscored)
    with pytest.raises(StrategyFailed) as info:
        app.handle(inc)
    assert info.value.strategy == "unit_segment_liar" and "without its segments" in str(info.value)


def test_reward_short_path_refuses_corrupt_records_and_leaves_others_to_the_full_decode() -> None:
    import fastavro

    from astraflow.errors import CorruptRecordError, SerdeError
    from astraflow.serde import SINGLE_OBJECT_MAGIC

    serde = AvroSerde()
    w = FakeWorker("reward")
    app = RewardApp()
    app.bind(w)
    data = serde.dumps(scored_traj(0, "4"))
    for bad in (data[:-30], data[: len(data) // 2], data + b"\x00"):
        inc = incoming(scored_traj(0, "4"))
        inc.value = bad
        with pytest.raises(SerdeError):
            app.decode(inc)
    inc = incoming(scored_traj(0, "4"))
    inc.value = data + b"\x00"
    with pytest.raises(CorruptRecordError, match="trailing"):
        app.decode(inc)
    # A trajectory written with the older schema version goes through the full decode (schema resolution).
    v1 = serde.catalog.versions(Trajectory.SCHEMA)[0]
    assert v1 is not serde.catalog.latest(Trajectory.SCHEMA)
    datum = scored_traj(0, "4").to_avro()
    datum.pop("temperature")
    out = io.BytesIO()
    fastavro.schemaless_writer(out, v1.parsed, datum)
    inc = incoming(scored_traj(0, "4"))
    inc.value = SINGLE_OBJECT_MAGIC + v1.fingerprint + out.getvalue()
    assert isinstance(app.decode(inc), Trajectory)


@register("reward", "unit_segment_reader", version=1)
@dataclass(frozen=True)
class SegmentReader:
    """Rewards the token count (reads the segments; declares nothing, so it gets them)."""

    def __call__(self, t: Trajectory) -> RewardResult:
        return RewardResult(float(t.num_tokens), {})


@register("reward", "unit_segment_liar", version=1)
@dataclass(frozen=True)
class SegmentLiar:
    """Declares that it reads no segments, then reads them."""

    reads_segments = False

    def __call__(self, t: Trajectory) -> RewardResult:
        return RewardResult(float(t.num_tokens), {})


def test_segments_are_stepped_over_in_both_block_forms() -> None:
    from stream_apps.reward_codec import _skip_segments

    def zz(v: int) -> bytes:  # an Avro long
        z, out = (v << 1) ^ (v >> 63), bytearray()
        while z >= 0x80:
            out.append((z & 0x7F) | 0x80)
            z >>= 7
        return bytes([*out, z])

    item = b"".join(zz(len(f)) + f for f in (b"a", b"assistant", b"\x01" * 300, b"", b"x" * 5, b"y", b""))
    plain = zz(2) + item + item + zz(0)  # a count, then the items
    sized = zz(-2) + zz(2 * len(item)) + item + item + zz(1) + item + zz(0)  # a negative count and a byte size
    for data in (plain, sized):
        assert _skip_segments(b"\x07" + data + b"tail", 1, 7) == 1 + len(data)
    for bad in (plain[:-3], zz(1) + zz(-3) + b"abc" + zz(0), sized[:5]):
        with pytest.raises((ValueError, IndexError)):
            _skip_segments(bad, 0, 7)
