"""Our client layer rides out a broker outage: nothing lost, nothing twice, no role-side error.

librdkafka drops a queued record after `message.timeout.ms` (default 5 minutes). A real 5-minute
outage is too slow for the suite (the fault harness runs it), so the same mechanism is shown at
a smaller scale: during a ~10 s outage of a single-broker cluster, a producer with a 3 s
message timeout (librdkafka's default behaviour, scaled down) loses records, while ours
(`message.timeout.ms=0`, never give up) delivers every one once the broker is back, and a commit
issued during the outage completes instead of raising.
"""

from __future__ import annotations

import os
import threading
import time
from collections.abc import Iterator

import pytest
from confluent_kafka import Consumer, KafkaError, Producer, TopicPartition

from astraflow.config import KafkaSettings, LocalKafkaSettings
from astraflow.kafka.clients import (
    LIBRDKAFKA_DEFAULT_MESSAGE_TIMEOUT_MS,
    RecordProducer,
    commit_offsets,
    consumer_config,
    producer_config,
)
from astraflow.kafka.local import LocalKafka
from astraflow.kafka.topics import TopicAdmin, TopicSpec

pytestmark = pytest.mark.slow

BASE = int(os.environ.get("ASTRAFLOW_TEST_PORT_BASE", "29100")) + 10


@pytest.fixture(scope="module")
def broker(tmp_path_factory: pytest.TempPathFactory) -> Iterator[LocalKafka]:
    local = LocalKafka(LocalKafkaSettings(data_dir=tmp_path_factory.mktemp("kout"), port=BASE, controller_port=BASE + 1, heap_mb=384))
    local.up(echo=lambda *_: None)
    try:
        yield local
    finally:
        local.down(echo=lambda *_: None)


def test_the_outage_settings_are_in_every_producer_and_consumer() -> None:
    kafka = KafkaSettings()
    conf = producer_config(kafka, 1 << 20)
    assert conf["message.timeout.ms"] == 0 != LIBRDKAFKA_DEFAULT_MESSAGE_TIMEOUT_MS  # 0 = never give up
    assert conf["enable.idempotence"] is True and conf["acks"] == "all"
    # A transactional producer must land its records within the transaction's timeout.
    txn = producer_config(kafka, 1 << 20, **{"transactional.id": "t", "transaction.timeout.ms": 90000})
    assert txn["message.timeout.ms"] == 90000
    assert consumer_config(kafka, "g", 1 << 20)["reconnect.backoff.max.ms"] == conf["reconnect.backoff.max.ms"] == 5000


def test_a_broker_outage_loses_nothing_with_our_settings(broker: LocalKafka, unique) -> None:
    kafka = KafkaSettings(bootstrap_servers=broker.bootstrap)
    topic = unique("outage")
    TopicAdmin(kafka).create([TopicSpec(topic, 1)])
    ours = RecordProducer(kafka)
    default_like = Producer(producer_config(kafka, 1 << 20, **{"message.timeout.ms": 3000}))
    dropped: list[str] = []
    group = unique("g")

    for i in range(100):
        ours.send_raw(topic, f"{i}".encode())
    ours.flush()
    consumer = Consumer(consumer_config(kafka, group, 1 << 20))
    consumer.assign([TopicPartition(topic, 0, 0)])
    first = []
    while len(first) < 100:
        first += [m for m in consumer.consume(100, 1.0) if m.error() is None]
    broker.kill(1)  # the outage starts: kill -9 of the only broker

    for i in range(100, 300):
        ours.send_raw(topic, f"{i}".encode())
        default_like.produce(topic, b"default", on_delivery=lambda err, _m: err and dropped.append(err.name()))
    commit_done: list[BaseException | None] = []

    def commit() -> None:
        try:
            commit_offsets(consumer, [TopicPartition(topic, 0, first[-1].offset() + 1)])
            commit_done.append(None)
        except BaseException as exc:  # reported by the assertion below
            commit_done.append(exc)

    committer = threading.Thread(target=commit)
    committer.start()
    deadline = time.monotonic() + 30
    while len(dropped) < 200 and time.monotonic() < deadline:
        default_like.poll(0.5)
        ours.poll(0)
    assert dropped == ["_MSG_TIMED_OUT"] * 200  # a finite message timeout loses what the outage held
    assert ours.delivered == 100  # ours still holds every record of the outage
    assert commit_done == []  # and the commit is still waiting, not failed

    broker.start(1, echo=lambda *_: None)  # the outage ends
    ours.flush()  # no timeout: waits for the cluster; raises only if Kafka rejected something
    committer.join(60)
    assert commit_done == [None]
    assert ours.delivered == 300

    values: list[int] = [int(m.value()) for m in first]
    deadline = time.monotonic() + 60
    while len(values) < 300 and time.monotonic() < deadline:
        for m in consumer.consume(100, 1.0):
            if m.error() is None:
                values.append(int(m.value()) if m.value() != b"default" else -1)
            elif m.error().code() != KafkaError._PARTITION_EOF:
                continue
    consumer.close()
    assert [v for v in values if v >= 0] == list(range(300))  # every record once, in order
    assert -1 not in values  # the timed-out ones never reached the log
    again = Consumer(consumer_config(kafka, group, 1 << 20))
    assert again.committed([TopicPartition(topic, 0)], timeout=10)[0].offset == first[-1].offset() + 1
    again.close()


def test_a_role_started_during_an_outage_checks_its_topics_once_the_broker_is_back(broker: LocalKafka, unique) -> None:
    """The start-up topic check (`TopicAdmin.require`, trainer and RaaS nodes) waits for an
    unreachable cluster instead of exiting, then finds the topics."""
    kafka = KafkaSettings(bootstrap_servers=broker.bootstrap)
    topic = unique("needed")
    admin = TopicAdmin(kafka)
    admin.create([TopicSpec(topic, 1)])
    broker.kill(1)
    outcome: list[BaseException | None] = []

    def check() -> None:
        try:
            TopicAdmin(kafka).require([topic], "astraflow topics create -e x", wait_s=2.0)
            outcome.append(None)
        except BaseException as exc:  # reported by the assertions below
            outcome.append(exc)

    checker = threading.Thread(target=check)
    checker.start()
    checker.join(25)  # several failed metadata requests: it must still be waiting, not failed
    assert outcome == []
    broker.start(1, echo=lambda *_: None)
    checker.join(120)
    assert outcome == [None]
