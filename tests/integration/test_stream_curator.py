"""The curator on a real broker: tasks from a JSONL dataset, at most max-ahead beyond the trainer.

The test plays curate (feedback records) and the trainer (train samples, then a commit of the
trainer group's offsets) and watches the number of tasks follow `ahead = issued - curated +
ceil(train backlog / n_samples)`.
"""

from __future__ import annotations

import json
import time
from collections.abc import Callable
from pathlib import Path

import numpy as np
from confluent_kafka import Consumer, TopicPartition

from astraflow.config import KafkaSettings
from astraflow.kafka.clients import RecordProducer, watermarks
from astraflow.kafka.topics import Topics
from astraflow.records import PromptStats, Task, TrainSample
from astraflow.serde import AvroSerde
from stream_apps.curator import CuratorOptions
from stream_apps.engine import EngineSettings
from stream_apps.launch import AppOptions, build_worker


def count(consumer: Consumer, topic: str) -> int:
    return sum(watermarks(consumer, topic, p)[1] for p in (0, 1))


def wait_for(what: Callable[[], bool], timeout_s: float = 15.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not what():
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.1)


def stats(prompt_id: str, groups: int) -> PromptStats:
    return PromptStats(prompt_id, "arith", "policy", groups, 2 * groups, 0.5, 0.5, 0.5, 0.5, 10.0, 0, 0)


def sample(i: int) -> TrainSample:
    z = np.zeros(4, np.int32)
    return TrainSample(f"s{i}", f"t{i}", f"g{i}", "p", "policy", z, np.ones(4, np.uint8), z.astype(np.float32), z, 0.0, 0.0, 0)


def test_curator_bounds_tasks_ahead_of_the_trainer(kafka: KafkaSettings, experiment: str, tmp_path: Path) -> None:
    topics = Topics(experiment)
    data = tmp_path / "arith.jsonl"
    data.write_text("".join(json.dumps({"id": f"q{i}", "prompt": f"{i}+{i}=?", "reference": {"answer": str(2 * i)},
                                        "difficulty": i % 3, "dataset": "arith"}) + "\n" for i in range(10)))
    options = CuratorOptions([data], ["policy"], n_samples=2, max_ahead=4, workflow="rlvr", lag_interval_s=0.2)
    worker = build_worker("curator", EngineSettings(experiment, kafka, metrics_interval_s=60), AppOptions(curator=options))
    probe = Consumer({**kafka.client_config(), "group.id": f"af.{experiment}.policy.trainer", "enable.auto.commit": False})
    producer = RecordProducer(kafka)
    thread = worker.start_thread()
    try:
        wait_for(lambda: count(probe, topics.tasks) == 4)
        time.sleep(1.0)
        assert count(probe, topics.tasks) == 4  # nothing consumed yet: stays at max-ahead

        # curate finished the groups of two prompts (nothing to train on in them): two more tasks
        producer.send(topics.feedback, stats("q0", 1), key="policy/q0")
        producer.send(topics.feedback, stats("q1", 1), key="policy/q1")
        producer.flush()
        wait_for(lambda: count(probe, topics.tasks) == 6)

        # two more groups curated, but their 4 samples wait in the train topic: 6 - 4 + 2 = 4 ahead
        producer.send(topics.feedback, stats("q2", 1), key="policy/q2")
        producer.send(topics.feedback, stats("q3", 1), key="policy/q3")
        for i in range(4):
            producer.send(topics.train("policy"), sample(i), key=f"g{i}")
        producer.flush()
        time.sleep(1.0)
        assert count(probe, topics.tasks) == 6 and worker.handler.backlog == 4

        # the trainer consumed them (its group commits): two more tasks
        probe.commit(offsets=[TopicPartition(topics.train("policy"), p, watermarks(probe, topics.train("policy"), p)[1])
                              for p in (0, 1)], asynchronous=False)
        wait_for(lambda: count(probe, topics.tasks) == 8)
        time.sleep(0.5)
        assert count(probe, topics.tasks) == 8
    finally:
        worker.stop()
        thread.join(30)
        probe.close()
    assert worker.error is None

    serde = AvroSerde()
    reader = Consumer({**kafka.client_config(), "group.id": f"read-{experiment}", "auto.offset.reset": "earliest"})
    reader.subscribe([topics.tasks])
    tasks: list[Task] = []
    deadline = time.monotonic() + 15
    while len(tasks) < 8 and time.monotonic() < deadline:
        tasks += [serde.loads(m.value(), Task) for m in reader.consume(100, 0.5) if m.error() is None]
    reader.close()
    assert len(tasks) == 8 and len({t.task_id for t in tasks}) == 8
    t = tasks[0]
    assert t.group_id == t.task_id and t.n_samples == 2 and t.policies == ["policy"] and t.workflow == "rlvr"
    assert json.loads(t.reference) == {"answer": str(2 * int(t.prompt_id[1:]))} and t.dataset == "arith"
    assert [(r.app, r.slot, r.name) for r in t.lineage] == [("curator", "curator", "accept_all")]
    assert len({t.prompt_id for t in tasks}) == 8  # accept_all walks the epoch without repeats
