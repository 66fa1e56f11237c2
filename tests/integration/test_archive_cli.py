"""The commands end to end on a real Kafka: archive run / ls / verify, logs show, replay; --follow."""

from __future__ import annotations

import json
import threading
from pathlib import Path

import pytest
from typer.testing import CliRunner

from astraflow.archive.kafka_source import TopicSource
from astraflow.config import KafkaSettings
from astraflow.kafka.clients import RecordProducer
from astraflow.kafka.topics import Topics
from astraflow.testing import make_trajectory
from astraflow_cli.main import app

pytestmark = pytest.mark.timeout(120)  # a hang fails fast instead of holding the suite

def _cli(kafka: KafkaSettings, *args: str) -> tuple[int, str]:
    result = CliRunner().invoke(app, ["--set", f"kafka.bootstrap_servers={kafka.bootstrap_servers}", *args])
    return result.exit_code, result.output


def test_archive_logs_and_replay_commands(kafka: KafkaSettings, experiment: str, tmp_path: Path) -> None:
    t = Topics(experiment)
    producer = RecordProducer(kafka)
    for i in range(12):
        tr = make_trajectory(48, task_id=f"task-{i}", seed=i, reward=i / 12)
        tr.tool_calls[0].result = f"[result {i}]"
        producer.send(t.rollouts, tr, key=tr.group_id)
    producer.flush()

    code, out = _cli(kafka, "logs", "show", "-e", experiment, "--json", "-n", "3")
    assert code == 0, out
    rows = [json.loads(line) for line in out.splitlines()]
    assert len(rows) == 3 and [r["_timestamp"] for r in rows] == sorted(r["_timestamp"] for r in rows)
    code, out = _cli(kafka, "logs", "show", "-e", experiment, "--id", "task-5")
    assert code == 0 and "trajectory task-5/0" in out and "[result 5]" in out and "task-4/0" not in out, out

    archive = tmp_path / "archive"
    code, out = _cli(kafka, "archive", "run", "-e", experiment, "-t", "rollouts", "--to", str(archive), "--exit-when-idle", "1")
    assert code == 0 and "archived 12 records" in out, out
    code, out = _cli(kafka, "archive", "ls", str(archive), "--json")
    parts = [json.loads(line) for line in out.splitlines()]
    assert code == 0 and sum(p["records"] for p in parts) == 12 and {p["topic"] for p in parts} == {t.rollouts}
    code, out = _cli(kafka, "archive", "ls", str(archive))
    assert code == 0 and f"{t.rollouts}: 12 records in" in out, out  # per-topic totals under each table
    code, out = _cli(kafka, "archive", "ls", str(tmp_path / "nowhere"))
    assert code == 1 and "does not exist" in out and "Error" not in out and len(out.strip().splitlines()) == 1
    code, out = _cli(kafka, "archive", "verify", str(archive))
    assert code == 0 and "12 readable records, 0 problems" in out, out

    code, out = _cli(kafka, "logs", "show", "--archive", str(archive), "--filter", "reward >= 0.5", "-n", "0", "--json")
    assert code == 0 and {json.loads(line)["task_id"] for line in out.splitlines()} == {f"task-{i}" for i in range(6, 12)}

    code, out = _cli(kafka, "replay", "--from", str(archive), "-e", experiment, "--to", "scored", "--limit", "5")
    assert code == 0 and "published 5" in out, out
    code, out = _cli(kafka, "logs", "show", "-e", experiment, "-t", "scored", "--json", "-n", "0")
    assert len(out.splitlines()) == 5


def test_follow_reports_caught_up_then_streams_new_records(kafka: KafkaSettings, topic_factory) -> None:
    topic = topic_factory("follow", partitions=2)
    producer = RecordProducer(kafka)
    for i in range(4):
        producer.send(topic, make_trajectory(32, task_id=f"old-{i}"), key=f"k{i}")
    producer.flush()
    events: list[str] = []
    got: list[str] = []
    source = TopicSource(kafka, topic, follow=True, tail=1)
    backlog = sum(1 for start, end in source.ranges.values() if end > start)  # one per partition with data
    stop = threading.Event()

    def on_caught_up() -> None:
        events.append(f"caught up after {len(got)}")
        for i in range(3):
            producer.send(topic, make_trajectory(32, task_id=f"new-{i}"), key=f"n{i}")
        producer.flush()

    for rec in source.records(stop=stop.is_set, on_caught_up=on_caught_up):
        got.append(rec.key.decode())
        if len(got) == backlog + 3:
            stop.set()
    source.close()
    assert events == [f"caught up after {backlog}"]  # the last record of each partition, then live ones
    assert sorted(got[backlog:]) == ["n0", "n1", "n2"] and all(k.startswith("k") for k in got[:backlog])


def test_most_recent_records_of_a_transactional_topic(kafka: KafkaSettings, topic_factory) -> None:
    """`logs show -n N` on a topic written in transactions (scored, train): every commit marker and
    aborted record takes an offset, so the last N offsets hold fewer than N records (it printed
    nothing for `-n 1` on a running demo's train topic)."""
    from confluent_kafka import Producer

    from astraflow.serde import AvroSerde

    topic = topic_factory("af.txn-tail", partitions=1)
    serde = AvroSerde()
    producer = Producer({**kafka.client_config(), "transactional.id": f"{topic}-writer"})
    producer.init_transactions(30)
    for i in range(6):
        producer.begin_transaction()
        producer.produce(topic, serde.dumps(make_trajectory(16, task_id=f"txn-{i}")), key=f"k{i}")
        if i == 5:  # the newest transaction is aborted: its record must never show
            producer.flush()
            producer.abort_transaction(30)
        else:
            producer.commit_transaction(30)

    code, out = _cli(kafka, "logs", "show", "-t", topic, "--json", "-n", "1")
    assert code == 0, out
    assert [json.loads(line)["task_id"] for line in out.splitlines()] == ["txn-4"]
    code, out = _cli(kafka, "logs", "show", "-t", topic, "--json", "-n", "3")
    assert code == 0 and [json.loads(line)["task_id"] for line in out.splitlines()] == ["txn-2", "txn-3", "txn-4"], out
