"""The Kafka layer against a real broker: round trips, exactly-once counting, DLQ, topic configs."""

from __future__ import annotations

import uuid

import pytest
from confluent_kafka import Consumer

from astraflow.config import KafkaSettings, TopicSettings
from astraflow.kafka.clients import RecordConsumer, RecordProducer
from astraflow.kafka.received import DeadLetterWriter
from astraflow.kafka.topics import TopicAdmin, topic_specs
from astraflow.records import DeadLetter, Task, Trajectory
from astraflow.serde import AvroSerde
from astraflow.testing import make_task, make_trajectory


def _drain(consumer: RecordConsumer, want: int, max_empty: int = 20) -> list:
    out, empty = [], 0
    while len(out) < want and empty < max_empty:
        batch = consumer.poll_batch(1000, 1.0)
        empty = 0 if batch else empty + 1
        out.extend(batch)
    return out


def test_confluent_kafka_round_trip(kafka: KafkaSettings, topic_factory) -> None:
    topic = topic_factory("rt")
    producer = RecordProducer(kafka)
    producer.send(topic, make_task(1), key="g-1")
    producer.flush()
    consumer = RecordConsumer(kafka, f"g-{uuid.uuid4().hex}", [topic], component="test", dlq=None, expect=Task)
    got = _drain(consumer, 1)
    consumer.close()
    assert [r.record.task_id for r in got] == ["task-1"] and got[0].key == b"g-1"


def test_ten_thousand_trajectories_exactly_once_bytes_equal(kafka: KafkaSettings, topic_factory) -> None:
    topic = topic_factory("traj", partitions=4)
    serde = AvroSerde()
    producer = RecordProducer(kafka, serde)
    sent: dict[str, bytes] = {}
    template = make_trajectory(512)
    for i in range(10_000):
        template.trajectory_id = f"t-{i}"
        template.group_id = f"g-{i % 97}"
        data = serde.dumps(template)
        sent[template.trajectory_id] = data
        producer.send_raw(topic, data, key=template.group_id)
    producer.flush(60)
    assert producer.delivered == 10_000

    # Raw consumer: compare bytes exactly; typed consumer: count ids exactly once.
    raw = Consumer({**kafka.client_config(), "group.id": f"raw-{uuid.uuid4().hex}", "auto.offset.reset": "earliest"})
    raw.subscribe([topic])
    seen_bytes = 0
    empty = 0
    while seen_bytes < 10_000 and empty < 20:
        msgs = raw.consume(1000, 1.0)
        empty = 0 if msgs else empty + 1
        for m in msgs:
            assert m.error() is None
            tid = serde.loads(m.value(), Trajectory).trajectory_id
            assert m.value() == sent[tid]
            seen_bytes += 1
    raw.close()
    assert seen_bytes == 10_000

    consumer = RecordConsumer(kafka, f"typed-{uuid.uuid4().hex}", [topic], component="test", dlq=None, expect=Trajectory)
    got = _drain(consumer, 10_000)
    consumer.commit(got)
    consumer.close()
    ids = [r.record.trajectory_id for r in got]
    assert len(ids) == 10_000 and set(ids) == set(sent)


def test_bad_input_goes_to_dlq_and_consumer_continues(kafka: KafkaSettings, topic_factory) -> None:
    topic, dlq_topic = topic_factory("in"), topic_factory("dlq", config={"max.message.bytes": str(16 * 1024 * 1024)})
    serde = AvroSerde()
    producer = RecordProducer(kafka, serde)
    good = serde.dumps(make_task(1))
    bad_fp = bytearray(good)
    bad_fp[2:10] = b"\xee" * 8
    schema_violation = good[:10] + b"\x99\x99\x99"  # valid header, body that is not a Task
    oversized = serde.dumps(make_trajectory(8192))  # over the consumer's 20 kB limit below
    for value in (b"not avro at all", bytes(bad_fp), schema_violation, oversized, good):
        producer.send_raw(topic, value, key=b"k")
    producer.flush()

    dlq = DeadLetterWriter(RecordProducer(kafka, serde), dlq_topic, component="test-consumer")
    consumer = RecordConsumer(
        kafka, f"g-{uuid.uuid4().hex}", [topic], component="test-consumer", dlq=dlq,
        serde=AvroSerde(max_record_bytes=20_000), expect=Task,
    )
    got = _drain(consumer, 1)
    consumer.commit()
    consumer.close()
    assert [r.record.task_id for r in got] == ["task-1"]
    assert consumer.dead_lettered == 4

    reader = RecordConsumer(kafka, f"d-{uuid.uuid4().hex}", [dlq_topic], component="t", dlq=None, expect=DeadLetter)
    letters = [r.record for r in _drain(reader, 4)]
    reader.close()
    assert [d.error_class for d in letters] == [
        "CorruptRecordError", "UnknownSchemaError", "CorruptRecordError", "RecordTooLargeError",
    ]
    assert [d.offset for d in letters] == [0, 1, 2, 3]
    assert letters[0].original == b"not avro at all" and letters[3].original == oversized
    assert all(d.topic == topic and d.component == "test-consumer" and d.error for d in letters)
    assert "upgrade, or add its .avsc" in letters[1].error


def test_experiment_topics_have_the_right_configs(kafka: KafkaSettings, unique) -> None:
    exp = unique("cfg")
    admin = TopicAdmin(kafka)
    specs = topic_specs(exp, ["solver", "verifier"], TopicSettings(partitions=3))
    try:
        result = admin.create(specs)
        assert set(result.values()) == {"created"}
        assert set(admin.create(specs).values()) == {"exists"}
        listed = admin.list(f"af.{exp}.")
        assert listed[f"af.{exp}.tasks"] == 3
        assert listed[f"af.{exp}.solver.weights"] == 2  # the stream (0) and the snapshots beside it (1)
        assert f"af.{exp}.verifier.train" in listed
        conf = admin.describe([f"af.{exp}.control", f"af.{exp}.solver.weights", f"af.{exp}.rollouts"])
        assert conf[f"af.{exp}.control"]["cleanup.policy"] == "compact"
        assert conf[f"af.{exp}.solver.weights"]["max.message.bytes"] == str(16 * 1024 * 1024)
        assert conf[f"af.{exp}.rollouts"]["retention.ms"] == str(30 * 24 * 3600 * 1000)
    finally:
        admin.delete([s.name for s in specs])


@pytest.mark.parametrize("n", [3])
def test_pause_keeps_membership_and_commit_resumes_after_processed(kafka: KafkaSettings, topic_factory, n: int) -> None:
    topic = topic_factory("bp")
    producer = RecordProducer(kafka)
    for i in range(n):
        producer.send(topic, make_task(i))
    producer.flush()
    group = f"g-{uuid.uuid4().hex}"
    c = RecordConsumer(kafka, group, [topic], component="t", dlq=None, expect=Task)
    first = _drain(c, 1)[:1]
    c.pause_all()
    assert c.poll_batch(10, 0.5) == []  # paused: nothing fetched, but polling keeps us in the group
    c.resume_all()
    c.commit(first)  # only the first record is marked processed
    c.close()
    c2 = RecordConsumer(kafka, group, [topic], component="t", dlq=None, expect=Task)
    rest = _drain(c2, n - 1)
    c2.close()
    assert [r.record.task_id for r in rest] == [f"task-{i}" for i in range(1, n)]
