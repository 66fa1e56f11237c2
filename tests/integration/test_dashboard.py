"""`astraflow dashboard` in headless Chromium during a short run on the real broker.

The test runs the reward and curate apps and a user processor on records it produces, serves
the page, loads it in Debian's `chromium` (scripts/system-deps.sh installs it), and checks the
graph and the numbers the page shows against counts it takes from the topics itself (records a
read_committed consumer reads, and consumer group offsets, through its own clients, not the
page's code): records, not offsets, so transaction markers never count. Only edges that exist are
drawn (no archive runs, so no archive edge), the processor and the topic it writes are, and the
charts have labelled axes. The screenshot is saved to build/screenshots/dashboard.png (or
$ASTRAFLOW_SCREENSHOT_DIR) for a person to look at.
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import time
import uuid
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
from confluent_kafka import Consumer, TopicPartition

import astraflow
from astraflow.config import KafkaSettings
from astraflow.kafka.clients import RecordProducer
from astraflow.kafka.topics import Topics
from astraflow.records import DeadLetter, Metric, Trajectory
from astraflow.testing import issue_tasks, make_trajectory
from stream_apps.engine import EngineSettings
from stream_apps.launch import AppOptions, build_processor_worker, build_worker

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
def exp(make_experiment: Callable[..., str], kafka: KafkaSettings) -> Iterator[str]:
    from astraflow.kafka.topics import TopicAdmin

    name = make_experiment("dash", [POLICY])
    yield name
    admin = TopicAdmin(kafka)  # the processor's sink, which it made
    if made := list(admin.list(f"af.{name}.long-answers")):
        admin.delete(made)


def _offsets(kafka: KafkaSettings, topic: str) -> list[tuple[int, int]]:
    """Offsets of every committed record of `topic`: (partition, offset), read as a consumer reads them."""
    c = Consumer({**kafka.client_config(), "group.id": f"ends-{uuid.uuid4().hex}", "isolation.level": "read_committed",
                  "enable.partition.eof": True, "enable.auto.commit": False})
    try:
        parts = c.list_topics(topic, timeout=10).topics[topic].partitions
        c.assign([TopicPartition(topic, p, 0) for p in parts])
        out, pending, deadline = [], set(parts), time.monotonic() + 20
        while pending and time.monotonic() < deadline:
            for m in c.consume(500, 0.5):
                if m.error() is None:
                    out.append((m.partition(), m.offset()))
                elif m.error().code() == m.error()._PARTITION_EOF:
                    pending.discard(m.partition())
        return out
    finally:
        c.close()


def _records(kafka: KafkaSettings, topic: str) -> int:
    return len(_offsets(kafka, topic))


def _lag(kafka: KafkaSettings, group: str, topic: str) -> int:
    """Records of `topic` at or after the group's committed offsets."""
    c = Consumer({**kafka.client_config(), "group.id": group})
    try:
        parts = c.list_topics(topic, timeout=10).topics[topic].partitions
        committed = {tp.partition: max(tp.offset, 0)
                     for tp in c.committed([TopicPartition(topic, p) for p in parts], timeout=10)}
    finally:
        c.close()
    return sum(1 for p, off in _offsets(kafka, topic) if off >= committed[p])


@astraflow.processor(source="scored", sink="long-answers", name="long-answers", expect=Trajectory)
def long_answers(t: Trajectory) -> Trajectory | None:
    """The docs' kind of processor: keeps what it is looking for (here: odd answers)."""
    return t if t.final_answer == "5" else None


def _dom(chromium: str, url: str, shot: Path | None = None) -> str:
    args = [chromium, "--headless", "--no-sandbox", "--disable-gpu", "--virtual-time-budget=8000",
            "--window-size=1200,1250"]
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
            issue_tasks(kafka, exp, [t])  # its group's task, as the curator issued it
            producer.send(topics.rollouts, t, key=t.group_id)
    producer.send(topics.dlq, DeadLetter(b"x", topics.rollouts, 0, 0, "CorruptRecordError", "not an Avro record", "reward"))
    producer.send(topics.metrics, Metric("policy_version", 2.0, "raas", "node-a", {"node_id": "node-a", "region": "eu-west",
                                                                                 "hardware": "cpu:2", "backend": "torch",
                                                                                 "policy": POLICY}))
    producer.flush()
    workers = [build_worker("reward", EngineSettings(exp, kafka, commit_interval_s=0.5)),
               build_worker("curate", EngineSettings(exp, kafka, commit_interval_s=0.5), AppOptions(policies=[POLICY])),
               build_processor_worker(long_answers, EngineSettings(exp, kafka, commit_interval_s=0.5,
                                                                   metrics_interval_s=1.0))]
    threads = [w.start_thread() for w in workers]
    state = DashboardState(kafka, exp, interval_s=1.0, window_s=30.0).start()
    server = DashboardServer(state)
    shots = Path(os.environ.get("ASTRAFLOW_SCREENSHOT_DIR", ROOT / "build" / "screenshots"))
    shots.mkdir(parents=True, exist_ok=True)
    try:
        deadline = time.monotonic() + 90
        while time.monotonic() < deadline and (_records(kafka, topics.train(POLICY)) < 12
                                               or _records(kafka, topics.stream("long-answers")) < 6):
            time.sleep(0.5)
        time.sleep(3)  # the transactions commit their offsets; the metrics and the state refresh every second
        dom = _dom(chromium, server.url, shots / "dashboard.png")
        counts = {s: _records(kafka, t) for s, t in (("rollouts", topics.rollouts), ("scored", topics.scored),
                                                     ("train", topics.train(POLICY)), ("dlq", topics.dlq),
                                                     ("long-answers", topics.stream("long-answers")))}
        curate_lag = _lag(kafka, f"af.{exp}.curate", topics.scored)
        proc_lag = _lag(kafka, f"af.{exp}.proc.long-answers", topics.scored)
    finally:
        server.close()
        state.stop()
        for w in workers:
            w.stop()
        for th in threads:
            th.join(30)
    print(f"\nscreenshot: {shots / 'dashboard.png'}")
    assert counts["train"] == 12 and counts["scored"] == 12 and counts["long-answers"] == 6
    assert f">{exp}<" in dom and "live," in dom, dom[:3000]
    # The roles that run and the topics they use are drawn, with the records the topics hold
    # (transactional topics: records, not offsets); no archive or trainer runs here (the groups'
    # tasks are on `tasks`, signed as the curator signs them: the curator is drawn).
    for node in ("role-reward", "role-curate", "role-proc.long-answers", "topic-rollouts", "topic-long-answers",
                 "topic-dlq", "role-curator", "topic-tasks"):
        assert f'id="{node}"' in dom, node
    for node in ("role-archive", "role-trainer"):
        assert f'id="{node}"' not in dom, node
    assert 'data-from="role:archive"' not in dom and 'data-to="role:archive"' not in dom
    for stream, n in counts.items():
        assert re.search(rf'id="topic-{stream}"[^>]*data-records="{n}"', dom), (stream, n)
    # The processor between its source (its group's lag) and the topic it writes; its counts in the table.
    edge = re.search(r'data-from="topic:scored" data-to="role:proc.long-answers"[^>]*data-lag="(\d+)"', dom)
    assert edge and int(edge.group(1)) == proc_lag, (edge, proc_lag)
    assert 'data-from="role:proc.long-answers" data-to="topic:long-answers"' in dom
    assert re.search(r"<td>proc.long-answers</td><td>1</td><td>scored</td><td>long-answers</td><td>12</td><td>6</td>"
                     r"<td>0</td><td>6</td>", dom), dom[dom.find('id="apps"'):][:800]
    for label in ("mean reward", "held-out success", "policy version", ">time<"):  # labelled chart axes
        assert label in dom, label

    # Edges: rollouts -> reward -> scored -> curate -> train, with curate's lag on scored.
    edge = re.search(r'<g class="edge[^"]*" data-from="topic:scored" data-to="role:curate"[^>]*data-lag="(\d+)"', dom)
    assert edge and int(edge.group(1)) == curate_lag, (edge, curate_lag)  # records, markers left out
    assert 'data-from="role:reward" data-to="topic:scored"' in dom
    # The node's version, the DLQ's reason, the reward curve.
    assert "node-a" in dom and "solver@v2" in dom
    assert "not an Avro record" in dom and "CorruptRecordError" in dom
    assert re.search(r'<polyline[^>]*data-points="\d+"', dom)
