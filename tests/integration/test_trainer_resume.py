"""Exactly-once training and one set of weights per version number, across `kill -9`.

`astraflow train` processes run one after another on the same checkpoint directory; each but the
last SIGKILLs itself (`ASTRAFLOW_TRAINER_CRASH_AT`, a faithful crash: no cleanup) at a chosen
point: between a checkpoint and its publication, mid-publication (chunks sent, transaction
open), right after a publication, and after a step that no checkpoint holds yet. The input
also repeats some samples (same sample_id at other offsets). Judged from the weights topic read
`read_committed` and the trainer's trained-sample log:

- no version number carries two different weights (state checksums), and each is committed once;
- every sample is in exactly one version (never two steps of the followed lineage, never lost),
  and in a version whose trainer_step range contains the step that trained it;
- the repeated copies are dead-lettered as duplicates; a read_uncommitted view shows the
  aborted half-version (the mid-publication kill really hit an open transaction).
"""

from __future__ import annotations

import collections
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest
import torch
from confluent_kafka import Consumer, KafkaError, TopicPartition

from astraflow.config import KafkaSettings
from astraflow.kafka.clients import RecordProducer
from astraflow.kafka.topics import Topics
from astraflow.models.tiny import init_tiny
from astraflow.records import DeadLetter, PolicyVersion, TrainedSamples, TrainSample
from astraflow.serde import AvroSerde
from astraflow.weights.versions import STREAM_PARTITION, latest_policy_version
from trainers.callbacks import newest_checkpoint

N_SAMPLES = 96  # 24 steps of 4
N_REPEATED = 8  # of them sent a second time, later in the topic


def _samples(n: int) -> list[TrainSample]:
    rng = np.random.default_rng(0)
    out = []
    for i in range(n):
        length, gen = int(rng.integers(8, 16)), 4
        mask = np.r_[np.zeros(length - gen, np.uint8), np.ones(gen, np.uint8)]
        out.append(
            TrainSample(
                f"s-{i}", f"t-{i}", f"g-{i // 4}", "p", "policy", rng.integers(3, 500, length, dtype=np.int32), mask,
                np.where(mask == 1, -3.0, 0.0).astype(np.float32), np.where(mask == 1, 0, -1).astype(np.int32),
                float(rng.normal()), float(rng.random()), 0,
            )
        )
    return out


def _train(kafka: KafkaSettings, experiment: str, model: Path, run_dir: Path, crash: str | None, *extra: str) -> subprocess.Popen:
    sets = [
        f"kafka.bootstrap_servers={kafka.bootstrap_servers}", f"run_dir={run_dir}", "topics.partitions=2",
        "trainer.batch_size=4", "trainer.max_wait_s=0.2", "trainer.publish_every_steps=2",
        "trainer.checkpoint_every_steps=3", "trainer.snapshot_every_versions=3", "trainer.logger=none",
        "trainer.progress_bar=false", "trainer.lr=1e-4",
        "trainer.max_staleness=null",  # every synthetic sample claims version 0, trained up to version 12
        *extra,
    ]
    cmd = [sys.executable, "-m", "astraflow_cli.main", "train", "-e", experiment, "-p", "policy", "-m", str(model)]
    for s in sets:
        cmd += ["--set", s]
    env = {k: v for k, v in os.environ.items() if k != "ASTRAFLOW_TRAINER_CRASH_AT"}
    env["OMP_NUM_THREADS"] = "1"
    if crash:
        env["ASTRAFLOW_TRAINER_CRASH_AT"] = crash
    return subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)


def _read(kafka: KafkaSettings, topic: str, isolation: str, partitions: list[int] | None = None) -> list:
    """The records of `topic` (of `partitions` only, when given)."""
    serde = AvroSerde()
    c = Consumer({**kafka.client_config(), "group.id": "audit", "isolation.level": isolation,
                  "enable.partition.eof": True, "auto.offset.reset": "earliest"})
    parts = partitions if partitions is not None else list(c.list_topics(topic, timeout=10).topics[topic].partitions)
    c.assign([TopicPartition(topic, p, 0) for p in parts])
    out, eof, deadline = [], set(), time.monotonic() + 30
    while len(eof) < len(parts) and time.monotonic() < deadline:
        for m in c.consume(500, 1.0):
            if m.error() is not None:
                if m.error().code() == KafkaError._PARTITION_EOF:
                    eof.add(m.partition())
                continue
            out.append(serde.loads(m.value()))
    c.close()
    return out


@pytest.mark.slow
def test_kill_9_at_every_point_of_the_publish_cycle(kafka: KafkaSettings, experiment: str, tmp_path: Path) -> None:
    topics = Topics(experiment)
    model = init_tiny(tmp_path / "tiny", vocab_size=512, hidden=32, layers=1, heads=2, kv_heads=1, intermediate=64)
    producer = RecordProducer(kafka)
    samples = _samples(N_SAMPLES)
    for s in samples + samples[10 : 10 + N_REPEATED]:  # the repeats arrive after their originals
        producer.send(topics.train("policy"), s, key=s.group_id)
    producer.flush()

    run_dir = tmp_path / "runs"
    # (crash point, nth arrival): counted from each process start; publications happen at even
    # steps and at start (the reconciliation), checkpoints also at multiples of 3.
    crashes = ["after_checkpoint:2", "chunks_sent:2", "after_publish:2", "step_trained:3", None]
    outcomes = []
    for crash in crashes:
        extra = ("trainer.stop_when_idle_s=4",) if crash is None else ()
        proc = _train(kafka, experiment, model, run_dir, crash, *extra)
        out, _ = proc.communicate(timeout=240)
        if crash is None:
            assert proc.returncode == 0, out[-3000:]
            break
        assert proc.returncode == -signal.SIGKILL, f"{crash}: {out[-3000:]}"
        # What the kill left: the newest checkpoint's promise against the committed versions.
        ckpt = torch.load(newest_checkpoint(run_dir / experiment / "policy" / "checkpoints"), weights_only=False)
        promise = ckpt["callbacks"]["DurablePublication"]
        last = latest_policy_version(kafka, topics, "policy", strict=True)
        outcomes.append((crash, ckpt["global_step"], promise["version"], promise["pending"], last.version if last else None))
        if crash.startswith(("after_checkpoint", "chunks_sent")):
            assert promise["pending"] and last is not None and last.version < promise["version"]
        elif crash.startswith("after_publish"):
            assert promise["pending"] and last is not None and last.version == promise["version"]

    committed = [r for r in _read(kafka, topics.weights("policy"), "read_committed") if isinstance(r, PolicyVersion)]
    uncommitted = [r for r in _read(kafka, topics.weights("policy"), "read_uncommitted") if isinstance(r, PolicyVersion)]
    checksums = collections.defaultdict(set)
    for m in committed:
        checksums[m.version].add(m.state_checksum)
    assert all(len(c) == 1 for c in checksums.values()), "a version number carries two different weights"
    # the stream (snapshots beside it carry the same numbers and checksums, checked above)
    stream = [r for r in _read(kafka, topics.weights("policy"), "read_committed", [STREAM_PARTITION])
              if isinstance(r, PolicyVersion)]
    numbers = [m.version for m in stream]
    assert numbers == sorted(set(numbers)), f"versions committed twice or out of order: {numbers}"
    assert len(uncommitted) > len(committed), "the mid-publication kill left no aborted version behind"

    lines = [json.loads(x) for x in (run_dir / experiment / "policy" / "trained-samples.jsonl").read_text().splitlines()]
    per_sample = collections.defaultdict(set)
    for line in lines:
        per_sample[line["sample_id"]].add((line["step"], line["version"]))
    twice = {k: v for k, v in per_sample.items() if len(v) > 1}
    assert not twice, f"trained twice in the followed lineage: {twice}"
    assert set(per_sample) == {s.sample_id for s in samples}, "samples lost"
    step_of = {m.version: m.trainer_step for m in stream}
    versions = sorted(step_of)
    for line in lines:
        v = line["version"]
        assert v in step_of, f"log names version {v}, never committed"
        previous = max((step_of[u] for u in versions if u < v), default=0)
        assert previous < line["step"] <= step_of[v], (line, previous, step_of[v])
    # The lineage topic (committed with each version) says exactly what the log says, each sample once.
    on_topic = [(sid, step, r.version) for r in _read(kafka, topics.lineage, "read_committed") if isinstance(r, TrainedSamples)
                for sid, step in zip(r.sample_ids, r.steps, strict=True)]
    assert sorted(on_topic) == sorted((x["sample_id"], x["step"], x["version"]) for x in lines)

    dead = [r for r in _read(kafka, topics.dlq, "read_committed") if isinstance(r, DeadLetter)]
    duplicates = [d for d in dead if d.error_class == "DuplicateSampleError"]
    assert len(duplicates) == N_REPEATED and not [d for d in dead if d.error_class != "DuplicateSampleError"]
    print(f"\n(kill point, checkpoint step, promised version, pending, last committed): {outcomes}; {len(committed)} versions committed ({len(uncommitted) - len(committed)} aborted), "
          f"{len(lines)} samples in the lineage, {len(duplicates)} duplicates dropped")


def test_sigterm_stops_a_trainer_that_waits_for_samples(kafka: KafkaSettings, experiment: str, tmp_path: Path) -> None:
    """Lightning acts on SIGTERM only between batches; a trainer on an empty topic has none."""
    from astraflow.weights.follow import KafkaWeightFollower

    model = init_tiny(tmp_path / "tiny", vocab_size=512, hidden=32, layers=1, heads=2, kv_heads=1, intermediate=64)
    proc = _train(kafka, experiment, model, tmp_path / "runs", None, "trainer.max_wait_s=600")
    follower = KafkaWeightFollower(kafka, experiment, "policy", request_snapshots=False)
    follower.start(offset=0)
    try:
        deadline = time.monotonic() + 120
        while follower.follower.version is None and time.monotonic() < deadline and proc.poll() is None:
            follower.poll(0.5)  # version 0 is out: the trainer now waits for its first batch
        assert follower.follower.version == 0
        proc.send_signal(signal.SIGTERM)
        out, _ = proc.communicate(timeout=60)
    finally:
        follower.close()
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    assert proc.returncode == 0, out[-2000:]
    assert "stopped by sigterm" in out
