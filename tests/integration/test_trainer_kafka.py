"""The trainer and weight publication against a real Kafka broker.

- training from a train topic: every record trained once, parameters changed, metrics sent, and
  a follower reading the weights topic ends with the trainer's final weights bit for bit;
- publisher and follower: a corrupted chunk and a version that never arrives lead to snapshot
  fallbacks (and a snapshot request on the control topic), never to wrong weights; a late
  joiner starts from the latest snapshot; claim-checked payloads via the store.
"""

from __future__ import annotations

import json
import time
import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch
from confluent_kafka import Consumer, TopicPartition

from astraflow.config import KafkaSettings
from astraflow.kafka.clients import RecordProducer
from astraflow.kafka.topics import Topics
from astraflow.models.tiny import init_tiny, load_tiny
from astraflow.records import Metric, WeightChunk, WeightKind
from astraflow.serde import AvroSerde
from astraflow.weights.chain import ApplyStatus, WeightChain
from astraflow.weights.publish import (
    KafkaWeightFollower,
    PublishSettings,
    WeightFollower,
    WeightPublisher,
    latest_policy_version,
    published_state,
)
from astraflow.weights.store import WeightStore
from astraflow.weights.verify import FollowLimits
from trainers.callbacks import SnapshotRequests
from trainers.config import TrainRunConfig
from trainers.run import run_training
from trainers.synthetic import make_samples

torch.optim.Adam([torch.zeros(1, requires_grad=True)])  # settles TORCHINDUCTOR_CACHE_DIR before the leak guard


@pytest.fixture
def one_thread() -> Iterator[None]:
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


def _bits_equal(a: dict, b: dict) -> bool:
    return a.keys() == b.keys() and all(torch.equal(a[k].view(torch.int16), b[k].view(torch.int16)) for k in a)


def _follow(f: KafkaWeightFollower, until_version: int, timeout_s: float = 30.0) -> list:
    events, deadline = [], time.monotonic() + timeout_s
    while f.follower.version != until_version and time.monotonic() < deadline:
        events += f.poll(0.5)
    return events


def _watermarks(kafka: KafkaSettings, topic: str, partitions: int) -> dict[int, int]:
    c = Consumer({**kafka.client_config(), "group.id": "wm"})
    try:
        return {p: c.get_watermark_offsets(TopicPartition(topic, p), timeout=10)[1] for p in range(partitions)}
    finally:
        c.close()


def test_a_full_batch_trains_without_waiting_for_the_next_one(
    kafka: KafkaSettings, experiment: str, tmp_path: Path, one_thread: None
) -> None:
    """A curator one batch ahead writes batch N+1 only once batch N is trained (its version is out).

    So the trainer must train a full batch at once: neither wait for one more sample to close it,
    nor read batch N+1 before training batch N (Lightning prefetches one batch of an unsized
    loader). Either would stall here until max_wait_s (600 s) and the follower would not see
    version 1 within its 60 s.
    """
    import threading

    topics = Topics(experiment)
    model_dir = init_tiny(tmp_path / "tiny", vocab_size=512, hidden=64, layers=2, heads=4, kv_heads=2, intermediate=128)
    initial, _ = load_tiny(model_dir)
    producer = RecordProducer(kafka)
    batches = [make_samples(initial, prompts=1, group_size=8, policy="policy", seed=i) for i in range(2)]
    cfg = TrainRunConfig.model_validate({
        "experiment": experiment, "run_dir": str(tmp_path / "runs"), "kafka": kafka.model_dump(),
        "topics": {"partitions": 2},
        "trainer": {"model_dir": str(model_dir), "batch_size": 8, "max_wait_s": 600, "max_steps": 2,
                    "max_time_s": 150, "logger": "none", "progress_bar": False},
    })
    seen: list[int | None] = []

    def curator() -> None:  # the next batch only once the previous one is trained, as the curator does
        follower = KafkaWeightFollower(kafka, experiment, "policy", request_snapshots=False)
        follower.start(offset=0)
        try:
            for version, batch in enumerate(batches):
                _follow(follower, version, timeout_s=60)
                seen.append(follower.follower.version)
                if follower.follower.version != version:
                    return
                for s in batch:
                    producer.send(topics.train("policy"), s, key=s.group_id)
                producer.flush()
            _follow(follower, 2, timeout_s=60)
            seen.append(follower.follower.version)
        finally:
            follower.close()

    feeder = threading.Thread(target=curator)
    feeder.start()
    summary = run_training(cfg)  # signal handlers: the main thread
    feeder.join(timeout=120)
    assert seen == [0, 1, 2]
    assert summary.stopped_by == "max_steps" and summary.trained_samples == 16


def test_training_on_a_train_topic_publishes_versions_a_follower_reproduces(
    kafka: KafkaSettings, experiment: str, tmp_path: Path, one_thread: None
) -> None:
    topics = Topics(experiment)
    model_dir = init_tiny(tmp_path / "tiny", vocab_size=512, hidden=64, layers=2, heads=4, kv_heads=2, intermediate=128)
    initial, _ = load_tiny(model_dir)
    producer = RecordProducer(kafka)
    samples = make_samples(initial, prompts=3, group_size=8, policy="policy")
    for s in samples:
        producer.send(topics.train("policy"), s, key=s.group_id)
    producer.flush()
    cfg = TrainRunConfig.model_validate(
        {
            "experiment": experiment,
            "run_dir": str(tmp_path / "runs"),
            "kafka": kafka.model_dump(),
            "topics": {"partitions": 2},
            "trainer": {
                "model_dir": str(model_dir), "batch_size": 8, "max_wait_s": 0.3, "stop_when_idle_s": 1.5, "lr": 1e-3,
                "publish_every_steps": 1, "snapshot_every_versions": 3, "checkpoint_every_steps": 1,
                "logger": "none", "progress_bar": False,
            },
        }
    )
    summary = run_training(cfg)
    assert summary.stopped_by == "idle" and summary.steps == 3 and summary.trained_samples == 24
    assert summary.offsets == _watermarks(kafka, topics.train("policy"), 2)
    assert summary.version == 3  # v0 snapshot at start, one version per step

    ckpt = torch.load(cfg.checkpoint_dir() / "step-000000003.ckpt", weights_only=False)
    trained = {k.removeprefix("model."): v for k, v in ckpt["state_dict"].items()}
    assert any(not torch.equal(v, trained[k]) for k, v in initial.state_dict().items())
    assert ckpt["KafkaTrainData"]["offsets"] == summary.offsets

    follower = KafkaWeightFollower(kafka, experiment, "policy", request_snapshots=False)
    follower.start(offset=0)
    events = _follow(follower, 3)
    follower.close()
    assert [e.result.status for e in events] == [ApplyStatus.APPLIED] * 4
    assert [e.kind for e in events] == [WeightKind.SNAPSHOT, WeightKind.DELTA, WeightKind.DELTA, WeightKind.SNAPSHOT]
    assert _bits_equal(dict(follower.follower.state), published_state(trained, "bfloat16"))

    latest = latest_policy_version(kafka, topics, "policy")
    assert latest is not None and latest.version == 3 and latest.trained_samples == 24

    serde = AvroSerde()
    c = Consumer({**kafka.client_config(), "group.id": uuid.uuid4().hex, "auto.offset.reset": "earliest"})
    c.assign([TopicPartition(topics.metrics, 0, 0)])
    names = {serde.loads(m.value(), Metric).name for m in c.consume(500, 5.0) if m.error() is None}
    c.close()
    assert {"trainer.loss", "trainer.reward", "trainer.clip_frac", "trainer.staleness", "trainer.tokens_per_s"} <= names


class _Sabotage(RecordProducer):
    """Corrupts a chunk of one version and diverts another version to a decoy topic."""

    def __init__(self, kafka: KafkaSettings, corrupt: int, divert: int, decoy: str) -> None:
        super().__init__(kafka)
        self.corrupt, self.divert, self.decoy = corrupt, divert, decoy

    def send(self, topic, record, key=None, headers=None, on_delivery=None) -> None:
        version = getattr(record, "version", None)
        if topic.endswith(".weights") and version == self.divert:
            topic = self.decoy
        if isinstance(record, WeightChunk) and version == self.corrupt and record.index == 0:
            record = WeightChunk(record.policy, version, 0, record.count, b"\xff" + record.data[1:], record.crc32)
        super().send(topic, record, key, headers, on_delivery)


class _Model(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.emb = torch.nn.Embedding(128, 32)
        self.mid = torch.nn.Linear(32, 32)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return (self.mid(self.emb(x)) @ self.emb.weight.T).logsumexp(-1).mean()


def _publish_versions(publisher: WeightPublisher, n: int) -> list:
    torch.manual_seed(0)
    model = _Model()
    opt = torch.optim.Adam(model.parameters(), lr=1e-3)
    out = []
    for step in range(n):
        m = publisher.publish(model.state_dict(), trainer_step=step)
        out.append((m, {k: v.clone() for k, v in publisher.encoder.state.items()}))
        loss = model(torch.randint(0, 128, (8,)))
        opt.zero_grad()
        loss.backward()
        opt.step()
    return out


def test_follower_falls_back_to_snapshots_and_never_holds_wrong_weights(
    kafka: KafkaSettings, experiment: str, topic_factory
) -> None:
    topics = Topics(experiment)
    requests = SnapshotRequests(kafka, topics, "policy")
    early = KafkaWeightFollower(kafka, experiment, "policy", requester="early")
    early.start()  # nothing published yet: reads from the beginning
    sabotage = _Sabotage(kafka, corrupt=2, divert=5, decoy=topic_factory("decoy"))
    publisher = WeightPublisher(kafka, experiment, "policy", PublishSettings(snapshot_every=4, chunk_bytes=4096), producer=sabotage)
    assert publisher.start() is None
    published = _publish_versions(publisher, 10)
    kinds = "".join("S" if m.kind == WeightKind.SNAPSHOT else "D" for m, _ in published)
    assert kinds == "SDDDSDDDSD"
    checksum = {m.version: m.state_checksum for m, _ in published}

    events = _follow(early, 9)
    status = {e.version: e.result.status for e in events}
    assert status[2] == status[3] == ApplyStatus.SNAPSHOT_NEEDED  # corrupted chunk, then no base
    assert status[4] == ApplyStatus.APPLIED  # the next snapshot
    assert 5 not in status and status[6] == status[7] == ApplyStatus.SNAPSHOT_NEEDED  # v5 never arrived
    assert status[8] == status[9] == ApplyStatus.APPLIED
    for e in events:
        if e.result.status == ApplyStatus.APPLIED:
            assert e.result.version == e.version
    assert early.follower.chain.checksum.hex() == checksum[9]
    assert _bits_equal(dict(early.follower.state), published[9][1])
    early.close()
    deadline = time.monotonic() + 10
    asked = False
    while not asked and time.monotonic() < deadline:
        asked = requests.pending()  # the stuck follower asked the trainer for a snapshot
    requests.close()
    assert asked

    late = KafkaWeightFollower(kafka, experiment, "policy", request_snapshots=False)
    late.start()  # at the latest snapshot (v8) named on the policies topic
    events = _follow(late, 9)
    late.close()
    assert [(e.version, e.kind) for e in events] == [(8, WeightKind.SNAPSHOT), (9, WeightKind.DELTA)]
    assert _bits_equal(dict(late.follower.state), published[9][1])

    # A follower still at v1 that resumes at v9's manifest: seeks back to the v8 snapshot.
    behind = WeightFollower("policy", chain=WeightChain.from_state(published[1][1], 1))
    seeker = KafkaWeightFollower(kafka, experiment, "policy", follower=behind, request_snapshots=False)
    seeker.start(offset=int(published[9][0].metadata["offset"]))
    events = _follow(seeker, 9)
    seeker.close()
    assert [e.result.status for e in events] == [ApplyStatus.SNAPSHOT_NEEDED, ApplyStatus.APPLIED, ApplyStatus.APPLIED]
    assert _bits_equal(dict(behind.state), published[9][1])

    again = WeightPublisher(kafka, experiment, "policy")
    assert again.start() == 9 and again.encoder.next_version == 10  # numbering continues after a restart


def test_claim_checked_versions_through_the_store(kafka: KafkaSettings, experiment: str, tmp_path: Path) -> None:
    store = WeightStore(tmp_path / "store")
    settings = PublishSettings(snapshot_every=3, inband_max_bytes=2048)
    publisher = WeightPublisher(kafka, experiment, "policy", settings, store=store)
    published = _publish_versions(publisher, 4)
    assert all(m.uri and m.uri.startswith("file://") and m.num_chunks == 0 for m, _ in published)
    assert published[3][0].latest_snapshot == 3 and published[2][0].latest_snapshot_uri == published[0][0].uri
    follower = KafkaWeightFollower(kafka, experiment, "policy", request_snapshots=False,
                                   limits=FollowLimits(allowed_uri_prefixes=(store.root,)))
    follower.start(offset=0)
    events = _follow(follower, 3)
    follower.close()
    assert [e.result.status for e in events] == [ApplyStatus.APPLIED] * 4
    assert _bits_equal(dict(follower.follower.state), published[3][1])



def test_poisoned_samples_go_to_the_dlq_with_their_reason_and_training_goes_on(
    kafka: KafkaSettings, experiment: str, tmp_path: Path, one_thread: None
) -> None:
    """Each kind of bad record between good ones: dead-lettered with the field and the limit,
    its offset consumed, never in a batch; every good sample is trained."""
    import dataclasses

    import numpy as np

    from astraflow.records import DeadLetter

    topics = Topics(experiment)
    model_dir = init_tiny(tmp_path / "tiny", vocab_size=512, hidden=32, layers=1, heads=2, kv_heads=1, intermediate=64)
    initial, _ = load_tiny(model_dir)
    good = make_samples(initial, prompts=2, group_size=8, policy="policy")
    base = good[0]

    def bad(**changes: object) -> object:
        return dataclasses.replace(base, sample_id=f"bad-{uuid.uuid4().hex[:6]}", **changes)

    n = len(base.token_ids)
    huge = 60_000
    poison = {  # reason (a substring of the dead letter's error) -> record or raw bytes
        "outside the vocabulary [0, 512)": bad(token_ids=np.full(n, 512, np.int32)),
        "advantage: nan": bad(advantage=float("nan")),
        f"{huge} tokens exceed trainer.max_seq_len=512": bad(
            token_ids=np.full(huge, 5, np.int32), loss_mask=np.ones(huge, np.uint8),
            behaviour_logprobs=np.full(huge, -1.0, np.float32), versions=np.zeros(huge, np.int32)),
        "loss_mask has 3": bad(loss_mask=np.ones(3, np.uint8)),
        "behaviour_logprobs: position": bad(behaviour_logprobs=np.full(n, np.inf, np.float32)),
        "does not start with an Avro": b"\xffnot avro at all",
        "expected a astraflow.TrainSample record": Metric("m", 1.0, "x", "y"),
        "already trained": base,  # the same sample_id again: a duplicate
    }
    producer = RecordProducer(kafka)
    topic = topics.train("policy")
    for s in good[:8]:
        producer.send(topic, s, key="k")
    for record in poison.values():
        if isinstance(record, bytes):
            producer.send_raw(topic, record, key="k")
        else:
            producer.send(topic, record, key="k")  # type: ignore[arg-type]
    for s in good[8:]:
        producer.send(topic, s, key="k")
    producer.flush()
    cfg = TrainRunConfig.model_validate({
        "experiment": experiment, "run_dir": str(tmp_path / "runs"), "kafka": kafka.model_dump(),
        "topics": {"partitions": 2},
        "trainer": {"model_dir": str(model_dir), "batch_size": 8, "max_wait_s": 0.3, "stop_when_idle_s": 1.5,
                    "logger": "none", "progress_bar": False},
    })
    summary = run_training(cfg)
    assert summary.trained_samples == len(good) and summary.steps == 2
    assert sum(summary.offsets.values()) == len(good) + len(poison)  # the bad records are consumed too

    serde = AvroSerde()
    c = Consumer({**kafka.client_config(), "group.id": uuid.uuid4().hex, "auto.offset.reset": "earliest"})
    c.assign([TopicPartition(topics.dlq, 0, 0)])
    dead = [serde.loads(m.value(), DeadLetter) for m in c.consume(500, 5.0) if m.error() is None]
    c.close()
    assert len(dead) == len(poison) and all(d.component == "trainer" and d.topic == topic for d in dead)
    for reason in poison:
        assert any(reason in d.error for d in dead), (reason, [d.error for d in dead])
    trained = [json.loads(x)["sample_id"] for x in cfg.trained_log().read_text().splitlines()]
    assert sorted(trained) == sorted(s.sample_id for s in good)


def test_a_second_publisher_of_the_policy_fences_the_first(kafka: KafkaSettings, experiment: str) -> None:
    """Same transactional id (a restarted trainer): the old one can no longer publish, and the
    new one numbers after the last committed version."""
    from astraflow.weights.publish import PublisherFencedError

    tid = Topics(experiment).publisher_id("policy")
    old = WeightPublisher(kafka, experiment, "policy", transactional_id=tid)
    assert old.start() is None
    weights = {"w": torch.ones(8)}
    assert old.publish(weights).version == 0
    new = WeightPublisher(kafka, experiment, "policy", transactional_id=tid)
    assert new.start() == 0 and new.committed is not None and new.committed.version == 0
    with pytest.raises(PublisherFencedError):
        old.publish({"w": torch.full((8,), 2.0)})
    assert new.publish({"w": torch.full((8,), 3.0)}).version == 1
    latest = latest_policy_version(kafka, Topics(experiment), "policy")
    assert latest is not None and latest.version == 1


def test_weights_that_are_not_finite_are_neither_checkpointed_nor_published(
    kafka: KafkaSettings, experiment: str, tmp_path: Path, one_thread: None
) -> None:
    """A learning rate that drives weights past float16's range: the first step's weights are
    infinite in the published dtype, so the trainer stops before checkpointing or publishing them."""
    from astraflow.weights.publish import NonFiniteWeightsError

    topics = Topics(experiment)
    model_dir = init_tiny(tmp_path / "tiny", vocab_size=512, hidden=32, layers=1, heads=2, kv_heads=1, intermediate=64)
    initial, _ = load_tiny(model_dir)
    producer = RecordProducer(kafka)
    for s in make_samples(initial, prompts=1, group_size=8, policy="policy"):
        producer.send(topics.train("policy"), s, key=s.group_id)
    producer.flush()
    cfg = TrainRunConfig.model_validate({
        "experiment": experiment, "run_dir": str(tmp_path / "runs"), "kafka": kafka.model_dump(),
        "topics": {"partitions": 2},
        "trainer": {"model_dir": str(model_dir), "batch_size": 8, "max_wait_s": 0.3, "stop_when_idle_s": 1.5,
                    "lr": 1e6, "grad_clip": None, "publish_dtype": "float16", "logger": "none", "progress_bar": False},
    })
    with pytest.raises(NonFiniteWeightsError, match="step 1"):
        run_training(cfg)
    assert not list(cfg.checkpoint_dir().glob("step-*.ckpt"))
    latest = latest_policy_version(kafka, topics, "policy", strict=True)
    assert latest is not None and latest.version == 0  # the starting weights only
    assert not cfg.trained_log().exists()


def test_the_trainer_does_not_create_topics_it_tells_the_operator_to(
    kafka: KafkaSettings, unique, tmp_path: Path
) -> None:
    """Like every role, the trainer expects the operator's `astraflow topics create`; without the
    topics it stops before loading the model, with that command (and creates nothing)."""
    from astraflow.errors import TopicError
    from astraflow.kafka.topics import TopicAdmin

    experiment = unique("notopics")
    model_dir = tmp_path / "model"  # never loaded: the check comes first
    model_dir.mkdir()
    (model_dir / "config.json").write_text("{}")
    cfg = TrainRunConfig.model_validate({
        "experiment": experiment, "run_dir": str(tmp_path / "runs"), "kafka": kafka.model_dump(),
        "trainer": {"model_dir": str(model_dir), "max_wait_s": 0.3, "stop_when_idle_s": 1.0, "logger": "none",
                    "progress_bar": False},
    })
    with pytest.raises(TopicError, match=f"`astraflow topics create -e {experiment} -p policy`") as exc:
        run_training(cfg)
    assert Topics(experiment).train("policy") in str(exc.value) and Topics(experiment).weights("policy") in str(exc.value)
    assert TopicAdmin(kafka).list(f"af.{experiment}.") == {}
