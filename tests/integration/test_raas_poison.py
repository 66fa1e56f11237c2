"""No task can stop a RaaS node: one poison task of each kind, on a real broker.

Each kind is answered (ERROR trajectories, or a dead letter naming the field and the limit or
how to allow the workflow), committed, and the node serves the good task after it. The second
test kills a node with `kill -9` while the poison is still uncommitted, so the node that takes
the partition over receives all of it again, and survives it too.
"""

from __future__ import annotations

import asyncio
import math
import os
import signal
import subprocess
import sys
import time
import uuid
from pathlib import Path

import pytest
from confluent_kafka import Consumer, TopicPartition
from helpers import collect

from astraflow.config import AstraflowConfig, KafkaSettings, RaasSettings
from astraflow.kafka.clients import RecordProducer, watermarks
from astraflow.kafka.topics import Topics
from astraflow.raas.backends.torch_backend import TorchBackend
from astraflow.raas.node import NodeSettings, RaasNode
from astraflow.records import DeadLetter, SamplingParams, Task, Trajectory, TrajectoryStatus
from astraflow.testing import make_task

POISON_FLOWS = '''
import asyncio
import time

async def raises(ctx):
    raise RuntimeError("boom")

async def exits(ctx):
    raise SystemExit(7)

async def interrupts(ctx):
    raise KeyboardInterrupt("from the workflow")

async def hangs(ctx):
    await asyncio.Event().wait()

async def wrong_type(ctx):
    return {"not": "a trajectory"}

async def blocks(ctx):
    time.sleep(3600)  # holds the event loop itself
'''


@pytest.fixture
def flows(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> tuple[str, str]:
    """(module of misbehaving workflows, module that raises SystemExit when imported), importable."""
    mod = f"poison_{uuid.uuid4().hex[:8]}"
    (tmp_path / f"{mod}.py").write_text(POISON_FLOWS)
    (tmp_path / f"{mod}_import.py").write_text("raise SystemExit('at import')\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    return mod, f"{mod}_import"


def _poison(mod: str, mod_import: str) -> tuple[list[tuple[Task, str]], list[tuple[Task, str]]]:
    """(tasks answered with ERROR trajectories, tasks dead-lettered), each with the text its answer holds."""
    def task(name: str, workflow: str = "rlvr", **sampling) -> Task:
        t = make_task(0, n_samples=2)
        t.task_id, t.group_id, t.workflow = name, f"g-{name}", workflow
        t.sampling = SamplingParams(**{"max_tokens": 4, **sampling})
        return t

    errors = [
        (task("hang", f"{mod}:hangs"), "exceeded the deadline"),
        (task("exit", f"{mod}:exits"), "SystemExit: 7"),
        (task("interrupt", f"{mod}:interrupts"), "KeyboardInterrupt: from the workflow"),
        (task("raise", f"{mod}:raises"), "RuntimeError: boom"),
        (task("wrong-type", f"{mod}:wrong_type"), "returned dict, not a Trajectory"),
        (task("block", f"{mod}:blocks"), "LoopStalled: the workflow blocked the event loop"),
    ]
    n_huge, prompt = task("n-huge"), task("prompt-long")
    n_huge.n_samples, prompt.prompt = 1_000_000, "x" * 300
    stranger = task("stranger")
    stranger.policies = ["stranger"]
    letters = [
        (task("os-system", "os:system"), "raas.workflow_modules=[os]"),
        (task("unknown", "no_such_workflow"), "unknown workflow 'no_such_workflow'"),
        (task("import-exit", f"{mod_import}:wf"), "raised SystemExit"),
        (n_huge, "n_samples=1000000 must be between 1 and 256"),
        (task("tokens-huge", max_tokens=10**9), "sampling.max_tokens=1000000000 must be between 1 and 32"),
        (task("turns-huge", max_turns=10**6), "sampling.max_turns=1000000 must be between 1 and"),
        (task("temp-nan", temperature=math.nan), "sampling.temperature=nan must be finite"),
        (task("top-p", top_p=2.0), "sampling.top_p=2.0 must be in (0, 1]"),
        (prompt, "prompt='<300 characters>' must be at most 200 characters"),
        (stranger, "['stranger'] are not served by this node"),
    ]
    return errors, letters


def _send(kafka: KafkaSettings, topic: str, tasks: list[Task]) -> None:
    producer = RecordProducer(kafka)
    for t in tasks:
        producer.send(topic, t, key="one-partition")  # in order, on one partition: commits must pass each
    producer.flush()



def _all_committed(kafka: KafkaSettings, group: str, topic: str) -> bool:
    c = Consumer({**kafka.client_config(), "group.id": group, "enable.auto.commit": False})
    try:
        parts = c.list_topics(topic, timeout=10).topics[topic].partitions
        for p in parts:
            low, high = watermarks(c, topic, p)
            (tp,) = c.committed([TopicPartition(topic, p)], timeout=10)
            if high > low and tp.offset != high:
                return False
        return True
    finally:
        c.close()


def _check_answers(trajs: list[Trajectory], letters: list[DeadLetter], errors, refused, good: list[Task]) -> None:
    by_task: dict[str, list[Trajectory]] = {}
    for t in trajs:
        by_task.setdefault(t.task_id, []).append(t)
    for task, says in errors:
        got = {t.trajectory_id: t for t in by_task.get(task.task_id, [])}
        assert len(got) == task.n_samples, f"{task.task_id}: {len(got)} trajectories"
        for t in got.values():
            assert t.status == TrajectoryStatus.ERROR and says in t.error, (task.task_id, t.error)
    for task in good:
        got = by_task.get(task.task_id, [])
        assert got and all(t.status != TrajectoryStatus.ERROR for t in got), (task.task_id, [t.error for t in got])
    for task, says in refused:
        mine = [d for d in letters if task.task_id in d.error]
        assert mine, f"no dead letter for {task.task_id}"
        assert says in mine[0].error and mine[0].error_class == "InvalidTaskError", mine[0].error
    assert not set(by_task) & {t.task_id for t, _ in refused}, "a refused task was rolled out"


def test_each_poison_task_is_answered_committed_and_the_node_goes_on(
        kafka: KafkaSettings, experiment: str, tiny_model_dir: Path, flows: tuple[str, str]) -> None:
    errors, refused = _poison(*flows)
    good = [make_task(i, n_samples=1) for i in range(2)]
    for g in good:
        g.sampling = SamplingParams(max_tokens=4)
    tasks = [good[0]] + [t for t, _ in errors] + [t for t, _ in refused] + [good[1]]
    topics = Topics(experiment)
    _send(kafka, topics.tasks, tasks)

    limits = RaasSettings(workflow_modules=list(flows), rollout_timeout_s=2.0, max_tokens=32, max_prompt_chars=200)
    backend = TorchBackend("policy", str(tiny_model_dir), seed=0, max_batch=8, threads=1)
    node = RaasNode(AstraflowConfig(kafka=kafka, raas=limits), NodeSettings(experiment, max_inflight=32), {"policy": backend})
    group = f"af.{experiment}.raas"

    async def run() -> None:
        t = asyncio.create_task(node.run())
        loop = asyncio.get_running_loop()
        deadline = loop.time() + 90
        while loop.time() < deadline and not (node.tasks_done + node.tasks_refused == len(tasks)
                                              and await asyncio.to_thread(_all_committed, kafka, group, topics.tasks)):
            assert not t.done(), "the node stopped by itself"
            await asyncio.sleep(0.3)
        node.stop()
        await t

    try:
        asyncio.run(run())
    finally:
        backend.close()
    assert node.tasks_refused == len(refused) and node.tasks_done == len(errors) + len(good)
    assert _all_committed(kafka, group, topics.tasks)
    n_trajs = sum(t.n_samples for t, _ in errors) + len(good)
    trajs = collect(kafka, topics.rollouts, Trajectory, lambda out: len(out) >= n_trajs, timeout_s=90)
    letters = collect(kafka, topics.dlq, DeadLetter, lambda out: len(out) >= len(refused), timeout_s=90)
    _check_answers(trajs, letters, errors, refused, good)
    assert node.rollouts_failed == sum(t.n_samples for t, _ in errors)


def _node(kafka: KafkaSettings, experiment: str, model: Path, node_id: str, log: Path, flows: tuple[str, str],
          timeout_s: float) -> subprocess.Popen:
    # A short session (the broker's minimum) so the group notices the killed node in seconds, not 45.
    env = {**os.environ, "ASTRAFLOW__KAFKA__BOOTSTRAP_SERVERS": kafka.bootstrap_servers,
           "ASTRAFLOW__KAFKA__CLIENT_EXTRA": "{session.timeout.ms: '6000', heartbeat.interval.ms: '1000'}",
           "ASTRAFLOW__RAAS__WORKFLOW_MODULES": f"[{', '.join(flows)}]", "ASTRAFLOW__RAAS__ROLLOUT_TIMEOUT_S": str(timeout_s),
           "ASTRAFLOW__RAAS__MAX_TOKENS": "32", "ASTRAFLOW__RAAS__MAX_PROMPT_CHARS": "200",
           "PYTHONPATH": os.pathsep.join(p for p in (str(log.parent), os.environ.get("PYTHONPATH")) if p)}
    cmd = [sys.executable, "-m", "astraflow_cli.main", "raas", "serve", "-e", experiment, "-p", f"policy={model}",
           "--max-inflight", "32", "--node-id", node_id, "--threads", "1", "--no-follow-weights"]
    return subprocess.Popen(cmd, env=env, stdout=log.open("w"), stderr=subprocess.STDOUT)


@pytest.mark.slow  # two node processes, one killed: ~40 s
def test_a_node_taking_over_uncommitted_poison_is_not_killed_either(
        kafka: KafkaSettings, experiment: str, tiny_model_dir: Path, flows: tuple[str, str], tmp_path: Path) -> None:
    errors, refused = _poison(*flows)
    errors = [e for e in errors if e[0].task_id != "block"]  # node A's long deadline would hold it 30 s
    good = make_task(0, n_samples=1)
    good.sampling = SamplingParams(max_tokens=4)
    # The hang comes first: node A cannot commit past it before its (long) deadline.
    tasks = [t for t, _ in errors] + [t for t, _ in refused] + [good]
    topics = Topics(experiment)
    _send(kafka, topics.tasks, tasks)
    group = f"af.{experiment}.raas"

    a = _node(kafka, experiment, tiny_model_dir, "node-a", tmp_path / "a.log", flows, timeout_s=120)
    answered_by_a = {t.task_id for t, _ in errors[1:]} | {good.task_id}

    def kill_a_once_it_answered(out: list[Trajectory]) -> None:
        if a.poll() is None and answered_by_a <= {t.task_id for t in out if t.node.node_id == "node-a"}:
            os.kill(a.pid, signal.SIGKILL)
            a.wait()

    try:
        collect(kafka, topics.rollouts, Trajectory, lambda _: a.poll() is not None, on_batch=kill_a_once_it_answered, timeout_s=90)
    finally:
        if a.poll() is None:
            a.kill()
            a.wait()
    assert a.returncode == -signal.SIGKILL, (tmp_path / "a.log").read_text()[-3000:]
    assert not _all_committed(kafka, group, topics.tasks), "node A committed past the hanging task"

    b = _node(kafka, experiment, tiny_model_dir, "node-b", tmp_path / "b.log", flows, timeout_s=2)
    try:
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline and not _all_committed(kafka, group, topics.tasks):
            assert b.poll() is None, (tmp_path / "b.log").read_text()[-3000:]
            time.sleep(0.5)
        assert _all_committed(kafka, group, topics.tasks), (tmp_path / "b.log").read_text()[-3000:]
        assert b.poll() is None, "node B exited"
    finally:
        if b.poll() is None:
            b.send_signal(signal.SIGTERM)
        b.wait(timeout=60)
    assert b.returncode == 0, (tmp_path / "b.log").read_text()[-3000:]
    n_b = sum(t.n_samples for t, _ in errors) + 1
    trajs = collect(kafka, topics.rollouts, Trajectory,
                     lambda out: len([t for t in out if t.node.node_id == "node-b"]) >= n_b, timeout_s=90)
    from_b = [t for t in trajs if t.node.node_id == "node-b"]
    # Node A's dead letters may not have left its producer before the kill; node B's must all be there.
    letters = collect(kafka, topics.dlq, DeadLetter, lambda out: len(out) >= 2 * len(refused), timeout_s=10)
    _check_answers(from_b, letters, errors, refused, [good])
    assert len(letters) >= len(refused)
