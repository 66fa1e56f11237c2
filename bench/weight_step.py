"""One version of the pipeline's weights through the delta codec: encode (the trainer) and apply (each
follower), 1 thread.

The model is `bench/vs_trl.py`'s (the demo's warm-started tiny model, 383k parameters); versions
are AdamW steps at vs_trl's lr 3e-4 on random gradients, published in fp32 (what
`bench/_pipeline.py`'s trainer publishes: `trainer.publish_dtype=float32`) and in bf16 (the
default). Prints the median over `--reps` calls of `astraflow.weights.delta.encode` and `apply`
(from the payload's bytes, with the base's manifest given, as the followers do) and the payload's
size, and checks the result bit for bit. Run it from two clones to compare two codes.

    python bench/weight_step.py [--reps 40] [--dtypes float32,bfloat16]
"""

from __future__ import annotations

import argparse
import time
from collections.abc import Callable
from typing import Any

import _rl
import torch

from astraflow.models.tiny import load_tiny
from astraflow.weights.bits import StateManifest
from astraflow.weights.delta import apply, encode
from astraflow.weights.publish import published_state


def median_ms(f: Callable[[], Any], reps: int) -> tuple[float, Any]:
    times, out = [], None
    for _ in range(reps):
        t = time.perf_counter()
        out = f()
        times.append(time.perf_counter() - t)
    return sorted(times)[len(times) // 2] * 1e3, out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--reps", type=int, default=40)
    ap.add_argument("--dtypes", default="float32,bfloat16")
    args = ap.parse_args()
    torch.set_num_threads(1)
    torch.manual_seed(0)
    model, _ = load_tiny(_rl.warm_model_dir())
    opt = torch.optim.AdamW(model.parameters(), lr=_rl.LR, weight_decay=0.01)
    dtypes = args.dtypes.split(",")
    versions = []  # per step, per dtype: the published weights (tied aliases dropped, as the trainer does)
    for _ in range(3):
        for p in model.parameters():
            p.grad = torch.randn_like(p) * 1e-2
        opt.step()
        versions.append({dtype: published_state(model.state_dict(), dtype) for dtype in dtypes})
    for dtype in dtypes:
        prev, new = versions[1][dtype], versions[2][dtype]
        base = StateManifest.of(prev)
        enc_ms, delta = median_ms(lambda: encode(prev, new, base_manifest=base), args.reps)  # noqa: B023
        payload = delta.to_bytes()
        apply_ms, out = median_ms(lambda: apply(prev, payload, base_manifest=base), args.reps)  # noqa: B023
        assert all(out[k].view(torch.uint8).equal(new[k].view(torch.uint8)) for k in new if new[k].numel())
        print(f"{dtype}: encode {enc_ms:.2f} ms, apply {apply_ms:.2f} ms, {len(payload)} bytes "
              f"({delta.trailer.n_changed} of {sum(v.numel() for v in new.values())} elements changed)", flush=True)


if __name__ == "__main__":
    main()
