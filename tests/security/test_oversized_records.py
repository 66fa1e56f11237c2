"""Oversized and resource-hungry records on `tasks`, read by a real RaaS node (tiny model).

An outside client (`outsider.py`; the Task bytes are the public schema's encoding) writes, among
honest tasks: 10 MB of bytes (the broker takes records up to 64 MB, the node's consumer
refuses what is over its 8 MB record limit before decoding), a schema-valid Task whose prompt
is 300,000 characters, one that asks for a million samples and one that asks for a billion
tokens. Each must end in the DLQ with the rule it broke, nothing must be generated for them,
and every honest task must be done, with the node still running.
"""

from __future__ import annotations

import asyncio
import os
from pathlib import Path

import pytest
from helpers import collect
from outsider import Outsider

from astraflow.config import AstraflowConfig, KafkaSettings
from astraflow.kafka.clients import RecordProducer
from astraflow.kafka.topics import Topics
from astraflow.raas.backends.torch_backend import TorchBackend
from astraflow.raas.node import NodeSettings, RaasNode
from astraflow.records import DeadLetter, SamplingParams, Trajectory
from astraflow.serde import AvroSerde
from astraflow.testing import make_task

pytestmark = [pytest.mark.security, pytest.mark.timeout(300)]

HONEST = 4


async def _run_until(node: RaasNode, done, timeout_s: float = 120.0) -> None:
    task = asyncio.create_task(node.run())
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout_s
    while not done() and loop.time() < deadline:
        await asyncio.sleep(0.2)
    node.stop()
    await task


def test_oversized_and_greedy_tasks_are_refused_and_honest_tasks_are_done(
        kafka: KafkaSettings, experiment: str, tiny_model_dir: Path) -> None:
    topics, out, serde = Topics(experiment), Outsider(kafka.bootstrap_servers), AvroSerde()
    huge_prompt, many, long = make_task(100), make_task(101), make_task(102)
    huge_prompt.prompt = "x" * 300_000
    many.n_samples = 1_000_000
    long.sampling = SamplingParams(temperature=1.0, max_tokens=1_000_000_000)
    honest = RecordProducer(kafka)
    for i in range(HONEST // 2):
        t = make_task(i, n_samples=2)
        t.sampling = SamplingParams(temperature=1.0, max_tokens=8)
        honest.send(topics.tasks, t, key=t.group_id, partition=0)
    honest.flush()
    out.send(topics.tasks, os.urandom(10 * 1024 * 1024), b"big", partition=0)
    for t in (huge_prompt, many, long):
        out.send(topics.tasks, serde.dumps(t), t.group_id.encode(), partition=0)
    for i in range(HONEST // 2, HONEST):  # after the attacks, on the same partition
        t = make_task(i, n_samples=2)
        t.sampling = SamplingParams(temperature=1.0, max_tokens=8)
        honest.send(topics.tasks, t, key=t.group_id, partition=0)
    honest.flush()

    backend = TorchBackend("policy", str(tiny_model_dir), seed=0, max_batch=8)
    node = RaasNode(AstraflowConfig(kafka=kafka), NodeSettings(experiment, max_inflight=8), {"policy": backend})
    try:
        asyncio.run(_run_until(node, lambda: node.tasks_done >= HONEST and node.tasks_refused >= 3))
    finally:
        backend.close()
    assert node.tasks_done == HONEST and node.tasks_refused == 3

    trajs: list[Trajectory] = collect(kafka, topics.rollouts, Trajectory, lambda got: len(got) >= 2 * HONEST)
    assert {t.trajectory_id for t in trajs} == {f"task-{i}/{s}" for i in range(HONEST) for s in range(2)}
    letters: list[DeadLetter] = collect(kafka, topics.dlq, DeadLetter, lambda got: len(got) >= 4)
    assert sorted(d.error_class for d in letters) == ["InvalidTaskError"] * 3 + ["RecordTooLargeError"]
    errors = " | ".join(d.error for d in letters)
    assert "prompt=" in errors and "n_samples=1000000" in errors and "sampling.max_tokens=1000000000" in errors
    assert all(d.component == "raas" and d.topic == topics.tasks for d in letters)


def test_a_ten_megabyte_record_does_not_stop_reward(kafka: KafkaSettings, experiment: str) -> None:
    """The same 10 MB record on `rollouts`, read by the reward app (Faust, exactly-once): its
    letter leaves the original out (the worker's producer could not send it) and says where it
    is; the trajectories around it are scored."""
    from astraflow.testing import make_trajectory, read_records
    from stream_apps.engine import EngineSettings
    from stream_apps.launch import build_worker

    topics, out = Topics(experiment), Outsider(kafka.bootstrap_servers)
    honest = RecordProducer(kafka)

    def trajectories(name: str) -> None:
        for i in range(2):
            t = make_trajectory(32, task_id=name, sample_index=i, group_size=2, policy="policy", seed=i)
            t.group_id, t.final_answer, t.reference = name, str(4 + i), '{"answer": "4"}'
            honest.send(topics.rollouts, t, key=t.group_id, partition=0)
        honest.flush()

    trajectories("before")
    out.send(topics.rollouts, os.urandom(10 * 1024 * 1024), b"big", partition=0)
    trajectories("after")
    worker = build_worker("reward", EngineSettings(experiment, kafka, metrics_interval_s=0.5, commit_interval_s=0.5))
    thread = worker.start_thread()
    try:
        scored = read_records(kafka, [topics.scored], lambda got: len(got) >= 4, timeout_s=60)
        letters = read_records(kafka, [topics.dlq], lambda got: len(got) >= 1, timeout_s=30)
    finally:
        worker.stop()
        thread.join(30)
    assert not thread.is_alive() and worker.error is None, worker.error
    assert sorted((t.group_id, t.reward) for t in scored) == [("after", 0.0), ("after", 1.0), ("before", 0.0),
                                                              ("before", 1.0)]
    assert [(d.error_class, d.original, d.offset) for d in letters] == [("RecordTooLargeError", None, 2)]
    assert "too large for the DLQ; read it at its offset" in letters[0].error
