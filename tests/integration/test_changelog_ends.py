"""Where a read_committed reader's last record is in a partition that ends in transaction markers.

Faust's table recovery ends once it has applied the record before its highwater; under
exactly-once a changelog ends in a commit marker (and maybe aborted records), which no reader
sees, so `last_readable` gives the recovery its real end (`stream_apps.transactions`).
"""

from __future__ import annotations

import time
from collections.abc import Callable

from confluent_kafka import Consumer, Producer

from astraflow.config import KafkaSettings
from astraflow.kafka.clients import watermarks
from astraflow.kafka.read import assigned_consumer, last_readable
from astraflow.serde import AvroSerde


def _transaction(producer: Producer, topic: str, values: list[bytes], commit: bool) -> None:
    producer.begin_transaction()
    for v in values:
        producer.produce(topic, v, partition=0)
    producer.flush(30)
    (producer.commit_transaction if commit else producer.abort_transaction)(30)


def _stable(reader: Consumer, topic: str, want: int) -> int:
    """The partition's last stable offset once the transaction markers are written (the broker
    writes them just after the commit or abort returns)."""
    deadline = time.monotonic() + 30
    while (stable := watermarks(reader, topic, 0)[1]) < want and time.monotonic() < deadline:
        time.sleep(0.05)
    return stable


def test_the_last_committed_record_before_markers_and_aborted_records(
        kafka: KafkaSettings, topic_factory: Callable[..., str]) -> None:
    topic = topic_factory("ends")
    reader = assigned_consumer(kafka, AvroSerde(), "test-changelog-ends")
    producer = Producer({**kafka.client_config(), "transactional.id": f"test-ends-{topic}"})
    producer.init_transactions(30)
    try:
        assert last_readable(reader, topic, 0, _stable(reader, topic, 0)) is None  # empty: nothing to read
        _transaction(producer, topic, [b"a", b"b", b"c"], commit=True)  # offsets 0-2, marker 3
        _transaction(producer, topic, [b"x"] * 100, commit=False)  # 4-103 aborted, marker 104
        assert last_readable(reader, topic, 0, _stable(reader, topic, 105)) == 2  # beyond the first 64-offset window
        _transaction(producer, topic, [b"d"], commit=True)  # 105, marker 106
        assert last_readable(reader, topic, 0, _stable(reader, topic, 107)) == 105
        _transaction(producer, topic, [b"y"] * 3, commit=False)  # 107-109 aborted, marker 110
        assert last_readable(reader, topic, 0, _stable(reader, topic, 111)) == 105
    finally:
        reader.close()
