"""MirrorMaker 2 between two real clusters: the shared broker as region A, a one-node cluster
started here as region B (ports `ASTRAFLOW_TEST_PORT_BASE`+40/+41, default 29140), MM2 from
the same Maven jars (`astraflow.kafka.mirror`), unique topics.

Region B's tasks (the curator's split) reach B and region A's do not; committed weight records
reach B and aborted ones do not; B's rollouts and metrics come back to A; MM2 killed with
kill -9 and restarted between two batches of rollouts (with exactly-once source support, the
default, it writes nothing twice; at-least-once it copies again what it had not committed), and
curate's group store emits every trajectory exactly once either way.
"""

from __future__ import annotations

import os
import time
import uuid
from pathlib import Path

import pytest
from confluent_kafka import Consumer, Producer

from astraflow.config import KafkaSettings, LocalKafkaSettings, TopicSettings
from astraflow.kafka.clients import RecordProducer, reader_config
from astraflow.kafka.local import LocalKafka
from astraflow.kafka.mirror import Mirror, MirrorPlan, prepare_topics
from astraflow.kafka.topics import TopicAdmin, Topics, topic_specs
from astraflow.records import Task, Trajectory
from astraflow.serde import AvroSerde
from astraflow.testing import make_task, make_trajectory
from stream_apps.groups import GroupStore, TaskClaim

pytestmark = pytest.mark.slow

BASE = int(os.environ.get("ASTRAFLOW_TEST_PORT_BASE", "29100")) + 40
QUIET = {"echo": lambda *_: None}


def raw(kafka: KafkaSettings, topic: str, want: int, timeout_s: float = 60.0, settle_s: float = 0.0) -> list[tuple[bytes, bytes]]:
    """(key, value) of `topic` from its start, read_committed, until `want` records (then
    `settle_s` more, to see any extra) or the timeout."""
    c = Consumer(reader_config(kafka, f"read-{uuid.uuid4().hex}"))
    c.subscribe([topic])
    out: list[tuple[bytes, bytes]] = []
    deadline, settled = time.monotonic() + timeout_s, None
    try:
        while time.monotonic() < deadline:
            out += [(m.key(), m.value()) for m in c.consume(500, 0.3) if m.error() is None]
            if len(out) >= want:
                settled = settled or time.monotonic() + settle_s
                if time.monotonic() >= settled:
                    break
    finally:
        c.close()
    return out


def test_mirror_carries_region_b_tasks_and_weights_out_and_rollouts_back(kafka: KafkaSettings, tmp_path: Path) -> None:
    exp = f"mm2-{uuid.uuid4().hex[:8]}"
    t = Topics(exp)
    admin_a = TopicAdmin(kafka)
    admin_a.create(topic_specs(exp, ["policy"], TopicSettings(partitions=2)))
    b = LocalKafka(LocalKafkaSettings(data_dir=tmp_path / "b", port=BASE, controller_port=BASE + 1, heap_mb=256))
    mirror = None
    try:
        b.up(**QUIET)
        kb = KafkaSettings(bootstrap_servers=b.bootstrap)
        plan = MirrorPlan(exp, "b", kafka.bootstrap_servers, b.bootstrap)  # exactly-once source support (the default)
        prepare_topics(plan, ["policy"], TopicSettings(partitions=2))
        mirror = Mirror(plan, tmp_path / "mm2", b.libs, heap_mb=256)
        mirror.up(**QUIET, timeout_s=150)

        # Region A: 10 tasks, 4 of them to region b (as the curator's split writes them); weights,
        # one transaction committed and one aborted; the latest version on `policies`.
        issued: dict[str, list[str]] = {t.tasks: [], t.tasks_of("b"): []}
        prod = RecordProducer(kafka)
        for i in range(10):
            topic = t.tasks_of("b") if i % 5 in (1, 3) else t.tasks
            task = make_task(i, n_samples=2)
            prod.send(topic, task, key=task.group_id)
            issued[topic].append(task.task_id)
        prod.flush()
        assert len(issued[t.tasks_of("b")]) == 4
        tx = Producer({"bootstrap.servers": kafka.bootstrap_servers, "transactional.id": f"{exp}-pub"})
        tx.init_transactions(30)
        for commit, values in ((True, [b"w1", b"w2", b"w3"]), (False, [b"aborted1", b"aborted2"])):
            tx.begin_transaction()
            for v in values:
                tx.produce(t.weights("policy"), v, partition=0)  # the stream: one order
            tx.flush()
            (tx.commit_transaction if commit else tx.abort_transaction)(30)
        plain = Producer({"bootstrap.servers": kafka.bootstrap_servers})
        plain.produce(t.policies, b"v3", key=b"policy")
        plain.flush()

        # Region B sees its tasks and nothing of region A's; committed weights only.
        serde = AvroSerde()
        got = [serde.loads(v, Task).task_id for _, v in raw(kb, t.tasks_of("b"), 4, settle_s=3.0)]
        assert sorted(got) == sorted(issued[t.tasks_of("b")])
        assert raw(kb, t.tasks, 1, timeout_s=3.0) == []  # region A's tasks never leave A
        assert [v for _, v in raw(kb, t.weights("policy"), 3, settle_s=3.0)] == [b"w1", b"w2", b"w3"]
        assert [v for _, v in raw(kb, t.policies, 1)] == [b"v3"]

        # Region B's nodes roll its tasks out (2 samples each); the first two tasks' rollouts,
        # then MM2 dies (kill -9) and comes back, then the others.
        prod_b = RecordProducer(kb)
        btasks = issued[t.tasks_of("b")]
        sent: list[str] = []

        def roll(task_ids: list[str]) -> None:
            for tid in task_ids:
                for i in range(2):
                    traj = make_trajectory(64, task_id=tid, sample_index=i, group_size=2, reward=1.0)
                    prod_b.send(t.rollouts, traj, key=traj.group_id)
                    sent.append(traj.trajectory_id)
            prod_b.flush()

        roll(btasks[:2])
        assert len(raw(kafka, t.rollouts, 4)) >= 4
        pid = mirror.pid()
        assert pid is not None
        os.kill(pid, 9)
        while mirror.pid() is not None:
            time.sleep(0.1)
        mirror.up(**QUIET, timeout_s=150)
        roll(btasks[2:])
        pb = Producer({"bootstrap.servers": b.bootstrap})
        pb.produce(t.metrics, b"node-b1 metric")
        pb.flush()

        back = raw(kafka, t.rollouts, len(sent), timeout_s=90.0, settle_s=5.0)
        trajs = [serde.loads(v, Trajectory) for _, v in back]
        assert sorted({x.trajectory_id for x in trajs}) == sorted(sent)  # every rollout came back
        assert {x.task_id for x in trajs} <= set(btasks)
        assert b"node-b1 metric" in [v for _, v in raw(kafka, t.metrics, 1, timeout_s=60.0)]

        # Curate's group store: whatever MM2 delivered twice, each trajectory leaves once.
        store = GroupStore({}, {}, {}, lambda v: serde.loads(v, Trajectory), timeout_s=300)
        emitted: list[str] = []
        dropped = 0
        for offset, (_, v) in enumerate(back):
            traj = serde.loads(v, Trajectory)
            task = TaskClaim(traj.task_id, traj.group_id, traj.prompt_id, 2)  # as the curator issued it: 2 samples
            added = store.add(traj, v, 0, offset, time.time(), task)
            if added.status == "complete":
                emitted += [m.trajectory_id for m in added.group.trajectories]
            elif added.status == "superseded":
                dropped += 1
            else:
                assert added.status == "held", added.status
        assert sorted(emitted) == sorted(sent)
        assert dropped == len(back) - len(sent)
    finally:
        if mirror is not None:
            mirror.down(**QUIET)
        b.down(**QUIET)
        mine = [n for n in admin_a.list() if exp in n]
        if mine:
            admin_a.delete(mine)
