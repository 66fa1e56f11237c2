"""Two ranks train what one rank trains: `astraflow train --devices 2 --strategy ddp|fsdp` on CPU
(gloo) against a real Kafka, compared with `--devices 1` on the same records.

Each run reads the same train topic from its start into its own run directory, 3 batches of 8
samples (all on one partition, so each batch holds the same samples whatever the timing; the
trained-sample logs confirm it), and the final checkpoint's fp32 parameters are compared: equal
within float tolerance (the ranks' all-reduce adds the same terms in another order). The samples
differ in length and in trained tokens, so a per-rank token mean would not give one rank's
gradients (tests/unit/test_rl_data_parallel.py shows by how much); the trainer's loss is the
global mean (`astraflow.rl.data_parallel_normaliser`). The checkpoint keeps its world size.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

from astraflow.config import KafkaSettings
from astraflow.kafka.clients import RecordProducer
from astraflow.kafka.topics import Topics
from astraflow.models.tiny import init_tiny
from astraflow.records import TrainSample
from trainers.callbacks import newest_checkpoint


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
    env = {k: v for k, v in os.environ.items() if k != "ASTRAFLOW_TRAINER_CRASH_AT"}
    env["OMP_NUM_THREADS"] = "1"
    if crash:
        env["ASTRAFLOW_TRAINER_CRASH_AT"] = crash
    return env


def run_train(cmd: list[str], timeout: float = 300) -> str:
    proc = subprocess.run(cmd, env=train_env(), stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                          timeout=timeout)
    assert proc.returncode == 0, proc.stdout[-4000:]
    return proc.stdout


def trained_steps(run_dir: Path, experiment: str) -> dict[str, int]:
    """sample_id -> the step that trained it, from the trained-sample log."""
    path = run_dir / experiment / "policy" / "trained-samples.jsonl"
    lines = [json.loads(x) for x in path.read_text().splitlines()]
    steps = {x["sample_id"]: x["step"] for x in lines}
    assert len(steps) == len(lines), "a sample logged twice"
    return steps


def final_state(run_dir: Path, experiment: str) -> tuple[dict[str, torch.Tensor], dict]:
    ckpt = torch.load(newest_checkpoint(run_dir / experiment / "policy" / "checkpoints"), weights_only=False)
    return {k: v.float() for k, v in ckpt["state_dict"].items()}, ckpt


def max_diff(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> float:
    assert a.keys() == b.keys()
    return max(float((a[k] - b[k]).abs().max()) for k in a)


@pytest.mark.slow
@pytest.mark.parametrize("strategy", ["ddp", "fsdp"])
def test_two_ranks_train_what_one_rank_trains_ddp_fsdp(kafka: KafkaSettings, experiment: str, tmp_path: Path,
                                                        strategy: str) -> None:
    model = init_tiny(tmp_path / "tiny", vocab_size=512, hidden=32, layers=2, heads=2, kv_heads=1, intermediate=64)
    send(kafka, Topics(experiment).train("policy"), varied_samples(24), key="one-partition")
    states, steps = {}, {}
    for devices in (1, 2):
        run_dir = tmp_path / f"runs-{devices}"
        out = run_train(train_cmd(kafka, experiment, model, run_dir, devices, strategy if devices > 1 else "auto",
                                  "trainer.max_steps=3"))
        assert "trained 3 steps, 24 samples" in out, out[-3000:]
        states[devices], ckpt = final_state(run_dir, experiment)
        steps[devices] = trained_steps(run_dir, experiment)
        assert ckpt["astraflow"]["world_size"] == devices
        assert ckpt["global_step"] == 3
    assert steps[1] == steps[2] and sorted(set(steps[1].values())) == [1, 2, 3]
    from transformers import AutoModelForCausalLM

    start = {f"model.{k}": v.float() for k, v in AutoModelForCausalLM.from_pretrained(model).state_dict().items()}
    moved = max_diff({k: start[k] for k in states[1]}, states[1])
    diff = max_diff(states[1], states[2])
    print(f"\n{strategy}: max |1 rank - 2 ranks| = {diff:.2e}; max change over 3 steps = {moved:.2e}")
    assert moved > 1e-3, "training did not move the parameters"
    # Adam divides by sqrt(v): where a gradient is ~0, summation-order noise moves a weight by up to
    # lr x 1e-3; a per-rank mean moves them by a good part of lr (tests/unit/test_rl_data_parallel.py).
    assert diff < 0.01 * moved, f"2 ranks ({strategy}) differ from 1 rank by {diff} (training moved them by {moved})"
