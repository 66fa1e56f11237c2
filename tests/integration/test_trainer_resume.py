"""Exactly-once training across `kill -9`: the trainer process is killed mid-run and restarted.

The first `astraflow train` process trains on a 2-partition train topic until it is killed with
SIGKILL. The restarted process resumes from the newest checkpoint. Judged from the checkpoint's
offsets and the trainers' JSONL log of trained records (partition, offset, sample id per step):

- per partition, the restarted run's first trained offset is exactly the checkpoint's offset;
- the steps of run 1 up to the checkpoint plus every step of run 2 train each record exactly
  once, and run 2 ends at the end of every partition.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import torch

from astraflow.config import KafkaSettings
from astraflow.kafka.clients import RecordProducer
from astraflow.kafka.topics import Topics
from astraflow.models.tiny import init_tiny
from astraflow.records import TrainSample
from trainers.callbacks import newest_checkpoint

N_SAMPLES = 480  # 120 steps of 4: the kill lands well before the end


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


def _train(kafka: KafkaSettings, experiment: str, model: Path, run_dir: Path, log: Path, *extra: str) -> subprocess.Popen:
    sets = [
        f"kafka.bootstrap_servers={kafka.bootstrap_servers}", f"run_dir={run_dir}", "topics.partitions=2",
        "trainer.batch_size=4", "trainer.max_wait_s=0.2", "trainer.checkpoint_every_steps=3",
        "trainer.publish_every_steps=5", "trainer.logger=none", "trainer.progress_bar=false",
        f"trainer.trained_log={log}", "trainer.lr=1e-4", *extra,
    ]
    cmd = [sys.executable, "-m", "astraflow.cli.main", "train", "-e", experiment, "-p", "policy", "-m", str(model)]
    for s in sets:
        cmd += ["--set", s]
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    return subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)


def _lines(log: Path) -> list[dict]:
    if not log.exists():
        return []
    return [json.loads(line) for line in log.read_text().splitlines() if line.endswith("}")]


def test_kill_9_and_restart_trains_every_record_exactly_once(kafka: KafkaSettings, experiment: str, tmp_path: Path) -> None:
    topic = Topics(experiment).train("policy")
    model = init_tiny(tmp_path / "tiny", vocab_size=512, hidden=32, layers=1, heads=2, kv_heads=1, intermediate=64)
    producer = RecordProducer(kafka)
    sent = {}
    for s in _samples(N_SAMPLES):
        producer.send(topic, s, key=s.group_id, on_delivery=lambda err, msg: sent.__setitem__((msg.partition(), msg.offset()), None))
    producer.flush()
    ids = {s.sample_id for s in _samples(N_SAMPLES)}
    ends = {p: 1 + max(o for q, o in sent if q == p) for p in (0, 1)}

    run_dir, log = tmp_path / "runs", tmp_path / "trained.jsonl"
    ckpt_dir = run_dir / experiment / "policy" / "checkpoints"
    first = _train(kafka, experiment, model, run_dir, log)  # no idle stop: only the kill ends it
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline and (len(_lines(log)) < 10 or newest_checkpoint(ckpt_dir) is None):
        assert first.poll() is None, first.communicate()[0][-3000:]
        time.sleep(0.02)
    os.kill(first.pid, signal.SIGKILL)
    first.wait(30)
    ckpt_path = newest_checkpoint(ckpt_dir)
    assert ckpt_path is not None
    ckpt = torch.load(ckpt_path, weights_only=False)
    ckpt_step, ckpt_offsets = ckpt["global_step"], {int(p): o for p, o in ckpt["KafkaTrainData"]["offsets"].items()}
    run1 = _lines(log)
    assert ckpt_step < N_SAMPLES // 4, "run 1 finished before the kill; the test needs more records"

    second = _train(kafka, experiment, model, run_dir, log, "trainer.stop_when_idle_s=3")
    out, _ = second.communicate(timeout=180)
    assert second.returncode == 0, out[-3000:]
    lines = _lines(log)
    run2 = lines[len(run1) :]
    assert {line["run"] for line in run2} != {line["run"] for line in run1}

    # Per partition, run 2 starts exactly at the checkpoint's offsets.
    for p in (0, 1):
        firsts = [o for line in run2 for q, o, _ in line["samples"] if q == p]
        assert firsts and min(firsts) == ckpt_offsets[p], (p, ckpt_offsets, firsts[:5])
    assert run2[0]["step"] == ckpt_step + 1
    # Run 1 up to the checkpoint + run 2: every record exactly once, in order per partition.
    effective = [tuple(x) for line in run1 if line["step"] <= ckpt_step for x in line["samples"]]
    effective += [tuple(x) for line in run2 for x in line["samples"]]
    for p in (0, 1):
        offsets = [o for q, o, _ in effective if q == p]
        assert offsets == list(range(ends[p])), f"partition {p}: not every offset exactly once"
    assert sorted(i for _, _, i in effective) == sorted(ids)
    assert {int(p): o for p, o in run2[-1]["offsets"].items()} == ends
    final = torch.load(newest_checkpoint(ckpt_dir), weights_only=False)
    assert {int(p): o for p, o in final["KafkaTrainData"]["offsets"].items()} == ends
    assert final["KafkaTrainData"]["trained_samples"] == N_SAMPLES
    print(f"\nkilled after checkpoint step {ckpt_step} (offsets {ckpt_offsets}, run 1 logged {len(run1)} steps); "
          f"run 2 trained {len(run2)} steps to {ends}")


def test_sigterm_stops_a_trainer_that_waits_for_samples(kafka: KafkaSettings, experiment: str, tmp_path: Path) -> None:
    """Lightning acts on SIGTERM only between batches; a trainer on an empty topic has none."""
    from astraflow.weights.follow import KafkaWeightFollower

    model = init_tiny(tmp_path / "tiny", vocab_size=512, hidden=32, layers=1, heads=2, kv_heads=1, intermediate=64)
    proc = _train(kafka, experiment, model, tmp_path / "runs", tmp_path / "trained.jsonl", "trainer.max_wait_s=600")
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
