"""Builders of realistic records, and a reader of topics, for tests, benchmarks and examples (not
used by the pipeline)."""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

import numpy as np

from astraflow.config import KafkaSettings
from astraflow.records import NodeInfo, Segment, Task, Timings, ToolCall, Trajectory, now_ms


def make_trajectory(
    n_tokens: int = 4096,
    *,
    task_id: str = "task-0",
    sample_index: int = 0,
    group_size: int = 4,
    policy: str = "policy",
    prompt_tokens: int = 64,
    seed: int = 0,
    reward: float | None = None,
    version: int = 0,
) -> Trajectory:
    """A two-turn tool-use trajectory of `n_tokens` tokens: prompt, call, tool result, answer."""
    rng = np.random.default_rng(seed)
    gen = max(n_tokens - prompt_tokens - 16, 2)
    first, second = gen // 2, gen - gen // 2

    def generated(n: int) -> Segment:
        return Segment(
            policy,
            "assistant",
            rng.integers(0, 32000, n, dtype=np.int32),
            -rng.random(n, dtype=np.float32),
            np.ones(n, np.uint8),
            np.full(n, version, np.int32),
            text="x" * 16,
        )

    segments = [
        Segment.context(policy, "prompt", rng.integers(0, 32000, prompt_tokens, dtype=np.int32), "Q: 2+2?"),
        generated(first),
        Segment.context(policy, "tool", rng.integers(0, 32000, 16, dtype=np.int32), "<result>4</result>"),
        generated(second),
    ]
    t = now_ms()
    return Trajectory(
        trajectory_id=Trajectory.make_id(task_id, sample_index),
        task_id=task_id,
        group_id=f"g-{task_id}",
        prompt_id="p-0",
        dataset="synthetic",
        workflow="tool_use",
        sample_index=sample_index,
        group_size=group_size,
        segments=segments,
        timings=Timings(t - 1000, t - 900, t, 0.8, 0.1),
        node=NodeInfo("node-0", "cpu:2", "local", "torch"),
        tool_calls=[ToolCall(0, "calculator", '{"expr": "2+2"}', "4", 0.01)],
        final_answer="4",
        reference='{"answer": "4"}',
        reward=reward,
        reward_components={} if reward is None else {"exact_match": reward},
    )


def make_task(i: int = 0, n_samples: int = 4, policy: str = "policy") -> Task:
    return Task(
        task_id=f"task-{i}",
        group_id=f"g-{i}",
        prompt_id=f"p-{i}",
        dataset="synthetic",
        workflow="rlvr",
        prompt=f"Q: What is {i}+{i}?\nA:",
        reference=f'{{"answer": "{2 * i}"}}',
        policies=[policy],
        n_samples=n_samples,
    )


def read_records(kafka: KafkaSettings, topics: list[str], until: Callable[[list[Any]], bool],
                 timeout_s: float = 40.0) -> list[Any]:
    """Decoded records of `topics` from their start (as a new consumer group, read_committed) until
    `until(records)` holds or `timeout_s` has passed."""
    from astraflow.kafka.clients import reader
    from astraflow.kafka.topics import reader_group
    from astraflow.serde import AvroSerde

    serde = AvroSerde()
    c = reader(kafka, reader_group("test"))
    c.subscribe(topics)
    out: list[Any] = []
    deadline = time.monotonic() + timeout_s
    try:
        while not until(out) and time.monotonic() < deadline:
            out += [serde.loads(m.value()) for m in c.consume(500, 0.3) if m.error() is None]
    finally:
        c.close()
    return out


def task_of(traj: Trajectory) -> Task:
    """The task a synthetic trajectory claims to come from (its task id, group, prompt and size),
    as the curator would have issued it."""
    return Task(
        task_id=traj.task_id, group_id=traj.group_id, prompt_id=traj.prompt_id, dataset=traj.dataset,
        workflow=traj.workflow, prompt="synthetic", reference=traj.reference, policies=sorted(
            {s.policy for s in traj.segments}), n_samples=traj.group_size, created_at=now_ms(),
    )


def issue_tasks(kafka: KafkaSettings, experiment: str, trajectories: list[Trajectory]) -> int:
    """Writes, signed with the experiment's curator key, the task of every group among
    `trajectories` to its tasks topic, as the curator does before anything is rolled out: curate
    takes each group's size and members from it (`stream_apps.task_book`). For tests and
    benchmarks that write trajectories themselves, with no nodes reading the tasks. Returns how
    many tasks it wrote."""
    tasks = {t.group_id: task_of(t) for t in reversed(trajectories)}
    return send_tasks(kafka, experiment, list(tasks.values()))


def send_tasks(kafka: KafkaSettings, experiment: str, tasks: list[Task]) -> int:
    """Writes `tasks` to the experiment's tasks topic keyed by group, signed with its curator key
    as the curator signs them; returns how many."""
    from astraflow.kafka.clients import RecordProducer
    from astraflow.kafka.signing import Signer
    from astraflow.kafka.topics import Topics

    signer, producer = Signer(experiment, "curator"), RecordProducer(kafka)
    topic = Topics(experiment).tasks
    for task in tasks:
        value = producer.serde.dumps(task)
        producer.send_raw(topic, value, task.group_id, signer.headers("tasks", task.group_id, value))
    producer.flush()
    return len(tasks)
