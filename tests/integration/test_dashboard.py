"""`astraflow dashboard` in headless Chromium during a short run on the real broker.

The test runs the reward and curate apps on records it produces, serves the page, loads it in
Debian's `chromium` (scripts/system-deps.sh installs it), and checks the graph and the numbers
the page shows against counts it takes from the topics itself (watermarks and consumer group
offsets through its own clients, not the page's code). The screenshot is saved to
build/screenshots/dashboard.png (or $ASTRAFLOW_SCREENSHOT_DIR) for a person to look at.
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import time
import uuid
from collections.abc import Callable
from pathlib import Path

import pytest
from confluent_kafka import Consumer, TopicPartition

from astraflow.config import KafkaSettings
from astraflow.kafka.clients import RecordProducer
from astraflow.kafka.topics import Topics
from astraflow.records import DeadLetter, Metric
from astraflow.testing import make_trajectory
from stream_apps.engine import EngineSettings
from stream_apps.launch import AppOptions, build_worker

ROOT = Path(__file__).resolve().parents[2]
POLICY = "solver"


def _chromium() -> str:
    for name in ("chromium", "chromium-browser"):
        if path := shutil.which(name):
            return path
    if os.environ.get("ASTRAFLOW_REQUIRE_CHROMIUM") == "1":
        pytest.fail("no chromium: bash scripts/system-deps.sh installs it")
    pytest.skip("no chromium (bash scripts/system-deps.sh installs it)")


@pytest.fixture
def exp(make_experiment: Callable[..., str]) -> str:
    return make_experiment("dash", [POLICY])


def _ends(kafka: KafkaSettings, topic: str) -> int:
    c = Consumer({**kafka.client_config(), "group.id": f"ends-{uuid.uuid4().hex}"})
    try:
        parts = c.list_topics(topic, timeout=10).topics[topic].partitions
        return sum(c.get_watermark_offsets(TopicPartition(topic, p), timeout=10)[1] for p in parts)
    finally:
        c.close()


def _lag(kafka: KafkaSettings, group: str, topic: str) -> int:
    c = Consumer({**kafka.client_config(), "group.id": group})
    try:
        parts = c.list_topics(topic, timeout=10).topics[topic].partitions
        committed = c.committed([TopicPartition(topic, p) for p in parts], timeout=10)
        return sum(c.get_watermark_offsets(tp, timeout=10)[1] - max(tp.offset, 0) for tp in committed)
    finally:
        c.close()


def _dom(chromium: str, url: str, shot: Path | None = None) -> str:
    args = [chromium, "--headless", "--no-sandbox", "--disable-gpu", "--virtual-time-budget=8000",
            "--window-size=1200,900"]
    if shot is not None:
        res = subprocess.run([*args, f"--screenshot={shot}", url], capture_output=True, text=True, timeout=120)
        assert shot.exists(), res.stderr[-2000:]
    res = subprocess.run([*args, "--dump-dom", url], capture_output=True, text=True, timeout=120)
    assert res.returncode == 0, res.stderr[-2000:]
    return res.stdout


def test_the_page_shows_the_run_as_the_topics_count_it(kafka: KafkaSettings, exp: str) -> None:
    from astraflow.ops.dashboard import DashboardServer, DashboardState

    chromium = _chromium()
    topics = Topics(exp)
    producer = RecordProducer(kafka)
    for g in range(3):
        for i in range(4):
            t = make_trajectory(96, task_id=f"g{g}", sample_index=i, group_size=4, policy=POLICY, seed=i, version=2)
            t.group_id, t.final_answer = f"g{g}", ("4" if i % 2 else "5")
            producer.send(topics.rollouts, t, key=t.group_id)
    producer.send(topics.dlq, DeadLetter(b"x", topics.rollouts, 0, 0, "CorruptRecordError", "not an Avro record", "reward"))
    producer.send(topics.metrics, Metric("policy_version", 2.0, "raas", "node-a", {"node_id": "node-a", "region": "eu-west",
                                                                                 "hardware": "cpu:2", "backend": "torch",
                                                                                 "policy": POLICY}))
    producer.flush()
    workers = [build_worker("reward", EngineSettings(exp, kafka, commit_interval_s=0.5)),
               build_worker("curate", EngineSettings(exp, kafka, commit_interval_s=0.5), AppOptions(policies=[POLICY]))]
    threads = [w.start_thread() for w in workers]
    state = DashboardState(kafka, exp, interval_s=1.0, window_s=30.0).start()
    server = DashboardServer(state)
    shots = Path(os.environ.get("ASTRAFLOW_SCREENSHOT_DIR", ROOT / "build" / "screenshots"))
    shots.mkdir(parents=True, exist_ok=True)
    try:
        deadline = time.monotonic() + 90
        while time.monotonic() < deadline and _ends(kafka, topics.train(POLICY)) < 12:
            time.sleep(0.5)
        time.sleep(3)  # the curate transaction commits its offsets; the state refreshes every second
        dom = _dom(chromium, server.url, shots / "dashboard.png")
        ends = {s: _ends(kafka, t) for s, t in (("rollouts", topics.rollouts), ("scored", topics.scored),
                                                ("train", topics.train(POLICY)), ("dlq", topics.dlq))}
        curate_lag = _lag(kafka, f"af.{exp}.curate", topics.scored)
    finally:
        server.close()
        state.stop()
        for w in workers:
            w.stop()
        for th in threads:
            th.join(30)
    print(f"\nscreenshot: {shots / 'dashboard.png'}")
    assert ends["train"] >= 12 and ends["scored"] >= 12  # end offsets: records and transaction markers
    assert f">{exp}<" in dom and "live," in dom, dom[:3000]
    # Every role and topic of the dataflow is drawn, with the records the topics hold.
    for node in ("role-curator", "role-raas", "role-reward", "role-curate", "role-trainer", "topic-tasks", "topic-dlq"):
        assert f'id="{node}"' in dom, node
    for stream, n in ends.items():
        assert re.search(rf'id="topic-{stream}"[^>]*data-records="{n}"', dom), (stream, n)
    # Edges: rollouts -> reward -> scored -> curate -> train, with curate's lag on scored.
    edge = re.search(r'<g class="edge[^"]*" data-from="topic:scored" data-to="role:curate"[^>]*data-lag="(\d+)"', dom)
    assert edge and int(edge.group(1)) == curate_lag, (edge, curate_lag)  # transaction markers count as lag
    assert 'data-from="role:reward" data-to="topic:scored"' in dom
    # The node's version, the DLQ's reason, the reward curve.
    assert "node-a" in dom and "solver@v2" in dom
    assert "not an Avro record" in dom and "CorruptRecordError" in dom
    assert re.search(r'<polyline[^>]*data-points="\d+"', dom)
