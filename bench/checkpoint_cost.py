"""What checkpoint-then-publish costs: the trainer's per-step checkpoint time, by model size.

The trainer publishes a version only after a checkpoint of the state that produced it
(trainers/publishing.py), so with `publish_every_steps=1` every optimizer step writes one. This
measures that write exactly as the trainer does it (Lightning's `save_checkpoint` through
`AtomicCheckpointIO`: torch.save to a temporary file, fsync, rename, directory fsync), with the
weights, AdamW's two moments, the loop state and a full sample-id window of `--window` ids,
next to the optimizer step time on the same batches, for the demo's tiny model and a ~10M
parameter one.

    python bench/checkpoint_cost.py [--steps 6] [--window 100000] [--json OUT]
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
import uuid
import warnings
from pathlib import Path
from typing import Any

SIZES = {  # name -> init_tiny arguments
    "demo tiny (init_tiny defaults)": {},
    "~10M parameters": {"hidden": 384, "layers": 6, "heads": 6, "kv_heads": 2, "intermediate": 1024},
}


def measure(name: str, kwargs: dict[str, Any], steps: int, window: int, work: Path) -> dict[str, Any]:
    import lightning as L
    import numpy as np
    from torch.utils.data import DataLoader

    from astraflow.models.tiny import init_tiny
    from astraflow.records import TrainSample
    from astraflow.rl.samples import SampleWindow
    from trainers.batching import collate
    from trainers.callbacks import AtomicCheckpointIO, save_checkpoint
    from trainers.module import PolicyTrainer

    model_dir = init_tiny(work / name.split()[0], **kwargs)
    module = PolicyTrainer(model_dir, lr=1e-5)
    params = sum(p.numel() for p in module.model.parameters())
    rng = np.random.default_rng(0)

    def sample(i: int) -> TrainSample:
        n, gen = 96, 64
        mask = np.r_[np.zeros(n - gen, np.uint8), np.ones(gen, np.uint8)]
        return TrainSample(f"s{i}", "t", "g", "p", "policy", rng.integers(3, 600, n, dtype=np.int32), mask,
                           np.where(mask == 1, -2.0, 0).astype(np.float32), np.where(mask == 1, 0, -1).astype(np.int32),
                           float(rng.normal()), 0.5, 0)

    batches = [collate([sample(i * 8 + j) for j in range(8)]) for i in range(steps + 1)]

    class Window(L.Callback):  # the data module's sample-id window, as a checkpoint carries it
        def __init__(self) -> None:
            self.window = SampleWindow(window, (f"{uuid.uuid4()}#0-96" for _ in range(window)))

        def state_dict(self) -> dict[str, Any]:
            return {"window": self.window.dumps()}

    class Timer(L.Callback):
        def __init__(self) -> None:
            self.step_s: list[float] = []
            self.ckpt_s: list[float] = []
            self.size = 0

        def on_train_batch_start(self, *args: Any) -> None:
            self.t0 = time.perf_counter()

        def on_train_batch_end(self, trainer: L.Trainer, *args: Any) -> None:
            t1 = time.perf_counter()
            path = save_checkpoint(trainer, work / f"ckpt-{name.split()[0]}", keep=2)
            t2 = time.perf_counter()
            if trainer.global_step > 1:  # the first step warms up allocators and caches
                self.step_s.append(t1 - self.t0)
                self.ckpt_s.append(t2 - t1)
            self.size = path.stat().st_size

    timer = Timer()
    trainer = L.Trainer(
        max_steps=steps + 1, logger=False, enable_checkpointing=False, enable_progress_bar=False,
        enable_model_summary=False, accelerator="cpu", callbacks=[Window(), timer], plugins=[AtomicCheckpointIO()],
    )
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        trainer.fit(module, DataLoader(batches, batch_size=None))
    step, ckpt = statistics.median(timer.step_s), statistics.median(timer.ckpt_s)
    return {"model": name, "parameters": params, "checkpoint_mb": timer.size / 1e6, "step_s": step,
            "checkpoint_s": ckpt, "overhead": ckpt / step, "window_ids": window}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=6, help="measured steps per model (after one warm-up step)")
    ap.add_argument("--window", type=int, default=100_000, help="sample ids in the checkpointed window")
    ap.add_argument("--json", type=Path, help="write the figures here")
    args = ap.parse_args(argv)
    import torch

    torch.set_num_threads(1)
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        for name, kwargs in SIZES.items():
            rows.append(measure(name, kwargs, args.steps, args.window, Path(tmp)))
    print(f"{'model':32} {'params':>11} {'ckpt MB':>8} {'step s':>8} {'ckpt s':>8} {'ckpt/step':>9}")
    for r in rows:
        print(f"{r['model']:32} {r['parameters']:>11,} {r['checkpoint_mb']:>8.1f} {r['step_s']:>8.3f} "
              f"{r['checkpoint_s']:>8.3f} {r['overhead']:>8.0%}")
    if args.json:
        args.json.write_text(json.dumps(rows, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
