"""Two RaaS node processes share the work; `kill -9` of one loses no task (dedupe by id)."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
import uuid
from pathlib import Path

import pytest

from astraflow.config import KafkaSettings
from astraflow.kafka.clients import RecordConsumer, RecordProducer
from astraflow.kafka.topics import Topics
from astraflow.records import SamplingParams, Trajectory
from astraflow.testing import make_task


@pytest.fixture(scope="module")
def tiny_model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    from astraflow.models.tiny import init_tiny

    return Path(init_tiny(tmp_path_factory.mktemp("tiny"), seed=0))


def _node(kafka: KafkaSettings, experiment: str, model: Path, node_id: str, log: Path) -> subprocess.Popen:
    env = {**os.environ, "ASTRAFLOW__KAFKA__BOOTSTRAP_SERVERS": kafka.bootstrap_servers}
    cmd = [sys.executable, "-m", "astraflow.cli.main", "raas", "serve", "-e", experiment, "-p", f"policy={model}",
           "--max-inflight", "2", "--prefetch", "1", "--node-id", node_id, "--threads", "1", "--no-follow-weights"]
    return subprocess.Popen(cmd, env=env, stdout=log.open("w"), stderr=subprocess.STDOUT)


def test_kill_minus_nine_loses_no_task(kafka: KafkaSettings, experiment: str, tiny_model: Path, tmp_path: Path) -> None:
    topics = Topics(experiment)
    producer = RecordProducer(kafka)
    n_tasks, n_samples = 16, 2
    for i in range(n_tasks):
        t = make_task(i, n_samples=n_samples)
        t.sampling = SamplingParams(temperature=1.0, max_tokens=32)
        producer.send(topics.tasks, t, key=t.group_id)
    producer.flush()

    a = _node(kafka, experiment, tiny_model, "node-a", tmp_path / "a.log")
    b = _node(kafka, experiment, tiny_model, "node-b", tmp_path / "b.log")
    consumer = RecordConsumer(kafka, f"t-{uuid.uuid4().hex}", [topics.rollouts], component="t", dlq=None, expect=Trajectory)
    seen: list[Trajectory] = []
    killed = False
    deadline = time.monotonic() + 240
    try:
        while time.monotonic() < deadline:
            seen.extend(r.record for r in consumer.poll_batch(100, 0.5))
            if not killed and any(t.node.node_id == "node-a" for t in seen):
                os.kill(a.pid, signal.SIGKILL)  # mid-run: it still holds uncommitted tasks
                a.wait()
                killed = True
            if len({t.trajectory_id for t in seen}) == n_tasks * n_samples:
                break
    finally:
        for p in (a, b):
            if p.poll() is None:
                p.send_signal(signal.SIGTERM)
        b.wait(timeout=60)
        consumer.close()
    ids = {t.trajectory_id for t in seen}
    assert killed, "node-a never produced anything"
    assert ids == {f"task-{i}/{s}" for i in range(n_tasks) for s in range(n_samples)}, (tmp_path / "b.log").read_text()[-2000:]
    assert {t.node.node_id for t in seen} == {"node-a", "node-b"}  # both received work
    assert b.returncode == 0  # SIGTERM: drained and left the group cleanly
