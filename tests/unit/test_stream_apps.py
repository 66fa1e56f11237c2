"""App handlers (reward, curate, curator, user processors) driven by hand, without a broker.

`FakeWorker` stands in for `StreamEngine`: it records what a handler sends, drops and
dead-letters, keeps the app's tables in plain dicts, and serves a `ControlState` the test
changes (the hot swap, minus Kafka). The Faust wiring itself is tested in test_stream_engine.py.
"""

from __future__ import annotations

import asyncio
import time
from collections import Counter
from dataclasses import dataclass
from typing import Any

import numpy as np
import pytest

import astraflow
from astraflow.control import ControlState
from astraflow.dataflow.registry import register
from astraflow.dataflow.rewards import RewardResult
from astraflow.kafka.topics import Topics
from astraflow.records import Control, PolicyVersion, PromptStats, Segment, Trajectory, WeightKind
from astraflow.serde import AvroSerde
from astraflow.testing import make_trajectory
from stream_apps.curate import CurateApp
from stream_apps.curator import CuratorApp, CuratorOptions, tasks_ahead
from stream_apps.groups import Group
from stream_apps.handler import Incoming, StrategyFailed
from stream_apps.process import ProcessorApp
from stream_apps.reward import RewardApp
from stream_apps.slots import Slot

EXP = "unit"


class FakeControl:
    def __init__(self) -> None:
        self.state = ControlState()
        self.version = 0

    @property
    def generation(self) -> int:
        return self.state.generation

    def get_for(self, app: str, slot: str) -> Control | None:
        return self.state.get(app, slot)

    def set(self, app: str, slot: str, strategy: str, **params: str) -> None:
        self.version += 1
        self.state.apply(f"{app}/{slot}", Control(app, slot, strategy, self.version, params, issued_at=0))


class FakeWorker:
    def __init__(self, app_name: str) -> None:
        self.app_name = app_name
        self.control = FakeControl()
        self.control.get = lambda slot: self.control.state.get(app_name, slot)  # type: ignore[attr-defined]
        self.topics = Topics(EXP)
        self.sent: list[tuple[str, Any, Any]] = []
        self.side: list[tuple[str, Any, Any]] = []
        self.dropped: Counter[str] = Counter()
        self.dead: list[tuple[Any, str, str | None]] = []
        self.stopped = False
        self.serde = AvroSerde()
        self.source = self.topics.scored
        self.tables: dict[str, dict[bytes, bytes]] = {"groups": {}, "members": {}, "emitted": {}}

    def send(self, topic: str, record: Any, key: Any = None) -> None:
        self.sent.append((topic, record, key))

    def send_side(self, topic: str, record: Any, key: Any = None) -> None:
        self.side.append((topic, record, key))

    def drop(self, reason: str, n: int = 1) -> None:
        self.dropped[reason] += n

    def dead_letter(self, inc: Incoming, error: Any, strategy: str | None = None) -> None:
        self.dead.append((inc, str(error), strategy))

    def table(self, name: str) -> dict[bytes, bytes]:
        return self.tables[name]

    def assigned(self) -> set[int]:
        return {0}

    async def in_partition(self, partition: int, fn: Any) -> Any:
        return fn()

    def stop(self) -> None:
        self.stopped = True


def incoming(record: Any, offset: int = 0, partition: int = 0) -> Incoming:
    return Incoming(record, "src", partition, offset, getattr(record, "group_id", "k").encode(), 0,
                    AvroSerde().dumps(record), {}, 1)


# ---- reward ------------------------------------------------------------------------------------


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


# ---- curate ------------------------------------------------------------------------------------


def two_policy_traj(group: str, i: int, size: int, reward: float, with_b: bool, version: int = 2) -> Trajectory:
    segs = [Segment.context("a", "prompt", [1, 2]), _gen("a", [3, 4, 5], version)]
    if with_b:
        segs.append(_gen("b", [6, 7], version + 1))
    t = make_trajectory(8, task_id=group, sample_index=i, group_size=size)
    t.segments, t.reward, t.group_id, t.prompt_id = segs, reward, group, f"prompt-{group}"
    return t


def _gen(policy: str, ids: list[int], version: int) -> Segment:
    n = len(ids)
    return Segment(policy, "assistant", np.array(ids, np.int32), np.full(n, -0.5, np.float32), np.ones(n, np.uint8),
                   np.full(n, version, np.int32))


def make_curate(policies: tuple[str, ...] = ("a", "b"), versions: dict[str, int] | None = None, **kw: Any) -> tuple[CurateApp, FakeWorker]:
    w = FakeWorker("curate")
    app = CurateApp(policies, **kw)
    app.worker = w
    app.init_slots(w.control)
    app._train_topics = dict.fromkeys(policies, True)
    app.versions = Latest({p: PolicyVersion(p, v, WeightKind.DELTA, "bf16", 0, 0, "", "", 0, 0) for p, v in (versions or {}).items()})
    app.feedback = Latest({})
    return app, w


class Latest:
    """Stands in for a CompactedReader: the latest record per key, nothing new to refresh."""

    def __init__(self, latest: dict[str, Any]) -> None:
        self.latest = latest

    def refresh(self) -> int:
        return 0


def feed(app: CurateApp, trajs: list[Trajectory]) -> list[Incoming]:
    incs = [incoming(t, i) for i, t in enumerate(trajs)]
    for inc in incs:
        app.handle(inc)
    return incs


def by_policy(w: FakeWorker) -> dict[str, dict[str, float]]:
    out: dict[str, dict[str, float]] = {}
    for topic, s, key in w.sent:
        assert topic == Topics(EXP).train(s.policy) and key == s.group_id
        out.setdefault(s.policy, {})[s.trajectory_id] = s.advantage
    return out


def test_curate_group_gives_per_policy_grpo_advantages_and_feedback() -> None:
    app, w = make_curate()
    rewards = [1.0, 0.0, 1.0, 0.0]
    trajs = [two_policy_traj("g", i, 4, r, with_b=i < 3) for i, r in enumerate(rewards)]
    feed(app, trajs[:3])
    assert w.sent == [] and len(w.tables["members"]) == 3  # held in the members table
    feed(app, trajs[3:])
    assert not w.tables["groups"] and not w.tables["members"] and list(w.tables["emitted"]) == [b"g"]
    adv = by_policy(w)
    # policy a: rewards 1,0,1,0 -> mean .5, std .5 -> +-0.5 / (0.5 + 1e-6)
    assert adv["a"] == pytest.approx({"g/0": 1.0, "g/1": -1.0, "g/2": 1.0, "g/3": -1.0}, abs=1e-5)
    # policy b trained only in samples 0-2: rewards 1,0,1 -> mean 2/3, std sqrt(2)/3
    s = np.sqrt(2) / 3
    assert adv["b"] == pytest.approx({"g/0": (1 / 3) / s, "g/1": (-2 / 3) / s, "g/2": (1 / 3) / s}, abs=1e-5)
    lineage = [(r.app, r.slot, r.name) for r in w.sent[0][1].lineage]
    assert lineage[-1] == ("curate", "advantage", "grpo") and ("curate", "filter.zero_variance", "zero_variance") in lineage
    keys = {k: st for _, st, k in w.side}
    assert set(keys) == {"a/prompt-g", "b/prompt-g"}
    assert keys["a/prompt-g"].groups == 1 and keys["a/prompt-g"].last_pass_rate == 0.5
    assert keys["b/prompt-g"].samples == 3 and keys["b/prompt-g"].last_version == 3


def test_curate_filters_zero_variance_and_stale_samples_and_follows_advantage_swap() -> None:
    app, w = make_curate(policies=("a",), versions={"a": 20})
    feed(app, [two_policy_traj("flat", i, 2, 1.0, False, version=19) for i in range(2)])  # all solved
    assert w.sent == [] and w.dropped["zero_variance"] == 2
    feed(app, [two_policy_traj("old", i, 2, float(i), False, version=3) for i in range(2)])  # 17 versions behind
    assert w.sent == [] and w.dropped["staleness"] == 2
    w.control.set("curate", "advantage", "dr_grpo")
    w.control.set("curate", "filter.staleness", "none")
    feed(app, [two_policy_traj("ok", i, 2, float(i), False, version=3) for i in range(2)])
    assert by_policy(w)["a"] == {"ok/0": -0.5, "ok/1": 0.5}
    assert w.sent[0][1].lineage[-1].name == "dr_grpo"
    assert len(w.side) == 3  # feedback for every group, filtered or not


def test_curate_timeouts_emit_big_enough_partial_groups_and_drop_small_ones() -> None:
    app, w = make_curate(policies=("a",), group_timeout_s=1.0, min_group_size=2)
    feed(app, [two_policy_traj("big", i, 4, float(i), False) for i in range(3)])
    feed(app, [two_policy_traj("small", 0, 4, 1.0, False)])
    assert w.sent == [] and len(w.tables["groups"]) == 2
    asyncio.run(app.tick(0.0))  # not yet
    assert w.sent == []
    later = time.time() + 5
    app._now = lambda: later  # type: ignore[method-assign]
    asyncio.run(app.tick(0.0))
    assert sorted(s.trajectory_id for _, s, _ in w.sent) == ["big/0", "big/1", "big/2"]
    assert w.dropped["incomplete_group"] == 1 and not w.tables["groups"] and len(w.tables["emitted"]) == 2
    assert {k for _, _, k in w.side} == {"a/prompt-big", "a/prompt-small"}  # stats even for the dropped group


@register("filter", "unit_explode", version=1)
@dataclass(frozen=True)
class Explode:
    """Raises on any group of prompt `prompt_id` (a broken plug-in)."""

    prompt_id: str = "prompt-boom"

    def __call__(self, items: list[Any], ctx: Any = None) -> Any:
        if any(i.prompt_id == self.prompt_id for i in items):
            raise RuntimeError("kaboom")
        from astraflow.dataflow.filters import FilterResult

        return FilterResult(list(items))


def test_a_raising_extra_filter_dead_letters_its_whole_group_by_name() -> None:
    app, w = make_curate(policies=("a",))
    w.control.set("curate", "filter.explode", "unit_explode")  # any filter.<name> slot joins the chain
    incs = feed(app, [two_policy_traj("boom", i, 2, float(i), False) for i in range(2)])
    assert sorted((d[0].offset, d[0].value, d[2]) for d in w.dead) == [
        (incs[0].offset, incs[0].value, "unit_explode"), (incs[1].offset, incs[1].value, "unit_explode")]  # original bytes
    assert "kaboom" in w.dead[0][1] and w.sent == []
    feed(app, [two_policy_traj("fine", i, 2, float(i), False) for i in range(2)])
    assert len(w.sent) == 2 and w.sent[0][1].lineage[-2].name == "unit_explode"


def test_curate_drops_duplicates_late_records_and_unrouted_policies() -> None:
    app, w = make_curate(policies=("a",))
    t0, t1 = (two_policy_traj("g", i, 2, float(i), with_b=True) for i in range(2))
    feed(app, [t0, t0, t1, t1])
    assert w.dropped["duplicate_in_group"] == 1 and w.dropped["late_trajectory"] == 1
    assert {s.policy for _, s, _ in w.sent} == {"a"} and w.dropped["unrouted_policy"] == 2


def test_curate_group_process_is_usable_directly() -> None:
    app, _ = make_curate(policies=("a",))
    g = Group("g", 2, 0, 0.0, complete=True)
    for i in range(2):
        t = two_policy_traj("g", i, 2, float(i), False)
        g.members[t.trajectory_id] = (t, None)
    outputs, feedback = app.process(g)
    assert [s.advantage for _, s, _ in outputs] == pytest.approx([-1.0, 1.0], abs=1e-5)
    assert [k for k, _ in feedback] == ["a/prompt-g"]


# ---- curator -----------------------------------------------------------------------------------


def test_tasks_ahead_counts_uncurated_tasks_and_untrained_samples() -> None:
    assert tasks_ahead(issued=10, curated=10, backlog_samples=0, n_samples=4) == 0
    assert tasks_ahead(issued=10, curated=6, backlog_samples=0, n_samples=4) == 4
    assert tasks_ahead(issued=10, curated=6, backlog_samples=5, n_samples=4) == 6  # 5 samples: 2 groups
    assert tasks_ahead(issued=3, curated=5, backlog_samples=0, n_samples=4) == 0


def make_curator(tmp_path: Any, max_ahead: int = 3, max_tasks: int = 0) -> tuple[CuratorApp, FakeWorker]:
    data = tmp_path / "d.jsonl"
    data.write_text("".join(f'{{"prompt": "q{i}", "answer": "{i}", "difficulty": {i}}}\n' for i in range(5)))
    app = CuratorApp(CuratorOptions([data], ["solver"], n_samples=2, max_ahead=max_ahead, max_tasks=max_tasks, trainer_group="none"))
    w = FakeWorker("curator")
    app.worker = w
    app.slot = Slot(w.control, "curator", "curator", "curator", app.defaults["curator"])
    app.tasks_topic, app.trainer_group = Topics(EXP).tasks, None
    app.feedback = Latest({})
    return app, w


def test_curator_keeps_at_most_max_ahead_tasks_until_feedback_arrives(tmp_path: Any) -> None:
    app, w = make_curator(tmp_path, max_ahead=3)
    app.tick(0.0)
    app.tick(1.0)
    assert len(w.sent) == 3 and app.ahead == 3
    task = w.sent[0][1]
    assert task.n_samples == 2 and task.policies == ["solver"] and task.group_id == task.task_id == w.sent[0][2]
    assert task.reference.startswith('{"answer"') and task.lineage[0].name == "accept_all"
    app._on_feedback(f"solver/{task.prompt_id}", PromptStats(task.prompt_id, "d", "solver", 1, 2, 1, 1, 1, 0, 4, 0, 0))
    app._on_feedback("other/x", PromptStats("x", "d", "other", 9, 2, 1, 1, 1, 0, 4, 0, 0))  # another policy: ignored
    app.tick(2.0)
    assert len(w.sent) == 4 and app.curated == 1
    w.control.set("curator", "pause", "on")
    app._on_feedback(f"solver/{task.prompt_id}", PromptStats(task.prompt_id, "d", "solver", 3, 6, 1, 1, 1, 0, 4, 0, 0))
    app.tick(3.0)
    assert len(w.sent) == 4 and app.paused
    w.control.set("curator", "pause", "off")
    w.control.set("curator", "curator", "curriculum_ordered", shuffle="false", advance_at="2")
    app.tick(4.0)
    assert len(w.sent) == 6 and w.sent[-1][1].lineage[0].name == "curriculum_ordered"
    assert {w.sent[-1][1].prompt_id, w.sent[-2][1].prompt_id} == {"d/0"}  # only the easiest level


def test_curator_stops_after_max_tasks(tmp_path: Any) -> None:
    app, w = make_curator(tmp_path, max_ahead=10, max_tasks=2)
    app.tick(0.0)
    app.tick(1.0)
    assert len(w.sent) == 2 and w.stopped


# ---- user processors ---------------------------------------------------------------------------


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


def test_curator_feeds_greso_the_zero_variance_share_it_sees(tmp_path: Any) -> None:
    app, w = make_curator(tmp_path, max_ahead=1)
    w.control.set("curator", "curator", "greso", step="0.1", p_easy="0.5", p_hard="0.5")
    greso = app.slot.get().impl
    for i in range(4):  # four groups came back, all of them all-solved: far above the 25% target
        app._on_feedback(f"solver/d/{i}", PromptStats(f"d/{i}", "d", "solver", 1, 2, 1.0, 1.0, 1, 0, 4, 1, 0))
    app.tick(0.0)
    # all-solved share 100% > its target: skip more easy prompts; all-failed share 0%: skip fewer hard ones
    assert greso.p_easy == pytest.approx(0.4) and greso.p_hard == pytest.approx(0.6)
    assert app.curated == 4 and app._zv == [0, 0, 0]


def test_curate_computes_advantages_on_the_whole_group_before_filters_mask() -> None:
    """DAPO-style: two stale members are masked out, but the survivors' advantages are those of
    the full group of four (rewards 1, 0, 0, 0), not of the two left (1, 0)."""
    app, w = make_curate(policies=("a",), versions={"a": 20})
    versions = [19, 19, 3, 3]  # members 2 and 3 are 17 versions behind: stale
    feed(app, [two_policy_traj("mix", i, 4, r, False, version=v) for i, (r, v) in enumerate(zip([1.0, 0.0, 0.0, 0.0], versions, strict=True))])
    assert w.dropped["staleness"] == 2
    std = np.std([1.0, 0.0, 0.0, 0.0])
    assert by_policy(w)["a"] == pytest.approx({"mix/0": 0.75 / std, "mix/1": -0.25 / std}, abs=1e-4)
