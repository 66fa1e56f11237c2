"""The commands as separate processes: `astraflow app run reward` feeding a user processor run with
`astraflow process run` (the example in stream_apps/examples); both stop cleanly on SIGTERM."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
import uuid
from pathlib import Path

from confluent_kafka import Consumer

from astraflow.config import KafkaSettings
from astraflow.kafka.clients import RecordProducer
from astraflow.kafka.topics import Topics
from astraflow.records import ToolCall, Trajectory
from astraflow.serde import AvroSerde
from astraflow.testing import make_trajectory
from stream_apps.launch import app_command

ROOT = Path(__file__).resolve().parents[2]


def test_reward_app_and_example_processor_as_processes(kafka: KafkaSettings, experiment: str, tmp_path: Path) -> None:
    topics = Topics(experiment)
    env = {**os.environ, "ASTRAFLOW__KAFKA__BOOTSTRAP_SERVERS": kafka.bootstrap_servers, "PYTHONUNBUFFERED": "1"}
    commands = {
        "reward": app_command("reward", experiment, "--metrics-interval", "1"),
        "proc": [sys.executable, "-m", "astraflow.cli.main", "process", "run",
                 "stream_apps.examples.tool_errors:tool_errors", "-e", experiment],
    }
    logs = {name: (tmp_path / f"{name}.log").open("w") for name in commands}
    procs = {name: subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=logs[name], stderr=subprocess.STDOUT)
             for name, cmd in commands.items()}
    try:
        producer = RecordProducer(kafka)
        for i in range(20):
            t = make_trajectory(128, task_id=f"task-{i}", seed=i)
            t.group_id = t.task_id
            if i % 4 == 0:
                t.tool_calls = [ToolCall(0, "python", "1/0", "", 0.1, error="ZeroDivisionError")]
            producer.send(topics.rollouts, t, key=t.group_id)
        producer.flush()

        serde = AvroSerde()
        c = Consumer({**kafka.client_config(), "group.id": f"read-{uuid.uuid4().hex}", "auto.offset.reset": "earliest"})
        sink = topics.stream("tool-errors")
        deadline = time.monotonic() + 45
        while sink not in c.list_topics(timeout=5).topics and time.monotonic() < deadline:
            time.sleep(0.2)
        c.subscribe([sink])
        flagged: list[Trajectory] = []
        while len(flagged) < 5 and time.monotonic() < deadline:
            assert all(p.poll() is None for p in procs.values()), "a process exited early"
            flagged += [serde.loads(m.value(), Trajectory) for m in c.consume(100, 0.5) if m.error() is None]
        c.close()
    finally:
        for p in procs.values():
            p.send_signal(signal.SIGTERM)
        codes = {name: p.wait(30) for name, p in procs.items()}
        for f in logs.values():
            f.close()
    output = {name: (tmp_path / f"{name}.log").read_text() for name in commands}
    assert codes == {"reward": 0, "proc": 0}, output
    assert sorted(t.task_id for t in flagged) == sorted(f"task-{i}" for i in (0, 4, 8, 12, 16)), output
    assert all(t.metadata["failed_tools"] == "python" for t in flagged)
    assert all(t.reward is not None and t.lineage[0].name == "exact_match" for t in flagged)  # scored by the reward app
    assert "stopped: 20 in, 20 out" in output["reward"] and "stopped: 20 in, 5 out" in output["proc"], output
