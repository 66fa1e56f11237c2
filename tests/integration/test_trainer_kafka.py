"""The trainer against a real Kafka broker: training from a train topic (every record trained
once, parameters changed, metrics sent, a follower reading the weights topic ends with the
trainer's final weights bit for bit), poisoned samples, weights that are not finite, topics it
does not create. Publisher and follower on their own: test_weights_publish_follow.py.
"""

from __future__ import annotations

import json
import time
import uuid
from pathlib import Path

import pytest
import torch
from confluent_kafka import Consumer, TopicPartition
from weights_helpers import bits_equal, follow_until

from astraflow.config import KafkaSettings
from astraflow.kafka.clients import RecordProducer
from astraflow.kafka.topics import Topics
from astraflow.models.tiny import init_tiny, load_tiny
from astraflow.records import Metric, TrainedSamples, WeightKind
from astraflow.serde import AvroSerde
from astraflow.weights.chain import ApplyStatus
from astraflow.weights.follow import KafkaWeightFollower
from astraflow.weights.publish import published_state
from astraflow.weights.versions import latest_policy_version
from trainers.config import TrainRunConfig
from trainers.run import run_training
from trainers.synthetic import make_samples

torch.optim.Adam([torch.zeros(1, requires_grad=True)])  # settles TORCHINDUCTOR_CACHE_DIR before the leak guard



def _sample_bytes(serde: AvroSerde, i: int) -> bytes:
    """Train sample `s{i}` (group `g{i // 4}`, 4 trained tokens of 6) as curate writes it."""
    import numpy as np

    from astraflow.records import TrainSample

    n = 6
    return serde.dumps(TrainSample(f"s{i}", f"t{i}", f"g{i // 4}", "p", "policy", np.arange(3, 3 + n, dtype=np.int32),
                                   np.array([0, 0, 1, 1, 1, 1], np.uint8), np.full(n, -1.0, np.float32),
                                   np.array([-1, -1, 0, 0, 0, 0], np.int32), 1.0, 1.0, 0))

def _watermarks(kafka: KafkaSettings, topic: str, partitions: int) -> dict[int, int]:
    c = Consumer({**kafka.client_config(), "group.id": "wm"})
    try:
        return {p: c.get_watermark_offsets(TopicPartition(topic, p), timeout=10)[1] for p in range(partitions)}
    finally:
        c.close()


def test_a_full_batch_trains_without_waiting_for_the_next_one(
    kafka: KafkaSettings, experiment: str, tmp_path: Path, one_thread: None, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A curator one batch ahead writes batch N+1 only once batch N is trained (its version is out).

    So the trainer must train a full batch at once: neither wait for one more sample to close it,
    nor read batch N+1 before training batch N (Lightning prefetches one batch of an unsized
    loader). Either would stall here until max_wait_s (600 s) and the follower would not see
    version 1 within its 60 s. Meanwhile the trainer serves its own Prometheus endpoint.
    """
    import socket
    import threading
    import urllib.request

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    monkeypatch.setenv("ASTRAFLOW_METRICS_PORT", str(port))
    scraped: list[str] = []

    def scrape_step_1() -> None:  # while the trainer waits for batch 2, its endpoint has step 1's loss
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline:
            try:
                text = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5).read().decode()
            except OSError:
                text = ""
            if "astraflow_trainer_loss{" in text:
                scraped.append(text)
                return
            time.sleep(0.3)

    topics = Topics(experiment)
    model_dir = init_tiny(tmp_path / "tiny", vocab_size=512, hidden=64, layers=2, heads=4, kv_heads=2, intermediate=128)
    initial, _ = load_tiny(model_dir)
    producer = RecordProducer(kafka)
    batches = [make_samples(initial, prompts=1, group_size=8, policy="policy", seed=i) for i in range(2)]
    cfg = TrainRunConfig.model_validate({
        "experiment": experiment, "run_dir": str(tmp_path / "runs"), "kafka": kafka.model_dump(),
        "topics": {"partitions": 2},
        "trainer": {"model_dir": str(model_dir), "batch_size": 8, "max_wait_s": 600, "max_steps": 2,
                    "max_time_s": 150, "progress_bar": False},  # the default logger: TensorBoard and CSV
    })
    seen: list[int | None] = []

    def curator() -> None:  # the next batch only once the previous one is trained, as the curator does
        follower = KafkaWeightFollower(kafka, experiment, "policy", request_snapshots=False)
        follower.start(offset=0)
        try:
            for version, batch in enumerate(batches):
                follow_until(follower, version, timeout_s=60)
                seen.append(follower.follower.version)
                if follower.follower.version != version:
                    return
                if version == 1:
                    scrape_step_1()
                for s in batch:
                    producer.send(topics.train("policy"), s, key=s.group_id)
                producer.flush()
            follow_until(follower, 2, timeout_s=60)
            seen.append(follower.follower.version)
        finally:
            follower.close()

    feeder = threading.Thread(target=curator)
    feeder.start()
    summary = run_training(cfg)  # signal handlers: the main thread
    feeder.join(timeout=120)
    assert seen == [0, 1, 2]
    assert summary.stopped_by == "max_steps" and summary.trained_samples == 16
    # Training curves in the run directory: TensorBoard scalars per step, and Lightning's CSV.
    from trainers.tblog import read_scalars

    [events] = (cfg.log_dir() / "tensorboard").glob("events.out.tfevents.*")
    steps = read_scalars(events)
    assert [s for s, _, _ in steps] == [0, 1]  # Lightning's step while the batch trains (before its optimizer step)
    tags = set().union(*(v.keys() for _, _, v in steps))
    assert {"train/loss", "train/reward", "train/approx_kl", "train/entropy", "train/staleness_mean",
            "train/samples_per_s"} <= tags, tags
    assert steps[0][2]["train/samples"] == 8.0
    [csv] = (cfg.log_dir() / "lightning").glob("version_*/metrics.csv")
    assert "train/loss" in csv.read_text().splitlines()[0]
    assert scraped, "the trainer served no astraflow_trainer_loss"
    lines = scraped[0].splitlines()
    for name in ("trainer_loss", "trainer_reward", "trainer_staleness_mean", "role_up"):
        assert any(ln.startswith(f"astraflow_{name}{{") and 'component="trainer"' in ln
                   and f'experiment="{experiment}"' in ln and "step=" not in ln for ln in lines), name


@pytest.mark.parametrize(("minibatches", "ppo_epochs"), [(1, 1), (2, 2)])
def test_training_on_a_train_topic_publishes_versions_a_follower_reproduces(
    kafka: KafkaSettings, experiment: str, tmp_path: Path, one_thread: None, minibatches: int, ppo_epochs: int
) -> None:
    """One version per batch, whatever the optimizer steps per batch (minibatches x ppo_epochs)."""
    steps = 3 * minibatches * ppo_epochs
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
                "logger": "none", "progress_bar": False, "minibatches": minibatches, "ppo_epochs": ppo_epochs,
            },
        }
    )
    summary = run_training(cfg)
    assert summary.stopped_by == "idle" and summary.steps == steps and summary.trained_samples == 24
    assert summary.offsets == _watermarks(kafka, topics.train("policy"), 2)
    assert summary.version == 3  # v0 snapshot at start, one version per batch

    ckpt = torch.load(cfg.checkpoint_dir() / f"step-{steps:09d}.ckpt", weights_only=False)
    trained = {k.removeprefix("model."): v for k, v in ckpt["state_dict"].items()}
    assert any(not torch.equal(v, trained[k]) for k, v in initial.state_dict().items())
    assert ckpt["KafkaTrainData"]["offsets"] == summary.offsets

    follower = KafkaWeightFollower(kafka, experiment, "policy", request_snapshots=False)
    follower.start(offset=0)
    events = follow_until(follower, 3)
    follower.close()
    assert [e.result.status for e in events] == [ApplyStatus.APPLIED] * 4
    # every version a delta in the stream but the first (v3's snapshot went beside it)
    assert [e.kind for e in events] == [WeightKind.SNAPSHOT, WeightKind.DELTA, WeightKind.DELTA, WeightKind.DELTA]
    assert bits_equal(dict(follower.follower.state), published_state(trained, "bfloat16"))

    latest = latest_policy_version(kafka, topics, "policy")
    assert latest is not None and latest.version == 3 and latest.trained_samples == 24

    serde = AvroSerde()
    c = Consumer({**kafka.client_config(), "group.id": uuid.uuid4().hex, "auto.offset.reset": "earliest"})
    c.assign([TopicPartition(topics.metrics, 0, 0)])
    names = {serde.loads(m.value(), Metric).name for m in c.consume(500, 5.0) if m.error() is None}
    c.close()
    assert {"trainer.loss", "trainer.reward", "trainer.clip_frac", "trainer.staleness", "trainer.tokens_per_s"} <= names

    # Lineage, committed with each version: every sample once, under the version of the step that trained it.
    c = Consumer({**kafka.client_config(), "group.id": uuid.uuid4().hex, "isolation.level": "read_committed"})
    c.assign([TopicPartition(topics.lineage, 0, 0)])
    records = [serde.loads(m.value(), TrainedSamples) for m in c.consume(100, 5.0) if m.error() is None]
    c.close()
    trained_at = {sid: (r.version, step, r.trainer_step) for r in records for sid, step in zip(r.sample_ids, r.steps, strict=True)}
    assert sorted(trained_at) == sorted(s.sample_id for s in samples)
    assert sum(len(r.sample_ids) for r in records) == 24  # none twice
    assert sorted({v for v, _, _ in trained_at.values()}) == [1, 2, 3]
    # A version per batch: each sample's step is the step that version was published at.
    assert all(step == published_at for _, step, published_at in trained_at.values())
    assert len({(v, step) for v, step, _ in trained_at.values()}) == 3


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


def test_the_group_commit_counts_samples_not_transaction_markers(kafka: KafkaSettings, experiment: str) -> None:
    """Curate writes the train topic in transactions, which leave a marker after their records. The
    curator counts the samples waiting for the trainer from its group commit: the trainer commits
    past the markers that follow what it trained, and says in the commit's metadata how many
    samples it holds past it, so neither a marker before nor one after them counts as a sample."""
    from confluent_kafka import Producer

    from astraflow.kafka.backlog import pending_samples
    from trainers.batching import BatchLimits
    from trainers.data import TrainStream

    topic, serde = Topics(experiment).train("policy"), AvroSerde()

    producer = Producer({**kafka.client_config(), "transactional.id": f"{experiment}-curate"})
    producer.init_transactions(30)
    for txn in range(2):  # two transactions of 4 samples on partition 0: records 0-3, marker 4, records 5-8, marker 9
        producer.begin_transaction()
        for i in range(4):
            producer.produce(topic, _sample_bytes(serde, 4 * txn + i), partition=0)
        producer.commit_transaction(30)
    group = f"{experiment}.trainer-test"
    stream = TrainStream(kafka, topic, "policy", limits=BatchLimits(4), max_wait_s=30, group_id=group)
    reader = Consumer({**kafka.client_config(), "group.id": group, "enable.auto.commit": False})

    def committed(before: int) -> tuple[int, int]:  # the commit is asynchronous: wait until it lands
        deadline = time.monotonic() + 30
        while True:
            [tp] = reader.committed([TopicPartition(topic, 0)], timeout=10)
            if tp.offset != before or time.monotonic() > deadline:
                return tp.offset, pending_samples(10, tp.offset, tp.metadata)  # samples waiting, as the curator counts them

    try:
        batches = iter(stream)
        first = next(batches)
        assert first["meta"]["offsets"][0] == 4
        deadline = time.monotonic() + 30
        while stream._buffered < 4 and time.monotonic() < deadline:  # the stream has read the second transaction too
            stream._fill(0.2)
        stream.commit(first["meta"]["offsets"])
        assert committed(-1001) == (5, 4)  # past the first marker; 4 samples waiting, not 5 offsets
        second = next(batches)
        assert second["meta"]["offsets"][0] == 9
        stream.commit(second["meta"]["offsets"])
        assert committed(5) == (10, 0)  # past the last marker: nothing waiting
    finally:
        stream.close()
        reader.close()


def test_samples_that_arrive_while_the_trainer_trains_are_reported_without_their_markers(
    kafka: KafkaSettings, experiment: str
) -> None:
    """The next batch's samples mostly arrive while the trainer trains, after its commit, each
    transaction with its marker: the stream's background reader re-commits the same offsets with
    fresh metadata, so the curator counts those samples and not their markers (before, it counted
    one per marker until the trainer's next batch, and issued that many tasks too few). A batch
    handed to the trainer but not trained yet still counts as waiting."""
    from confluent_kafka import Producer

    from astraflow.kafka.backlog import pending_samples
    from trainers.batching import BatchLimits
    from trainers.data import TrainStream

    topic, serde = Topics(experiment).train("policy"), AvroSerde()

    producer = Producer({**kafka.client_config(), "transactional.id": f"{experiment}-curate"})
    producer.init_transactions(30)

    def transaction(first: int) -> None:  # 4 samples on partition 0, then the marker
        producer.begin_transaction()
        for i in range(first, first + 4):
            producer.produce(topic, _sample_bytes(serde, i), partition=0)
        producer.commit_transaction(30)

    group = f"{experiment}.trainer-report"
    stream = TrainStream(kafka, topic, "policy", limits=BatchLimits(4), max_wait_s=30, group_id=group, report_s=0.02)
    reader = Consumer({**kafka.client_config(), "group.id": group, "enable.auto.commit": False})

    def waiting_until(want: int, end: int) -> int:  # what the curator would count, once it is `want` (or after 30 s)
        deadline = time.monotonic() + 30
        while True:
            [tp] = reader.committed([TopicPartition(topic, 0)], timeout=10)
            got = pending_samples(end, tp.offset, tp.metadata) if tp.offset >= 0 else end
            if got == want or time.monotonic() > deadline:
                return got
            time.sleep(0.05)

    try:
        transaction(0)  # records 0-3, marker 4
        batches = iter(stream)
        first = next(batches)
        stream.commit(first["meta"]["offsets"])  # the trainer takes batch 1 and trains it...
        assert waiting_until(0, 5) == 0
        transaction(4)  # ...while curate writes records 5-8 (marker 9) and 10-13 (marker 14)
        transaction(8)
        assert waiting_until(8, 15) == 8  # 8 samples, not 10 offsets: nobody but the background reader read them
        second = next(batches)  # handed to the trainer, not trained yet: still waiting
        assert [s for _, _, s in second["meta"]["samples"]] == ["s4", "s5", "s6", "s7"]
        time.sleep(0.2)  # the background reader runs meanwhile
        assert waiting_until(8, 15) == 8
        stream.commit(second["meta"]["offsets"])
        assert waiting_until(4, 15) == 4
    finally:
        stream.close()
        reader.close()
