"""A user processor that fails on every record is impossible to miss (`astraflow process run`).

A processor raising on each record runs as its own process: it must log progress lines, say
loudly that more than half of its last records failed, stop after `--max-consecutive-failures`
failures in a row with exit status 1 naming the last error, and leave dead letters that carry
its component (`proc.<name>`), its name as the strategy and the traceback (at most 4 KB).
"""

from __future__ import annotations

import os
import subprocess
import sys
import time
import uuid
from pathlib import Path

import pytest
from confluent_kafka import Consumer

from astraflow.config import KafkaSettings
from astraflow.kafka.clients import RecordProducer, reader_config
from astraflow.kafka.topics import Topics
from astraflow.records import DeadLetter
from astraflow.serde import AvroSerde
from astraflow.testing import make_trajectory

pytestmark = [pytest.mark.integration, pytest.mark.timeout(180)]

ROOT = Path(__file__).resolve().parents[2]
RECORDS, LIMIT = 40, 25

FAILING = '''
import astraflow
from astraflow.records import Trajectory


def _check(t):
    raise ValueError(f"cannot handle {t.trajectory_id}")


@astraflow.processor(source="rollouts", sink="never", expect=Trajectory)
def always_fails(t: Trajectory) -> Trajectory:
    _check(t)
    return t
'''


def _dead_letters(kafka: KafkaSettings, topic: str, want: int) -> list[DeadLetter]:
    serde = AvroSerde()
    c = Consumer(reader_config(kafka, f"af-status-test-{uuid.uuid4().hex[:6]}"))
    c.subscribe([topic])
    got: list[DeadLetter] = []
    deadline = time.monotonic() + 30
    try:
        while len(got) < want and time.monotonic() < deadline:
            got += [serde.loads(m.value(), DeadLetter) for m in c.consume(100, 0.5) if m.error() is None]
    finally:
        c.close()
    return got


def test_a_processor_failing_on_every_record_warns_stops_and_owns_its_dead_letters(
        kafka: KafkaSettings, experiment: str, tmp_path: Path) -> None:
    (tmp_path / "failing_proc.py").write_text(FAILING)
    topics = Topics(experiment)
    producer = RecordProducer(kafka)
    for i in range(RECORDS):
        t = make_trajectory(64, task_id=f"task-{i}", seed=i)
        producer.send(topics.rollouts, t, key=t.group_id)
    producer.flush()
    env = {**os.environ, "ASTRAFLOW__KAFKA__BOOTSTRAP_SERVERS": kafka.bootstrap_servers, "PYTHONUNBUFFERED": "1",
           "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")])}
    cmd = [sys.executable, "-m", "astraflow_cli.main", "process", "run", "failing_proc:always_fails", "-e", experiment,
           "--max-consecutive-failures", str(LIMIT), "--progress-interval", "1"]
    res = subprocess.run(cmd, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=150)
    out = res.stdout + res.stderr
    assert res.returncode == 1, out
    assert "PROCESSOR always-fails IS FAILING" in out, out
    assert f"{LIMIT} records failed in a row" in out and "ValueError: cannot handle" in out, out
    assert "component == 'proc.always-fails'" in out, out  # how to read its dead letters
    assert "Traceback" not in res.stderr.split("error:")[-1]  # the closing line is one line, no stack trace

    dead = _dead_letters(kafka, topics.dlq, LIMIT)
    assert len(dead) >= LIMIT
    for d in dead:
        assert d.component == "proc.always-fails" and d.strategy == "always-fails"
        assert d.error_class == "ValueError" and d.error.startswith("cannot handle ")
        _message, _, tb = d.error.partition("\n\n")
        assert tb.startswith("Traceback (most recent call last)") and "in _check" in tb
        assert len(tb.encode()) <= 4096
