"""Archive and replay against a real Kafka: same bytes, same order, old schemas, rate, time ranges."""

from __future__ import annotations

import json
import shutil
import time
import uuid
from collections import defaultdict
from pathlib import Path

import pytest
from confluent_kafka import Consumer, Producer, TopicPartition

from astraflow.archive import ArchivedRecord, ArchiveReader, ArchiveWriter, RollPolicy
from astraflow.archive.replay import PROVENANCE_HEADER, Replayer, ReplayOptions, open_source
from astraflow.config import KafkaSettings
from astraflow.kafka.clients import RecordProducer
from astraflow.schema_catalog import SchemaCatalog, default_schemas_dir
from astraflow.serde import AvroSerde
from astraflow.testing import make_trajectory
from stream_apps import archive as archive_app

pytestmark = pytest.mark.timeout(120)  # a hang fails fast instead of holding the suite

def consume_all(kafka: KafkaSettings, topic: str, want: int, idle_s: float = 5.0) -> dict[int, list]:
    """Every message of `topic` by partition, in offset order (reads until `want` or idle)."""
    c = Consumer({**kafka.client_config(), "group.id": f"read-{uuid.uuid4().hex}", "enable.auto.commit": False})
    md = c.list_topics(topic, timeout=10)
    c.assign([TopicPartition(topic, p, 0) for p in md.topics[topic].partitions])
    out: dict[int, list] = defaultdict(list)
    n, last = 0, time.monotonic()
    while n < want and time.monotonic() - last < idle_s:
        for m in c.consume(500, 0.5):
            if m.error() is None:
                out[m.partition()].append(m)
                n += 1
                last = time.monotonic()
    c.close()
    return out


def trajectories(n: int, serde: AvroSerde) -> list[bytes]:
    return [serde.dumps(make_trajectory(64, task_id=f"task-{i}", seed=i, reward=(i % 10) / 10)) for i in range(n)]


def test_archive_then_replay_same_bytes_same_order_counted(kafka: KafkaSettings, topic_factory, tmp_path: Path) -> None:
    src, dst = topic_factory("arch-src", partitions=3), topic_factory("arch-dst", partitions=3)
    serde = AvroSerde()
    producer = RecordProducer(kafka, serde)
    for i, value in enumerate(trajectories(300, serde)):
        producer.send_raw(src, value, key=f"g-{i % 11}", headers={"n": str(i)})
    producer.flush()
    original = consume_all(kafka, src, 300)

    group = f"archive-{uuid.uuid4().hex}"
    stats = archive_app.run(kafka, [src], str(tmp_path), group=group,
                            policy=RollPolicy(max_file_records=40, block_records=8), exit_when_idle_s=1.0)
    assert stats.records == 300 and stats.skipped == 0
    reader = ArchiveReader(tmp_path)
    assert reader.count(src) == 300 and reader.partitions(src) == sorted(original)
    # Offsets were committed for exactly what the files hold.
    c = Consumer({**kafka.client_config(), "group.id": group})
    committed = c.committed([TopicPartition(src, p) for p in original], timeout=10)
    c.close()
    assert {tp.partition: tp.offset for tp in committed} == {p: len(msgs) for p, msgs in original.items()}

    source = open_source(str(tmp_path), kafka)
    rstats = Replayer(kafka, dst, ReplayOptions()).run(source.records)
    assert (rstats.read, rstats.published, rstats.filtered_out) == (300, 300, 0)

    replayed = consume_all(kafka, dst, 300)
    assert sum(len(v) for v in replayed.values()) == 300
    for p, msgs in original.items():
        got = replayed[p]
        assert [m.value() for m in got] == [m.value() for m in msgs]  # byte-identical, same order
        assert [m.key() for m in got] == [m.key() for m in msgs]
        assert [dict(m.headers())["n"] for m in got] == [dict(m.headers())["n"] for m in msgs]
        assert [dict(m.headers())[PROVENANCE_HEADER].decode() for m in got] == [f"{src}/{p}/{m.offset()}" for m in msgs]


def _v2_catalog(tmp_path: Path) -> SchemaCatalog:
    root = tmp_path / "schemas"
    shutil.copytree(default_schemas_dir(), root)
    latest = SchemaCatalog.load(root).latest("astraflow.Trajectory")
    v2 = json.loads(latest.path.read_text())
    v2["fields"].append({"name": "difficulty", "type": "double", "default": 0.5})
    (root / "trajectory" / f"v{latest.version + 1}.avsc").write_text(json.dumps(v2))
    return SchemaCatalog.load(root)


def test_archive_of_an_older_schema_version_replays_into_the_current_one(kafka: KafkaSettings, topic_factory, tmp_path: Path) -> None:
    old, new = AvroSerde(SchemaCatalog.load(default_schemas_dir())), AvroSerde(_v2_catalog(tmp_path))
    values = trajectories(20, old)
    writer = ArchiveWriter(tmp_path / "archive", catalog=old.catalog)
    for i, v in enumerate(values):
        writer.append(ArchivedRecord("af.past.rollouts", 0, i, 1_700_000_000_000 + i, v, b"k"))
    (manifest,) = writer.close()
    v1_fp, v2_fp = old.catalog.latest("astraflow.Trajectory").fingerprint, new.catalog.latest("astraflow.Trajectory").fingerprint
    assert list(manifest.schemas) == [v1_fp.hex()] and v1_fp != v2_fp

    # A filter decodes v1 records through their fingerprint into v2; --reencode writes v2.
    upgraded = topic_factory("v2")
    reader = ArchiveReader(tmp_path / "archive")
    opts = ReplayOptions(filter="reward >= 0.5 and difficulty == 0.5", reencode=True)
    stats = Replayer(kafka, upgraded, opts, serde=new).run(reader.read_topic("af.past.rollouts"))
    assert (stats.published, stats.filtered_out, stats.reencoded) == (10, 10, 10)
    got = consume_all(kafka, upgraded, 10)[0]
    assert all(m.value()[2:10] == v2_fp for m in got)
    decoded = [new.decode(m.value())[1] for m in got]
    assert [d["task_id"] for d in decoded] == [f"task-{i}" for i in range(20) if i % 10 >= 5]
    assert all(d["difficulty"] == 0.5 for d in decoded)

    # Without --reencode the archived v1 bytes go out unchanged, and still decode as v2.
    as_is = topic_factory("v1")
    Replayer(kafka, as_is, ReplayOptions(), serde=new).run(reader.read_topic("af.past.rollouts"))
    got = consume_all(kafka, as_is, 20)[0]
    assert [m.value() for m in got] == values
    assert new.decode(got[0].value())[1]["difficulty"] == 0.5


def test_replay_rate_limit_within_ten_percent(kafka: KafkaSettings, topic_factory, tmp_path: Path) -> None:
    serde = AvroSerde()
    writer = ArchiveWriter(tmp_path)
    for i, v in enumerate(trajectories(200, serde)):
        writer.append(ArchivedRecord("af.past.rollouts", 0, i, 1_700_000_000_000, v, None))
    writer.close()
    dst = topic_factory("rate")
    t0 = time.monotonic()
    stats = Replayer(kafka, dst, ReplayOptions(rate=100)).run(ArchiveReader(tmp_path).read_topic("af.past.rollouts"))
    wall = time.monotonic() - t0
    msgs = consume_all(kafka, dst, 200)[0]
    ts = [m.timestamp()[1] for m in msgs]
    broker_rate = (len(ts) - 1) / ((ts[-1] - ts[0]) / 1000)
    print(f"asked 100/s: sender {stats.rate:.1f}/s, broker timestamps {broker_rate:.1f}/s, wall {wall:.2f} s for 200")
    assert stats.published == 200 and len(msgs) == 200
    assert abs(stats.rate - 100) <= 10 and abs(broker_rate - 100) <= 10
    assert wall >= 1.8  # 199 gaps of 10 ms cannot take less


def test_replay_from_a_topic_by_time_with_filter_and_limit(kafka: KafkaSettings, topic_factory) -> None:
    src, dst = topic_factory("bytime", partitions=2), topic_factory("bytime-dst", partitions=2)
    serde = AvroSerde()
    base = int(time.time() * 1000) - 3_600_000
    p = Producer(kafka.client_config())
    values = [serde.dumps(make_trajectory(32, task_id=f"task-{i}", reward=i / 40)) for i in range(40)]
    for i, v in enumerate(values):  # one record a minute, alternating partitions
        p.produce(src, value=v, key=f"k{i}", partition=i % 2, timestamp=base + i * 60_000)
    p.flush(10)

    since, until = base + 10 * 60_000, base + 29 * 60_000
    source = open_source(src, kafka, since_ms=since, until_ms=until)
    assert source.total == 20
    stats = Replayer(kafka, dst, ReplayOptions(since_ms=since, until_ms=until)).run(source.records)
    source.close()
    got = consume_all(kafka, dst, 20)
    assert stats.published == 20
    assert {q: [m.key().decode() for m in ms] for q, ms in got.items()} == {
        0: [f"k{i}" for i in range(10, 30) if i % 2 == 0], 1: [f"k{i}" for i in range(10, 30) if i % 2 == 1]
    }

    filtered = topic_factory("bytime-f", partitions=1)  # fewer partitions: the key decides
    source = open_source(src, kafka, since_ms=since)
    stats = Replayer(kafka, filtered, ReplayOptions(filter="reward >= 0.5 and _partition == 0", limit=4)).run(source.records)
    source.close()
    got = consume_all(kafka, filtered, 4, idle_s=2.0)[0]
    assert stats.published == 4 and sorted(m.key().decode() for m in got) == ["k20", "k22", "k24", "k26"]


def test_replay_speed_follows_the_original_pace(kafka: KafkaSettings, topic_factory, tmp_path: Path) -> None:
    """--speed 2 halves the original gaps: 40 records 50 ms apart take ~0.98 s instead of 1.95 s."""
    serde = AvroSerde()
    writer = ArchiveWriter(tmp_path)
    for i, v in enumerate(trajectories(40, serde)):
        writer.append(ArchivedRecord("af.past.rollouts", 0, i, 1_700_000_000_000 + 50 * i, v, None))
    writer.close()
    dst = topic_factory("speed")
    stats = Replayer(kafka, dst, ReplayOptions(speed=2)).run(ArchiveReader(tmp_path).read_topic("af.past.rollouts"))
    ts = [m.timestamp()[1] for m in consume_all(kafka, dst, 40)[0]]
    span_s = (ts[-1] - ts[0]) / 1000
    print(f"speed 2: original span 1.95 s, replayed span {span_s:.3f} s")
    assert stats.published == 40 and abs(span_s - 0.975) <= 0.1
