"""`astraflow train` jobs of one or several CPU ranks (gloo) on a train topic of varied samples:
what the multi-rank integration tests (tests/integration/test_trainer_ddp*.py) and
bench/trainer_scale.py start, so both run the same command on the same kind of input.

- `varied_samples`: TrainSamples of varied lengths and trained-token counts, so a per-rank
  token mean differs from the global one (what the loss across ranks must get right).
- `send`: writes samples to a train topic (all under one key when given: one partition, so each
  batch holds the same samples whatever the timing).
- `train_cmd` / `train_env`: the command line of `astraflow train --accelerator cpu` with the
  small settings these runs share, and its environment (one OpenMP thread per rank; an optional
  crash point, `trainers.crash`).
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

import numpy as np

from astraflow.config import KafkaSettings
from astraflow.kafka.clients import RecordProducer
from astraflow.records import TrainSample
from trainers.crash import ENV as CRASH_ENV


def varied_samples(n: int, seed: int = 0, prefix: str = "s") -> list[TrainSample]:
    """`n` samples of varied lengths and trained-token counts (so a per-rank token mean differs
    from the global one), random advantages, behaviour logprobs near the tiny model's."""
    rng = np.random.default_rng(seed)
    out = []
    for i in range(n):
        length = int(rng.integers(6, 20))
        gen = int(rng.integers(1, length - 2))
        mask = np.r_[np.zeros(length - gen, np.uint8), np.ones(gen, np.uint8)]
        out.append(TrainSample(
            f"{prefix}-{i}", f"t-{prefix}-{i}", f"g-{prefix}-{i // 4}", "p", "policy",
            rng.integers(3, 500, length, dtype=np.int32), mask,
            np.where(mask == 1, -6.2, 0.0).astype(np.float32), np.where(mask == 1, 0, -1).astype(np.int32),
            float(rng.normal()), float(rng.random()), 0,
        ))
    return out


def send(kafka: KafkaSettings, topic: str, samples: list[TrainSample], key: str | None = None) -> None:
    """Each sample keyed by its group, or all by `key` (one partition: batches independent of timing)."""
    producer = RecordProducer(kafka)
    for s in samples:
        producer.send(topic, s, key=key or s.group_id)
    producer.flush()


def train_cmd(kafka: KafkaSettings, experiment: str, model: Path, run_dir: Path, devices: int, strategy: str,
              *extra: str) -> list[str]:
    """`astraflow train` of policy `policy` on `devices` CPU ranks with `strategy` (auto, ddp or
    fsdp), batches of 8, lr 1e-3, no staleness limit, collectives timing out after 60 s; `extra`:
    more `--set` overrides (later ones win)."""
    sets = [
        f"kafka.bootstrap_servers={kafka.bootstrap_servers}", f"run_dir={run_dir}", "topics.partitions=2",
        "trainer.batch_size=8", "trainer.max_wait_s=1", "trainer.logger=none", "trainer.progress_bar=false",
        "trainer.lr=1e-3", "trainer.max_staleness=null", "trainer.collective_timeout_s=60",
        *extra,
    ]
    cmd = [sys.executable, "-m", "astraflow_cli.main", "train", "-e", experiment, "-p", "policy", "-m", str(model),
           "--devices", str(devices), "--strategy", strategy, "--accelerator", "cpu"]
    for s in sets:
        cmd += ["--set", s]
    return cmd


def train_env(crash: str | None = None) -> dict[str, str]:
    """This process's environment for a job's ranks: one OpenMP thread each (ranks share the
    cores), and the crash point `crash` (`trainers.crash`) or none."""
    env = {k: v for k, v in os.environ.items() if k != CRASH_ENV}
    env["OMP_NUM_THREADS"] = "1"
    if crash:
        env[CRASH_ENV] = crash
    return env
