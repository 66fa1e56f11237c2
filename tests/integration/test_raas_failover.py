"""Two RaaS node processes share the work; `kill -9` of one loses no task (dedupe by id).

Bounded by work, not time: the tasks are written once both nodes own a partition, and the
waits are generous, so a slow or loaded machine only makes it slower."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
import uuid
from pathlib import Path

from astraflow.config import KafkaSettings
from astraflow.kafka.clients import RecordConsumer, RecordProducer
from astraflow.kafka.topics import Topics
from astraflow.records import SamplingParams, Trajectory
from astraflow.testing import make_task


def _node(kafka: KafkaSettings, experiment: str, model: Path, node_id: str, log: Path) -> subprocess.Popen:
    env = {**os.environ, "ASTRAFLOW__KAFKA__BOOTSTRAP_SERVERS": kafka.bootstrap_servers}
    cmd = [sys.executable, "-m", "astraflow_cli.main", "raas", "serve", "-e", experiment, "-p", f"policy={model}",
           "--max-inflight", "2", "--prefetch", "1", "--node-id", node_id, "--threads", "1", "--no-follow-weights"]
    return subprocess.Popen(cmd, env=env, stdout=log.open("w"), stderr=subprocess.STDOUT)


def _both_nodes_hold_a_partition(kafka: KafkaSettings, group: str, timeout_s: float) -> bool:
    """True once the group has two members that each own a partition of the tasks topic."""
    from confluent_kafka import KafkaException
    from confluent_kafka.admin import AdminClient

    admin = AdminClient(kafka.client_config())
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        try:
            desc = admin.describe_consumer_groups([group], request_timeout=10)[group].result()
            owners = [m for m in desc.members if m.assignment and m.assignment.topic_partitions]
            if len(owners) == 2:
                return True
        except KafkaException:  # the coordinator is still loading the group
            pass
        time.sleep(0.5)
    return False


def test_kill_minus_nine_loses_no_task(kafka: KafkaSettings, experiment: str, tiny_model_dir: Path, tmp_path: Path) -> None:
    topics = Topics(experiment)
    a = _node(kafka, experiment, tiny_model_dir, "node-a", tmp_path / "a.log")
    b = _node(kafka, experiment, tiny_model_dir, "node-b", tmp_path / "b.log")
    consumer = RecordConsumer(kafka, f"t-{uuid.uuid4().hex}", [topics.rollouts], component="t", dlq=None, expect=Trajectory)
    seen: list[Trajectory] = []
    killed = False
    n_tasks, n_samples = 16, 2
    try:
        # Tasks only once each node owns one of the two partitions: node-a then has work of its
        # own however slowly it started (on a loaded machine node-b could otherwise do it all).
        assert _both_nodes_hold_a_partition(kafka, f"af.{experiment}.raas", 300), (
            f"the nodes did not share the tasks topic within 300 s:\n{(tmp_path / 'a.log').read_text()[-2000:]}")
        producer = RecordProducer(kafka)
        for i in range(n_tasks):
            t = make_task(i, n_samples=n_samples)
            t.sampling = SamplingParams(temperature=1.0, max_tokens=32)
            producer.send(topics.tasks, t, key=t.group_id)
        producer.flush()
        deadline = time.monotonic() + 600  # bounded by the work: generous for a slow, loaded machine
        while time.monotonic() < deadline:
            seen.extend(r.record for r in consumer.poll_batch(100, 0.5))
            if not killed and any(t.node.node_id == "node-a" for t in seen):
                os.kill(a.pid, signal.SIGKILL)  # mid-run: it may still hold uncommitted tasks
                a.wait()
                killed = True
            if killed and len({t.trajectory_id for t in seen}) == n_tasks * n_samples:
                break
            assert a.poll() is None or killed, f"node-a exited by itself:\n{(tmp_path / 'a.log').read_text()[-2000:]}"
            assert b.poll() is None, f"node-b exited:\n{(tmp_path / 'b.log').read_text()[-2000:]}"
    finally:
        for p in (a, b):
            if p.poll() is None:
                p.send_signal(signal.SIGTERM)
        b.wait(timeout=120)
        a.wait(timeout=120)
        consumer.close()
    ids = {t.trajectory_id for t in seen}
    assert killed, f"node-a never produced anything:\n{(tmp_path / 'a.log').read_text()[-2000:]}"
    assert ids == {f"task-{i}/{s}" for i in range(n_tasks) for s in range(n_samples)}, (tmp_path / "b.log").read_text()[-2000:]
    assert {t.node.node_id for t in seen} == {"node-a", "node-b"}  # both received work
    assert b.returncode == 0  # SIGTERM: drained and left the group cleanly
