"""Every codec a stream app may write (`EngineSettings.compression`, snappy by default) reads back
on both kinds of readers of its topics: librdkafka (trainer, status, archive, RaaS nodes) and
aiokafka (Faust's consumers, table changelogs at recovery), read_committed, from transactional
batches built by aiokafka's producer as the apps' are."""

from __future__ import annotations

import asyncio
import uuid

from astraflow.config import KafkaSettings
from astraflow.kafka.clients import reader_config
from astraflow.kafka.topics import TopicAdmin, TopicSpec
from astraflow.serde import AvroSerde
from astraflow.testing import make_trajectory
from stream_apps.engine import COMPRESSIONS, EngineSettings


async def _write(kafka: KafkaSettings, topic: str, codec: str, values: list[bytes]) -> None:
    from aiokafka import AIOKafkaProducer

    producer = AIOKafkaProducer(bootstrap_servers=kafka.bootstrap_servers, transactional_id=f"codec-{uuid.uuid4().hex}",
                                compression_type=None if codec == "none" else codec, max_request_size=4 << 20,
                                max_batch_size=1 << 20, linger_ms=50)
    await producer.start()
    try:
        async with producer.transaction():
            for v in values:
                await producer.send(topic, v, key=b"k", partition=0)
    finally:
        await producer.stop()


async def _read_aiokafka(kafka: KafkaSettings, topic: str, n: int) -> list[bytes]:
    from aiokafka import AIOKafkaConsumer, TopicPartition

    consumer = AIOKafkaConsumer(bootstrap_servers=kafka.bootstrap_servers, isolation_level="read_committed",
                                enable_auto_commit=False, auto_offset_reset="earliest", max_partition_fetch_bytes=4 << 20)
    await consumer.start()
    try:
        consumer.assign([TopicPartition(topic, 0)])
        out: list[bytes] = []
        while len(out) < n:
            batches = await asyncio.wait_for(consumer.getmany(timeout_ms=1000), 30)
            out.extend(m.value for msgs in batches.values() for m in msgs)
        return out
    finally:
        await consumer.stop()


def _read_librdkafka(kafka: KafkaSettings, topic: str, n: int) -> list[bytes]:
    from confluent_kafka import Consumer, TopicPartition

    c = Consumer(reader_config(kafka, f"codec-{uuid.uuid4().hex}", 4 << 20))
    c.assign([TopicPartition(topic, 0, 0)])
    out: list[bytes] = []
    try:
        for _ in range(300):
            out.extend(m.value() for m in c.consume(16, 0.1) if m.error() is None)
            if len(out) >= n:
                break
        return out
    finally:
        c.close()


def test_every_codec_of_the_stream_apps_reads_back_on_both_clients(kafka: KafkaSettings) -> None:
    assert EngineSettings("x", kafka).compression == "snappy"
    serde = AvroSerde()
    values = [serde.dumps(make_trajectory(4096, seed=s)) for s in range(3)]
    admin = TopicAdmin(kafka)
    topics = {codec: f"codec-test-{codec}-{uuid.uuid4().hex[:8]}" for codec in COMPRESSIONS}
    admin.create([TopicSpec(t, 1) for t in topics.values()])
    try:
        for codec, topic in topics.items():
            asyncio.run(_write(kafka, topic, codec, values))
            assert _read_librdkafka(kafka, topic, 3) == values, codec
            assert asyncio.run(_read_aiokafka(kafka, topic, 3)) == values, codec
    finally:
        admin.delete(list(topics.values()))
