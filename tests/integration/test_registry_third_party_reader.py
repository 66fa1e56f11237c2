"""A reader that is not ours decodes our topics through the schema registry: confluent-kafka's
own `AvroDeserializer` with its `SchemaRegistryClient` reads trajectories and train samples
straight off an experiment's `rollouts` and `<policy>.train` topics, written by our producer in
Confluent framing (`kafka.record_framing: confluent`).

The registry is the real Apicurio that `astraflow registry up` runs (the `schema_registry`
fixture). The deserializer shares nothing with us but the registry's URL: it fetches the writer
schema by the id in each record, parses it with its own stack and decodes the body.
"""

from __future__ import annotations

import uuid

import numpy as np
import pytest
from confluent_kafka.schema_registry import SchemaRegistryClient
from confluent_kafka.schema_registry.avro import AvroDeserializer
from confluent_kafka.serialization import MessageField, SerializationContext

from astraflow.config import KafkaSettings
from astraflow.kafka.clients import RecordProducer, consume_ready, data_messages, reader
from astraflow.kafka.topics import Topics
from astraflow.records import TrainSample
from astraflow.serde import AvroSerde
from astraflow.testing import make_trajectory

pytestmark = pytest.mark.timeout(120)


def _read_all(kafka: KafkaSettings, topic: str, n: int) -> list:
    from confluent_kafka import TopicPartition

    consumer = reader(kafka, f"third-party-{uuid.uuid4().hex[:6]}")
    try:
        consumer.assign([TopicPartition(topic, p, 0) for p in range(2)])
        out: list = []
        for _ in range(60):
            out += list(data_messages(consume_ready(consumer, 100, 0.5), topic))
            if len(out) >= n:
                break
        return out
    finally:
        consumer.close()


def test_registry_third_party_deserializer_reads_trajectories_and_train_samples(
    kafka: KafkaSettings, experiment: str, schema_registry: str
) -> None:
    ours = kafka.model_copy(update={"schema_registry_url": schema_registry, "record_framing": "confluent"})
    topics = Topics(experiment)
    serde = AvroSerde.for_kafka(ours)  # registers every shipped version, as a role does on start
    producer = RecordProducer(ours, serde)
    trajectories = [make_trajectory(64, task_id=f"t{i}", reward=0.25 * i) for i in range(4)]
    samples = [
        TrainSample(f"s{i}", f"t{i}/0", f"g{i}", "p", "policy", np.arange(8) + i, np.ones(8, np.uint8),
                    np.full(8, -0.5), np.zeros(8, np.int32), 0.5 + i, 1.0, 0)
        for i in range(4)
    ]
    for t in trajectories:
        producer.send(topics.rollouts, t, key=t.group_id)
    for s in samples:
        producer.send(topics.train("policy"), s, key=s.group_id)
    producer.flush(30)

    # The third party: nothing of ours but the registry's address.
    deserializer = AvroDeserializer(SchemaRegistryClient({"url": schema_registry}))

    got = {}
    for msg in _read_all(kafka, topics.rollouts, len(trajectories)):
        assert msg.value()[0] == 0  # Confluent framing: magic byte, then the schema id
        d = deserializer(msg.value(), SerializationContext(msg.topic(), MessageField.VALUE))
        got[d["trajectory_id"]] = d
    assert set(got) == {t.trajectory_id for t in trajectories}
    for t in trajectories:
        d = got[t.trajectory_id]
        assert d["reward"] == t.reward and d["group_id"] == t.group_id and d["temperature"] == 1.0
        np.testing.assert_array_equal(np.frombuffer(d["segments"][1]["token_ids"], "<i4"), t.segments[1].token_ids)

    got = {}
    for msg in _read_all(kafka, topics.train("policy"), len(samples)):
        d = deserializer(msg.value(), SerializationContext(msg.topic(), MessageField.VALUE))
        got[d["sample_id"]] = d
    assert set(got) == {s.sample_id for s in samples}
    for s in samples:
        d = got[s.sample_id]
        assert d["advantage"] == s.advantage and d["policy"] == "policy"
        np.testing.assert_array_equal(np.frombuffer(d["token_ids"], "<i4"), s.token_ids)
