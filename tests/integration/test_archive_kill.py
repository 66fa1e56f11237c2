"""`kill -9` of the archive app mid-run, then a restart: every record is archived exactly once."""

from __future__ import annotations

import itertools
import os
import signal
import subprocess
import sys
import time
import uuid
from collections import defaultdict
from pathlib import Path

import pytest
from confluent_kafka import Consumer, TopicPartition

from astraflow.archive import ArchiveReader
from astraflow.config import KafkaSettings
from astraflow.kafka.clients import RecordProducer
from astraflow.serde import AvroSerde
from astraflow.testing import make_trajectory

pytestmark = pytest.mark.timeout(120)  # a hang fails fast instead of holding the suite

ROOT = Path(__file__).resolve().parents[2]


def _start(kafka: KafkaSettings, topic: str, archive: Path, group: str, log: Path, *extra: str) -> subprocess.Popen:
    cmd = [
        sys.executable, "-m", "astraflow_cli.main", "--set", f"kafka.bootstrap_servers={kafka.bootstrap_servers}",
        "archive", "run", "--topics", topic, "--to", str(archive), "--group", group,
        "--instance-id", "archive-0", "--max-file-age", "0.5", "--block-kb", "4", *extra,
    ]
    return subprocess.Popen(cmd, cwd=ROOT, stdout=open(log, "ab"), stderr=subprocess.STDOUT)


def consume_all(kafka: KafkaSettings, topic: str, want: int) -> dict[int, list]:
    c = Consumer({**kafka.client_config(), "group.id": f"read-{uuid.uuid4().hex}", "enable.auto.commit": False})
    c.assign([TopicPartition(topic, p, 0) for p in c.list_topics(topic, timeout=10).topics[topic].partitions])
    out: dict[int, list] = defaultdict(list)
    n, last = 0, time.monotonic()
    while n < want and time.monotonic() - last < 5:
        for m in c.consume(500, 0.5):
            if m.error() is None:
                out[m.partition()].append(m)
                n, last = n + 1, time.monotonic()
    c.close()
    return out


def _wait_for(cond, timeout_s: float) -> bool:
    end = time.monotonic() + timeout_s
    while time.monotonic() < end:
        if cond():
            return True
        time.sleep(0.05)
    return False


def test_kill_9_mid_run_then_restart_archives_every_record_exactly_once(
    kafka: KafkaSettings, topic_factory, tmp_path: Path
) -> None:
    topic = topic_factory("kill", partitions=2)
    archive, group, log = tmp_path / "archive", f"archive-{uuid.uuid4().hex}", tmp_path / "app.log"
    serde = AvroSerde()
    producer = RecordProducer(kafka, serde)
    template = make_trajectory(64)
    first = _start(kafka, topic, archive, group, log)
    second = None
    staging_at_kill: list[Path] = []
    try:
        for batch in range(40):
            for i in range(25):
                template.trajectory_id = f"t-{batch}-{i}"
                producer.send(topic, template, key=f"g-{i % 7}")
            producer.flush()
            time.sleep(0.05)
            if batch == 10:  # the app is running and has sealed files
                assert _wait_for(lambda: any(archive.glob("*/p*/*.manifest.json")), 60), log.read_text()
            if batch == 20:  # production goes on while the app dies
                os.kill(first.pid, signal.SIGKILL)
                first.wait(10)
                staging_at_kill = list(archive.glob("*/p*/.*.part"))
        sealed_before = len(list(archive.glob("*/p*/*.manifest.json")))
        second = _start(kafka, topic, archive, group, log, "--exit-when-idle", "2")
        assert second.wait(90) == 0, log.read_text()
    finally:
        for proc in (first, second):
            if proc is not None and proc.poll() is None:
                proc.kill()
                proc.wait(10)

    truth = consume_all(kafka, topic, 1000)
    assert sum(len(v) for v in truth.values()) == 1000
    reader = ArchiveReader(archive)
    total = 0
    for p, msgs in truth.items():
        archived = list(reader.read_partition(topic, p))
        assert [r.offset for r in archived] == [m.offset() for m in msgs]  # each offset once, none missing
        assert [r.value for r in archived] == [m.value() for m in msgs]
        files = reader.files(topic, p)
        assert all(a.last_offset < b.first_offset for a, b in itertools.pairwise(files))
        total += sum(f.manifest.records for f in files if f.manifest)
    assert total == 1000
    assert not list(archive.glob("*/p*/.*.part"))  # staging files of the killed run were removed
    print(f"sealed files before kill+restart: {sealed_before}, staging files left by kill -9: {len(staging_at_kill)}, "
          f"files after: {sum(len(reader.files(topic, p)) for p in truth)}")
