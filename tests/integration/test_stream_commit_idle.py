"""A burst's outputs commit once the worker goes idle, not only at the next commit interval.

Readers downstream are read_committed: with only the interval, a stage's outputs of a burst
(a batch of rollouts) stay invisible until it elapses, and every exactly-once stage of the
pipeline adds that wait. Here the interval is an hour, so only the idle commit can show them.
"""

from __future__ import annotations

from astraflow.config import KafkaSettings
from astraflow.kafka.clients import RecordProducer
from astraflow.kafka.topics import Topics
from astraflow.records import Trajectory
from astraflow.testing import make_trajectory, read_records
from stream_apps.engine import EngineSettings
from stream_apps.launch import build_worker


def test_an_idle_worker_commits_its_burst_before_the_interval(kafka: KafkaSettings, experiment: str) -> None:
    topics = Topics(experiment)
    producer = RecordProducer(kafka)
    for i in range(8):
        t = make_trajectory(16, task_id=f"t{i}", seed=i)
        t.final_answer, t.reference = "4", '{"answer": "4"}'
        producer.send(topics.rollouts, t, key=t.group_id)
    producer.flush()
    worker = build_worker("reward", EngineSettings(experiment, kafka, commit_interval_s=3600.0, commit_idle_s=0.05))
    thread = worker.start_thread()
    try:
        scored = read_records(kafka, [topics.scored], lambda out: len(out) >= 8, timeout_s=60)
    finally:
        worker.stop()
        thread.join(30)
    assert worker.error is None
    assert all(isinstance(s, Trajectory) and s.reward == 1.0 for s in scored)
    assert sorted(s.task_id for s in scored) == [f"t{i}" for i in range(8)]
