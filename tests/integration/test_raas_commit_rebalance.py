"""The RaaS node's asynchronous commits through rebalances, on a real broker: a node joins the
group of a node at work (a cooperative rebalance moves a partition to it) and later leaves (its
partitions go back). No task is lost; no task whose offset the revoking node could commit (every
task of the partition before it finished) is started again after the revocation; and the
group's committed offsets never go back. An older commit landing after the revocation's commit,
or a commit whose offsets were counted before Kafka took them, breaks the second or the third.
"""

from __future__ import annotations

import asyncio
import threading
import time
import uuid
from pathlib import Path

from confluent_kafka import Consumer, TopicPartition
from helpers import collect

from astraflow.config import AstraflowConfig, KafkaSettings
from astraflow.kafka.clients import RecordProducer
from astraflow.kafka.topics import Topics
from astraflow.raas.backends.torch_backend import TorchBackend
from astraflow.raas.node import NodeSettings, RaasNode
from astraflow.records import SamplingParams, Trajectory
from astraflow.serde import AvroSerde
from astraflow.testing import make_task

SAMPLES, MAX_TASKS = 2, 400


class _Node(RaasNode):
    """A RaaS node that notes, at each revocation, what its commit there covers."""

    revocations: list[tuple[tuple[str, int], int | None, float]]

    def _on_revoke(self, consumer, partitions: list[TopicPartition]) -> None:
        if not hasattr(self, "revocations"):
            self.revocations = []
        now = time.time()
        for p in partitions:
            tp = (p.topic, p.partition)
            self.revocations.append((tp, self.offsets.committable(tp), now))
        super()._on_revoke(consumer, partitions)


def _node(kafka: KafkaSettings, experiment: str, model: Path, name: str) -> _Node:
    backend = TorchBackend("policy", str(model), seed=0, max_batch=4)
    settings = NodeSettings(experiment, max_inflight=4, prefetch=4, metrics_interval_s=1.0, node_id=name)
    return _Node(AstraflowConfig(kafka=kafka), settings, {"policy": backend})


def _task_offsets(kafka: KafkaSettings, topic: str, n: int) -> dict[str, tuple[int, int]]:
    """task_id -> (partition, offset) of every task written."""
    c = Consumer({**kafka.client_config(), "group.id": f"t-{uuid.uuid4().hex}", "enable.auto.commit": False,
                  "auto.offset.reset": "earliest"})
    c.assign([TopicPartition(topic, p, 0) for p in range(2)])
    serde, out = AvroSerde(), {}
    deadline = time.monotonic() + 30
    while len(out) < n and time.monotonic() < deadline:
        msg = c.poll(0.5)
        if msg is not None and msg.error() is None:
            out[serde.loads(msg.value()).task_id] = (msg.partition(), msg.offset())
    c.close()
    return out


def test_commits_through_a_join_and_a_leave(kafka: KafkaSettings, experiment: str, tiny_model_dir: Path) -> None:
    topics = Topics(experiment)
    group = f"af.{experiment}.raas"
    producer = RecordProducer(kafka)

    written = 0

    def write(n: int) -> None:
        nonlocal written
        for i in range(written, written + n):
            t = make_task(i, n_samples=SAMPLES)
            t.sampling = SamplingParams(temperature=1.0, max_tokens=8)
            producer.send(topics.tasks, t, key=t.group_id)
        producer.flush()
        written += n

    write(10)  # the rest while the nodes work, so that there is work for both throughout

    # The group's committed offsets, watched all along (a reader that never joins the group).
    seen: list[tuple[int, int]] = []
    stop_watch = threading.Event()

    def watch() -> None:
        c = Consumer({**kafka.client_config(), "group.id": group, "enable.auto.commit": False})
        try:
            while not stop_watch.is_set():
                for tp in c.committed([TopicPartition(topics.tasks, p) for p in range(2)], timeout=5.0):
                    if tp.offset >= 0:
                        seen.append((tp.partition, tp.offset))
                time.sleep(0.05)
        finally:
            c.close()

    watcher = threading.Thread(target=watch, daemon=True)
    watcher.start()
    a = _node(kafka, experiment, tiny_model_dir, "node-a")

    async def scenario() -> _Node:
        run_a = asyncio.create_task(a.run())

        feeding_on = True

        async def feed() -> None:  # two tasks every 0.3 s while both nodes are to have work
            while feeding_on and written < MAX_TASKS:
                await asyncio.to_thread(write, 2)
                await asyncio.sleep(0.3)

        async def until(cond, what: str, timeout_s: float = 120.0) -> None:
            deadline = time.monotonic() + timeout_s
            while not cond() and time.monotonic() < deadline:
                await asyncio.sleep(0.1)
            assert cond(), f"timed out waiting for {what}: node-a did {a.tasks_done} tasks, node-b {getattr(b, 'tasks_done', 0)}"

        b: _Node | None = None
        await until(lambda: a.tasks_done >= 4, "node-a's first tasks")
        feeding = asyncio.create_task(feed())
        b = _node(kafka, experiment, tiny_model_dir, "node-b")
        run_b = asyncio.create_task(b.run())  # joins: a cooperative rebalance gives it a partition
        await until(lambda: b.tasks_done >= 6, "node-b's tasks")
        b.stop()  # drains, commits and leaves: its partition goes back to node-a
        await run_b
        await asyncio.sleep(2.0)  # node-a takes the partition back and works on
        feeding_on = False
        await feeding
        await asyncio.to_thread(ends_now)
        await until(lambda: {p: max((o for q, o in seen if q == p), default=-1) for p in range(2)} == ends,
                    "every task committed")
        a.stop()
        await run_a
        return b

    ends: dict[int, int] = {}  # set once every task is written

    def ends_now() -> None:
        probe = Consumer({**kafka.client_config(), "group.id": f"t-{uuid.uuid4().hex}"})
        ends.update({p: probe.get_watermark_offsets(TopicPartition(topics.tasks, p), timeout=10)[1] for p in range(2)})
        probe.close()

    b = asyncio.run(scenario())
    stop_watch.set()
    watcher.join(10)

    trajs: list[Trajectory] = collect(kafka, topics.rollouts, Trajectory,
                                      lambda got: len({t.trajectory_id for t in got}) >= written * SAMPLES)
    where = _task_offsets(kafka, topics.tasks, written)
    # None lost.
    assert {t.trajectory_id for t in trajs} == {f"task-{i}/{s}" for i in range(written) for s in range(SAMPLES)}
    # Both rebalances happened, and the revoking nodes had finished work to commit there.
    revocations = getattr(a, "revocations", []) + getattr(b, "revocations", [])
    assert any(pos for _, pos, _ in getattr(a, "revocations", [])), "node-a gave no partition up while at work"
    assert any(pos for _, pos, _ in getattr(b, "revocations", [])), "node-b left without finished work"
    # No task the revoking node could commit started again after the revocation.
    for (topic, partition), pos, at in revocations:
        if pos is None:
            continue
        redone = [t.trajectory_id for t in trajs
                  if where[t.task_id][0] == partition and where[t.task_id][1] < pos and t.timings.started_at / 1000 > at]
        assert not redone, f"{topic}[{partition}] revoked at offset {pos}, then redone: {redone}"
    # The committed offsets never went back.
    last: dict[int, int] = {}
    for partition, offset in seen:
        assert offset >= last.get(partition, -1), f"partition {partition}: committed {last[partition]}, then {offset}"
        last[partition] = offset
    assert last == ends and all(ends[p] == 1 + max(o for q, o in where.values() if q == p) for p in range(2))
