"""bench/_ledger.TopicReader on the real broker: every read ends at the end of every partition,
also when a partition has nothing new since the previous read (librdkafka reports a partition's
end once per arrival there, not on every later read), and it reads only committed records."""

from __future__ import annotations

import uuid
from collections.abc import Callable

import pytest
from _ledger import TopicReader
from confluent_kafka import Producer

from astraflow.config import KafkaSettings
from astraflow.records import Metric
from astraflow.serde import AvroSerde

pytestmark = pytest.mark.integration


def _metric(i: int) -> bytes:
    return AvroSerde().dumps(Metric(name="m", value=float(i), component="test", instance="reader"))


def _names(got: list) -> list[tuple[int, float]]:
    return sorted((p, rec.value) for rec, _, p, _ in got)


def test_reads_end_at_every_partition_end_also_with_nothing_new_and_skip_aborted(
        kafka: KafkaSettings, topic_factory: Callable[..., str]) -> None:
    topic = topic_factory("reader", partitions=3)
    producer = Producer({**kafka.client_config(), "transactional.id": f"reader-{uuid.uuid4().hex[:8]}"})
    producer.init_transactions(30)
    producer.begin_transaction()
    producer.produce(topic, _metric(1), partition=0)
    producer.produce(topic, _metric(2), partition=0)
    producer.produce(topic, _metric(3), partition=1)
    producer.commit_transaction(30)  # partition 2 stays empty
    reader = TopicReader(kafka, topic)
    try:
        assert _names(reader.read_located(60)) == [(0, 1.0), (0, 2.0), (1, 3.0)] and reader.at_end
        # nothing new anywhere: the read still ends at every partition's end (not at its deadline)
        assert reader.read_located(60) == [] and reader.at_end
        # an aborted transaction on partition 1, a committed one on partition 0: only the committed
        # record is read, and the aborted records' partition counts as at its end again
        producer.begin_transaction()
        producer.produce(topic, _metric(4), partition=1)
        producer.flush(30)
        producer.abort_transaction(30)
        producer.begin_transaction()
        producer.produce(topic, _metric(5), partition=0)
        producer.commit_transaction(30)
        assert _names(reader.read_located(60)) == [(0, 5.0)] and reader.at_end
        assert reader.read_located(60) == [] and reader.at_end
        # a record on the partition that was empty so far
        producer.begin_transaction()
        producer.produce(topic, _metric(6), partition=2)
        producer.commit_transaction(30)
        assert _names(reader.read_located(60)) == [(2, 6.0)] and reader.at_end
    finally:
        reader.close()
