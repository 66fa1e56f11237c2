"""reward + curate (Faust apps, exactly-once) on a real broker: trajectories in, train samples out, poison to the DLQ.

Two policies (solver, verifier): the verifier trains in three of the four samples of one group,
so its advantages differ from the solver's. Poison records (undecodable bytes, a record of another
schema, a reference the reward strategy raises on, a group a curate filter raises on) land in the DLQ with the reason and the
strategy's name, and every record after them is still processed.
"""

from __future__ import annotations

import json
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

import numpy as np
import pytest

from astraflow.config import KafkaSettings, TopicSettings
from astraflow.control import ControlWriter
from astraflow.dataflow.filters import FilterResult
from astraflow.dataflow.registry import register
from astraflow.kafka.clients import RecordProducer
from astraflow.kafka.topics import TopicAdmin, Topics, topic_specs
from astraflow.records import DeadLetter, Metric, PromptStats, Segment, TrainSample, Trajectory
from astraflow.testing import issue_tasks, make_trajectory, read_records
from stream_apps.engine import EngineSettings, StreamEngine
from stream_apps.launch import AppOptions, build_worker

POLICIES = ["solver", "verifier"]


@pytest.fixture
def exp2(kafka: KafkaSettings, unique: Callable[[str], str]) -> Iterator[str]:
    """An experiment with train topics for two policies."""
    name = unique("exp")
    admin = TopicAdmin(kafka)
    specs = topic_specs(name, POLICIES, TopicSettings(partitions=2))
    admin.create(specs)
    yield name
    admin.delete([s.name for s in specs])


@register("filter", "it_explode", version=1)
@dataclass(frozen=True)
class Explode:
    """Raises on groups of the prompt `boom` (a broken plug-in filter)."""

    def __call__(self, items: list[Any], ctx: Any = None) -> FilterResult[Any]:
        if any(i.prompt_id == "boom" for i in items):
            raise RuntimeError("filter exploded")
        return FilterResult(list(items))


def group(name: str, answers: list[str], verifier_in: int = 0, prompt: str | None = None) -> list[Trajectory]:
    """Trajectories of one group; the first `verifier_in` also have a verifier segment."""
    out = []
    for i, answer in enumerate(answers):
        t = make_trajectory(96, task_id=name, sample_index=i, group_size=len(answers), policy="solver", seed=i, version=4)
        t.group_id, t.prompt_id, t.final_answer, t.reference = name, prompt or f"p-{name}", answer, '{"answer": "4"}'
        if i < verifier_in:
            n = 8
            t.segments.append(Segment("verifier", "assistant", np.arange(n, dtype=np.int32), np.full(n, -0.1, np.float32),
                                      np.ones(n, np.uint8), np.full(n, 7, np.int32)))
        out.append(t)
    return out


def start(*workers: StreamEngine) -> list[Any]:
    return [w.start_thread() for w in workers]


def stop(workers: list[StreamEngine], threads: list[Any]) -> None:
    for w in workers:
        w.stop()
    for t in threads:
        t.join(30)
    assert not any(t.is_alive() for t in threads)
    assert all(w.error is None for w in workers), [w.error for w in workers]


def test_trajectories_to_train_samples_per_policy_with_dlq_and_metrics(kafka: KafkaSettings, exp2: str) -> None:
    topics = Topics(exp2)
    ControlWriter(kafka, exp2).set("curate", "filter.explode", "it_explode")  # before start: read at startup
    producer = RecordProducer(kafka)
    producer.send_raw(topics.rollouts, b"garbage, not avro", key=b"poison")
    other = DeadLetter(original=b"x", original_key=None, topic="t", partition=0, offset=0, error_class="E", error="e",
                       component="c")
    producer.send(topics.rollouts, other, key=b"other-schema")  # valid Avro, not a Trajectory
    bad = group("bad-ref", ["4"])[0]
    bad.reference = "this is not json"
    producer.send(topics.rollouts, bad, key=bad.group_id)
    batches = [
        group("g1", ["4", "5", "4", "5"], verifier_in=3),  # solver 1,0,1,0; verifier 1,0,1
        group("g2", ["4", "4", "4", "5"]),  # solver 1,1,1,0
        group("boom", ["4", "5"], prompt="boom"),  # the explode filter raises on this group
        group("flat", ["5", "5", "5"]),  # all wrong: zero variance, dropped
    ]
    issue_tasks(kafka, exp2, [bad, *(t for batch in batches for t in batch)])  # the tasks, as the curator issued them
    for batch in batches:
        for t in batch:
            producer.send(topics.rollouts, t, key=t.group_id)
    producer.flush()

    settings = dict(metrics_interval_s=0.5, commit_interval_s=0.5)
    workers = [build_worker("reward", EngineSettings(exp2, kafka, **settings)),
               build_worker("curate", EngineSettings(exp2, kafka, **settings), AppOptions(policies=POLICIES))]
    threads = start(*workers)
    try:
        samples = read_records(kafka, [topics.train(p) for p in POLICIES], lambda out: len(out) >= 11)
        letters = read_records(kafka, [topics.dlq], lambda out: len(out) >= 5, timeout_s=20)
        time.sleep(1.0)  # one more metrics period after the last record
    finally:
        stop(workers, threads)

    assert all(isinstance(s, TrainSample) for s in samples)
    adv = {(s.policy, s.trajectory_id): s.advantage for s in samples}
    assert len(adv) == len(samples) == 11  # 4 + 4 solver, 3 verifier; nothing twice
    half, third = 0.5 / (0.5 + 1e-6), np.sqrt(2) / 3
    expected = {
        **{("solver", f"g1/{i}"): a for i, a in enumerate([half, -half, half, -half])},
        **{("verifier", f"g1/{i}"): a for i, a in enumerate([(1 / 3) / third, (-2 / 3) / third, (1 / 3) / third])},
        **{("solver", f"g2/{i}"): a for i, a in enumerate([0.25 / np.sqrt(3 / 16)] * 3 + [-0.75 / np.sqrt(3 / 16)])},
    }
    assert adv == pytest.approx(expected, abs=1e-4)
    v0 = next(s for s in samples if s.policy == "verifier" and s.trajectory_id == "g1/0")
    assert v0.loss_mask.sum() == 8 and v0.min_version == 7 and len(v0.token_ids) == 8  # its own tokens only
    s0 = next(s for s in samples if s.policy == "solver" and s.trajectory_id == "g1/0")
    assert s0.min_version == 4 and len(s0.token_ids) == 96  # the verifier's tokens are no part of the solver's sample
    lineage = [(r.app, r.slot, r.name) for r in s0.lineage]
    assert lineage[0] == ("reward", "reward", "exact_match") and lineage[-1] == ("curate", "advantage", "grpo")
    assert ("curate", "filter.explode", "it_explode") in lineage

    assert all(isinstance(d, DeadLetter) for d in letters)
    got = sorted((d.component, d.error_class, d.strategy or "", d.topic == topics.scored) for d in letters)
    assert got == [
        ("curate", "RuntimeError", "it_explode", True),
        ("curate", "RuntimeError", "it_explode", True),
        ("reward", "CorruptRecordError", "", False),
        ("reward", "RewardError", "exact_match", False),
        ("reward", "SchemaValidationError", "", False),
    ]
    assert any("not valid JSON" in d.error for d in letters if d.strategy == "exact_match")
    assert any("filter exploded" in d.error for d in letters if d.strategy == "it_explode")
    assert next(d for d in letters if d.error_class == "CorruptRecordError").original == b"garbage, not avro"

    feedback = read_records(kafka, [topics.feedback], lambda out: len(out) >= 5, timeout_s=10)
    keys = {f"{s.policy}/{s.prompt_id}" for s in feedback if isinstance(s, PromptStats)}
    assert keys == {"solver/p-g1", "verifier/p-g1", "solver/p-g2", "solver/boom", "solver/p-flat"}  # boom's too

    def final(metrics: list[Any], component: str, name: str, **labels: str) -> float | None:
        hits = [m for m in metrics if isinstance(m, Metric) and m.component == component and m.name == name
                and all(m.labels.get(k) == v for k, v in labels.items())]
        return hits[-1].value if hits else None

    metrics = read_records(kafka, [topics.metrics], lambda out: final(out, "curate", "dropped_total", reason="zero_variance") == 3,
                    timeout_s=10)
    assert final(metrics, "curate", "dropped_total", reason="zero_variance") == 3
    assert final(metrics, "reward", "records_in_total") == 3 + 13
    assert final(metrics, "reward", "records_out_total") == 13
    assert final(metrics, "reward", "dead_lettered_total", reason="CorruptRecordError") == 1
    # The apps sign their metrics with the apps' key: status believes them (docs/security.md).
    from astraflow.ops.status import collect_status

    report = collect_status(kafka, exp2)
    assert {"reward", "curate"} <= {a.component for a in report.apps}
    assert not [m for m in report.unverified if m.component in ("reward", "curate")]


def test_code_rewards_run_concurrently_in_the_sandbox_without_blocking(kafka: KafkaSettings, exp2: str) -> None:
    topics = Topics(exp2)
    ControlWriter(kafka, exp2).set("reward", "reward", "code_tests", {"timeout_s": "3", "cpu_s": "2"})
    tests = '{"tests": ["assert add(2, 3) == 5", "assert add(-1, 1) == 0"]}'
    answers = {
        "right": "def add(a, b):\n    return a + b\n",
        "wrong": "def add(a, b):\n    return a - b\n",
        "hangs": "def add(a, b):\n    while True:\n        pass\n",
    }
    producer = RecordProducer(kafka)
    expected = {}
    for i in range(9):
        kind = list(answers)[i % 3]
        t = make_trajectory(64, task_id=f"code-{i}", seed=i)
        t.group_id, t.final_answer, t.reference = t.task_id, f"```python\n{answers[kind]}```", tests
        expected[t.trajectory_id] = 1.0 if kind == "right" else 0.0
        producer.send(topics.rollouts, t, key=t.group_id)
    producer.flush()
    worker = build_worker("reward", EngineSettings(exp2, kafka, max_inflight=8, metrics_interval_s=60))
    threads = start(worker)
    try:
        scored = read_records(kafka, [topics.scored], lambda out: len(out) >= 9, timeout_s=60)
    finally:
        stop([worker], threads)
    assert {t.trajectory_id: t.reward for t in scored} == expected
    assert all(t.lineage[-1].name == "code_tests" for t in scored)
    hung = [t for t in scored if t.final_answer and "while True" in t.final_answer]
    # Ended by a limit: the wall-clock timeout or the CPU limit, whichever a loaded machine hits first.
    # On an idle machine the solution's own sandbox hits its CPU limit first and the tests report
    # its end (reported=1); on a loaded one the wall-clock timeout kills the run (killed=1).
    assert hung and all(t.reward == 0.0 for t in hung)  # which component records the end depends on which limit came first
    assert worker.stats.inflight_peak > 1  # sandbox runs overlapped instead of queueing one by one


def test_curate_restart_resumes_pending_groups_from_its_tables(kafka: KafkaSettings, exp2: str) -> None:
    topics = Topics(exp2)
    producer = RecordProducer(kafka)
    first, second = group("done", ["4", "5"]), group("half", ["4", "5", "4", "5"])
    issue_tasks(kafka, exp2, [*first, *second])
    for t in [*first, *second[:2]]:  # a complete group, and half of another
        t.reward = 1.0 if t.final_answer == "4" else 0.0
        producer.send(topics.scored, t, key=t.group_id)
    producer.flush()
    settings = dict(metrics_interval_s=60, commit_interval_s=0.2)
    worker = build_worker("curate", EngineSettings(exp2, kafka, **settings), AppOptions(policies=["solver"]))
    threads = start(worker)
    try:
        read_records(kafka, [topics.train("solver")], lambda out: len(out) >= 2)
        time.sleep(0.5)  # a commit period: the half group's two members (their offsets) are in the table's changelog
        # Our transactional commits tell Faust's slow-processing check (no "Has not committed ... at
        # all since worker start" for a partition that commits): the done group's partition did.
        committed_at = worker.app.consumer._thread.tp_last_committed_at
        emitted = {int(json.loads(v)["partition"]) for v in worker.tables["emitted"].values()}
        assert emitted and emitted <= {tp.partition for tp in committed_at if tp.topic == topics.scored}
    finally:
        stop([worker], threads)
    assert worker.stats.records_in == 4 and worker.stats.records_out == 2

    for t in second[2:]:  # the rest of the half group arrives while curate is down
        t.reward = 1.0 if t.final_answer == "4" else 0.0
        producer.send(topics.scored, t, key=t.group_id)
    producer.flush()
    again = build_worker("curate", EngineSettings(exp2, kafka, **settings), AppOptions(policies=["solver"]))
    threads = start(again)
    try:
        samples = read_records(kafka, [topics.train("solver")], lambda out: len(out) >= 6)
        time.sleep(0.5)
    finally:
        stop([again], threads)
    # The new records, and maybe the half group's first two again: a restarted worker can be
    # handed records again at startup (Faust seeks its partitions back after table recovery, or
    # the last transactional offset commit is not visible yet). Those two are in the recovered
    # table already, so they are dropped as superseded, never trained twice.
    reread = again.stats.records_in - 2
    assert reread in (0, 2) and again.stats.dropped.get("superseded", 0) == reread, again.stats
    assert sorted(s.trajectory_id for s in samples) == ["done/0", "done/1", "half/0", "half/1", "half/2", "half/3"]
    assert sorted(s.advantage for s in samples if s.group_id == "half") == pytest.approx([-1, -1, 1, 1], abs=1e-5)
