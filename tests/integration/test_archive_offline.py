"""Offline training: a past run's archived train samples feed a fresh experiment's train topic.

The test goes up to consumption by a trainer-style consumer (every partition, in order, typed
TrainSamples with their original bytes); `astraflow train` on the new experiment then trains
from that topic as from a live one (docs/archive.md, "Train a fresh policy from an archive").
"""

from __future__ import annotations

import uuid
from collections import defaultdict
from pathlib import Path

import numpy as np
import pytest

from astraflow.archive import ArchiveReader
from astraflow.archive.replay import Replayer, ReplayOptions, open_source
from astraflow.config import KafkaSettings, TopicSettings
from astraflow.kafka.clients import RecordConsumer, RecordProducer
from astraflow.kafka.topics import TopicAdmin, Topics, topic_specs
from astraflow.records import TrainSample
from astraflow.serde import AvroSerde
from stream_apps import archive as archive_app

pytestmark = pytest.mark.timeout(120)  # a hang fails fast instead of holding the suite

def sample(i: int) -> TrainSample:
    rng = np.random.default_rng(i)
    n = 24
    return TrainSample(
        sample_id=f"s-{i}", trajectory_id=f"task-{i // 4}/{i % 4}", group_id=f"g-{i // 4}", prompt_id=f"p-{i // 4}",
        policy="policy", token_ids=rng.integers(0, 1000, n, dtype=np.int32), loss_mask=np.r_[np.zeros(8), np.ones(16)].astype(np.uint8),
        behaviour_logprobs=-rng.random(n, dtype=np.float32), versions=np.r_[np.full(8, -1), np.full(16, i // 10)].astype(np.int32),
        advantage=float(rng.normal()), reward=float(i % 2), min_version=i // 10,
    )


def test_archived_train_samples_replay_into_a_fresh_experiment_in_order(
    kafka: KafkaSettings, experiment: str, unique, tmp_path: Path
) -> None:
    past = Topics(experiment)
    serde = AvroSerde()
    producer = RecordProducer(kafka, serde)
    sent: dict[str, bytes] = {}
    for i in range(120):
        s = sample(i)
        sent[s.sample_id] = serde.dumps(s)
        producer.send_raw(past.train("policy"), sent[s.sample_id], key=s.group_id)
    producer.flush()

    topics = archive_app.resolve_topics(experiment, ["policy.train"])
    assert topics == [past.train("policy")]
    archive_app.run(kafka, topics, str(tmp_path), experiment=experiment, exit_when_idle_s=1.0)
    by_partition: dict[int, list[str]] = defaultdict(list)
    reader = ArchiveReader(tmp_path)
    for p in reader.partitions(past.train("policy")):
        by_partition[p] = [serde.loads(r.value, TrainSample).sample_id for r in reader.read_partition(past.train("policy"), p)]
    assert sum(len(v) for v in by_partition.values()) == 120

    fresh = unique("exp-fresh")
    specs = topic_specs(fresh, ["policy"], TopicSettings(partitions=2))
    admin = TopicAdmin(kafka)
    admin.create(specs)
    try:
        target = Topics(fresh).train("policy")
        # As `astraflow replay --from DIR --topic policy.train --experiment FRESH --to policy.train` resolves it.
        source = open_source(str(tmp_path), kafka, topic="policy.train", resolve_topic=Topics(fresh).stream)
        stats = Replayer(kafka, target, ReplayOptions()).run(source.records)
        assert stats.published == 120

        consumer = RecordConsumer(kafka, f"trainer-{uuid.uuid4().hex}", [target], component="trainer", dlq=None,
                                  expect=TrainSample)
        got: list = []
        empty = 0
        while len(got) < 120 and empty < 10:
            batch = consumer.poll_batch(500, 1.0)
            empty = 0 if batch else empty + 1
            got.extend(batch)
        consumer.commit(got)
        consumer.close()
        assert len(got) == 120 and len({r.record.sample_id for r in got}) == 120
        for p, ids in by_partition.items():
            assert [r.record.sample_id for r in got if r.partition == p] == ids  # the past run's order
        assert all(r.value == sent[r.record.sample_id] for r in got)  # the same bytes
        s = got[0].record
        np.testing.assert_array_equal(s.token_ids, sample(int(s.sample_id[2:])).token_ids)
    finally:
        admin.delete([s.name for s in specs])
