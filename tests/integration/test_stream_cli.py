"""The commands as separate processes: `astraflow app run reward` feeding a user processor run with
`astraflow process run` (the example in stream_apps/examples); both serve their own Prometheus
endpoint (ASTRAFLOW_METRICS_PORT) under the same metric names and stop cleanly on SIGTERM."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
import urllib.request
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
        "proc": [sys.executable, "-m", "astraflow_cli.main", "process", "run",
                 "stream_apps.examples.tool_errors:tool_errors", "-e", experiment],
    }
    logs = {name: (tmp_path / f"{name}.log").open("w") for name in commands}
    ports = {name: _free_port() for name in commands}
    procs = {name: subprocess.Popen(cmd, cwd=ROOT, env={**env, "ASTRAFLOW_METRICS_PORT": str(ports[name])},
                                    stdout=logs[name], stderr=subprocess.STDOUT)
             for name, cmd in commands.items()}
    scraped: dict[str, str] = {}
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
        want = {"reward": 'astraflow_records_in_total{component="reward",', "proc": 'component="proc.tool-errors",'}
        while time.monotonic() < deadline + 30 and not all(
                any(ln.startswith("astraflow_records_in_total{") and want[n] in ln and ln.endswith(" 20.0")
                    for ln in scraped.get(n, "").splitlines()) for n in commands):
            time.sleep(0.5)
            scraped = {name: _scrape(port) for name, port in ports.items()}
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
    # Each process's own endpoint: one name per counter, the role in a label; the reward app's 20
    # in and 20 out, the processor's 20 in and 5 out (15 dropped on purpose).
    for name, (component, out) in {"reward": ("reward", 20), "proc": ("proc.tool-errors", 5)}.items():
        text = scraped[name]
        assert f'astraflow_role_up{{component="{component}",experiment="{experiment}"' in text, text[-2000:]
        for metric, value in (("records_in_total", 20), ("records_out_total", out)):
            assert any(ln.startswith(f"astraflow_{metric}{{") and f'component="{component}"' in ln
                       and ln.endswith(f" {value:.1f}") for ln in text.splitlines()), (metric, text[-3000:])


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def _scrape(port: int) -> str:
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5) as resp:
            return resp.read().decode()
    except OSError:  # not listening yet
        return ""
