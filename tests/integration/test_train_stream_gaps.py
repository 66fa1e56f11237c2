"""Gaps in a train topic's offsets: transaction markers are not losses, retention is.

Read `read_committed`, every transaction leaves its commit marker (and an aborted
transaction its records) as a gap in the offsets the trainer sees; only records deleted
before the trainer read them are lost, and only those count in `TrainStream.skipped`.
"""

from __future__ import annotations

import uuid
from collections.abc import Callable
from pathlib import Path

from confluent_kafka import Producer, TopicPartition
from confluent_kafka.admin import AdminClient

from astraflow.config import KafkaSettings
from astraflow.models.tiny import init_tiny, load_tiny
from astraflow.serde import AvroSerde
from trainers.batching import BatchLimits
from trainers.data import TrainStream
from trainers.synthetic import make_samples


def _samples(tmp_path: Path, n_groups: int) -> list:
    model_dir = init_tiny(tmp_path / "tiny", vocab_size=512, hidden=32, layers=1, heads=2, kv_heads=1, intermediate=64)
    model, _ = load_tiny(model_dir)
    return make_samples(model, prompts=n_groups, group_size=4, policy="policy")


def _drain(kafka: KafkaSettings, topic: str, resume: dict[int, int] | None = None) -> tuple[int, dict[int, int]]:
    stream = TrainStream(kafka, topic, "policy", limits=BatchLimits(batch_size=64), max_wait_s=0.3,
                         stop_when_idle_s=3.0, resume_offsets=resume)
    taken = 0
    try:
        while (items := stream.next_batch()) is not None:
            taken += sum(1 for i in items if i.sample is not None)
    finally:
        stream.close()
    return taken, dict(stream.skipped)


def test_transaction_markers_and_aborted_records_are_not_counted_as_lost(
    kafka: KafkaSettings, topic_factory: Callable[..., str], tmp_path: Path
) -> None:
    topic = topic_factory("gaps", partitions=1)
    samples = _samples(tmp_path, 3)  # 12 samples
    serde = AvroSerde()
    p = Producer({**kafka.client_config(), "transactional.id": f"gaps-{uuid.uuid4().hex[:6]}"})
    p.init_transactions(30)
    for i in range(0, 12, 4):  # three committed transactions of 4, an aborted one between them
        p.begin_transaction()
        for s in samples[i : i + 4]:
            p.produce(topic, serde.dumps(s), key=b"k")
        p.commit_transaction(30)
        p.begin_transaction()
        p.produce(topic, serde.dumps(samples[0]), key=b"k")
        p.flush(30)  # written, then aborted (unflushed, it could be purged unsent: no aborted record to skip)
        p.abort_transaction(30)
    taken, skipped = _drain(kafka, topic)
    assert taken == 12
    assert skipped == {}  # 3 commit markers, 3 aborted records and their markers: 9 gaps, none lost


def test_records_deleted_before_they_were_read_are_counted_as_lost(
    kafka: KafkaSettings, topic_factory: Callable[..., str], tmp_path: Path
) -> None:
    topic = topic_factory("gone", partitions=1)
    samples = _samples(tmp_path, 2)  # 8 samples
    serde = AvroSerde()
    p = Producer(kafka.client_config())
    for s in samples:
        p.produce(topic, serde.dumps(s), key=b"k")
    assert p.flush(30) == 0
    admin = AdminClient(kafka.client_config())
    for fut in admin.delete_records([TopicPartition(topic, 0, 3)]).values():  # retention took offsets 0..2
        fut.result(30)
    taken, skipped = _drain(kafka, topic, resume={0: 0})  # a checkpoint from before the deletion
    assert taken == 5
    assert skipped == {0: 3}
