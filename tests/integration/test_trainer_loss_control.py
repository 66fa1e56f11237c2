"""The loss switched through the control topic while the real trainer runs (no restart).

Before start the topic selects `tis` (the trainer reads it before its first batch); after the
first version a bad command (`mis` with tis_cap 1) is rejected with its reason and the loss in
use stays; after the second a good one (`ppo`) is applied from the next batch on. The CLI
refuses a bad command before writing anything.
"""

from __future__ import annotations

import threading
import time
import uuid
from pathlib import Path

import pytest
import torch
from confluent_kafka import Consumer, TopicPartition
from typer.testing import CliRunner

from astraflow.config import KafkaSettings
from astraflow.control import ControlWriter
from astraflow.kafka.clients import RecordProducer
from astraflow.kafka.topics import Topics
from astraflow.models.tiny import init_tiny, load_tiny
from astraflow.records import Metric
from astraflow.serde import AvroSerde
from astraflow.weights.versions import latest_policy_version
from astraflow_cli.main import app
from trainers.config import TrainRunConfig
from trainers.run import run_training
from trainers.synthetic import make_samples

torch.optim.Adam([torch.zeros(1, requires_grad=True)])  # settles TORCHINDUCTOR_CACHE_DIR before the leak guard


def _wait_version(kafka: KafkaSettings, topics: Topics, version: int) -> None:
    deadline = time.monotonic() + 180
    while time.monotonic() < deadline:
        latest = latest_policy_version(kafka, topics, "policy", timeout_s=5.0)
        if latest is not None and latest.version >= version:
            return
        time.sleep(0.2)
    raise AssertionError(f"the trainer did not publish version {version}")


def _metrics(kafka: KafkaSettings, topic: str) -> list[Metric]:
    serde = AvroSerde()
    c = Consumer({**kafka.client_config(), "group.id": uuid.uuid4().hex, "auto.offset.reset": "earliest"})
    c.assign([TopicPartition(topic, 0, 0)])
    out = [serde.loads(m.value(), Metric) for m in c.consume(5000, 5.0) if m.error() is None]
    c.close()
    return out


def test_the_loss_follows_the_control_topic_without_a_restart(kafka: KafkaSettings, experiment: str, tmp_path: Path) -> None:
    topics = Topics(experiment)
    bootstrap = ["--set", f"kafka.bootstrap_servers={kafka.bootstrap_servers}"]
    refused = CliRunner().invoke(app, [*bootstrap, "control", "set", "trainer", "policy.loss", "tis", "-e", experiment,
                                       "--param", "tis_cpa=3"])
    assert refused.exit_code == 1 and "tis_cpa" in refused.output
    writer = ControlWriter(kafka, experiment)
    assert writer.current().controls == {}  # nothing was written
    writer.set("trainer", "policy.loss", "tis", {"tis_cap": "3"})  # version 1, before the trainer starts

    model_dir = init_tiny(tmp_path / "tiny", vocab_size=512, hidden=32, layers=1, heads=2, kv_heads=1, intermediate=64)
    initial, _ = load_tiny(model_dir)
    samples = make_samples(initial, prompts=3, group_size=8, policy="policy")
    producer = RecordProducer(kafka)

    def send(batch: int) -> None:
        for s in samples[8 * batch : 8 * batch + 8]:
            producer.send(topics.train("policy"), s, key=s.group_id)
        producer.flush()

    cfg = TrainRunConfig.model_validate({
        "experiment": experiment, "run_dir": str(tmp_path / "runs"), "kafka": kafka.model_dump(), "topics": {"partitions": 2},
        "trainer": {"model_dir": str(model_dir), "batch_size": 8, "max_wait_s": 0.3, "stop_when_idle_s": 120, "max_steps": 3,
                    "lr": 1e-3, "logger": "none", "progress_bar": False},
    })
    errors: list[BaseException] = []

    def operate() -> None:  # the operator, while the trainer (which needs the main thread) runs
        try:
            send(0)
            _wait_version(kafka, topics, 1)
            writer.set("trainer", "policy.loss", "mis", {"tis_cap": "1"})  # version 2: refused by the trainer
            send(1)
            _wait_version(kafka, topics, 2)
            writer.set("trainer", "policy.loss", "ppo", {"eps_high": "0.3"})  # version 3: applied
            send(2)
        except BaseException as exc:  # handed to the test thread
            errors.append(exc)
            send(1)
            send(2)  # let the trainer reach max_steps

    thread = threading.Thread(target=operate)
    thread.start()
    try:
        summary = run_training(cfg)
    finally:
        thread.join(timeout=300)
    assert not errors and not thread.is_alive()
    assert summary.steps == 3 and summary.stopped_by == "max_steps"

    metrics = _metrics(kafka, topics.metrics)
    applied = [(m.value, m.labels["mode"]) for m in metrics if m.name == "trainer.loss_applied"]
    assert applied == [(1.0, "tis"), (3.0, "ppo")]
    rejected = [m for m in metrics if m.name == "trainer.loss_rejected"]
    assert [m.labels["control_version"] for m in rejected] == ["2"] and "tis_cap > 1" in rejected[0].labels["error"]
    per_step = {int(m.labels["step"]): m.value for m in metrics if m.name == "trainer.loss_control_version"}
    assert per_step == {1: 1.0, 2: 1.0, 3: 3.0}  # the refused command changed nothing; the good one the next batch
    truncated = {int(m.labels["step"]) for m in metrics if m.name == "trainer.is_truncated_frac"}
    assert truncated == {1, 2}  # tis reports its truncation; ppo has none


pytestmark = pytest.mark.integration
