"""Benchmark of the sparse weight-delta codec on RL-like updates.

A state dict of fp32 master weights (>= 100M parameters; ``--quick``: about 13M) is trained
with Adam at a small learning rate on random-ish gradients (a fixed direction per tensor plus
fresh noise each step, so Adam's moments look like a real run's) and published in bf16 after
every step. Each published version is encoded as a delta against the previous one and applied
by a `WeightChain` (in place, fully verified); the result is checked bit for bit.

Printed per learning rate: changed fraction, bytes per changed element of our delta vs the
reference format (uint32 index + bf16 value = 6 bytes per changed element) and vs a full bf16
snapshot, and encode / apply throughput in MB/s of bf16 weights (2 bytes x parameters /
seconds). The last line is the headline ratio, reference bytes / our bytes (worst learning
rate). ``--json OUT`` writes the same figures
(default bench/results/[quick/]weights.json).

    python bench/weights.py [--quick] [--json OUT] [--lr 1e-5 1e-6]
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from dataclasses import asdict, dataclass

import _common

TERMS = {  # what the figures compare (written into the results JSON)
    "ours": "AstraFlow's sparse bf16 weight delta between consecutive versions, applied and checked bit for bit",
    "against": "the reference format: uint32 index + bf16 value, 6 bytes per changed element",
    "settings": "a >= 100M-parameter state dict (quick about 13M) trained with Adam at each --lr, published in bf16 every step",
}


@dataclass
class Row:
    """Figures for one learning rate, averaged over the measured steps."""

    lr: float  # Adam learning rate
    params: int  # parameters in the state dict
    deltas: int  # measured deltas
    changed_fraction: float  # changed bf16 elements / parameters
    ours_bytes: float  # our delta size, mean per delta
    reference_bytes: float  # 6 bytes per changed element
    full_bf16_bytes: int  # 2 bytes per parameter
    ours_bytes_per_changed: float  # ours_bytes / changed elements
    reference_over_ours: float  # reference_bytes / ours_bytes
    encode_mb_s: float  # bf16 MB of weights / encode seconds (publisher with cached manifest)
    apply_mb_s: float  # bf16 MB / WeightChain.apply_delta seconds (in place, verified)
    apply_copy_mb_s: float  # bf16 MB / apply() seconds (fresh copies of changed tensors)
    encode_cold_mb_s: float  # bf16 MB / encode() seconds without a cached base manifest
    encode_cpu_mb_s: float  # as encode_mb_s, per CPU second of this process (contention-free)
    apply_cpu_mb_s: float  # as apply_mb_s, per CPU second of this process


def _parse() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--quick", action="store_true", help="about 13M parameters instead of 100M")
    p.add_argument("--json", metavar="OUT", help="default bench/results/[quick/]weights.json")
    p.add_argument("--lr", type=float, nargs="+", default=[1e-5, 1e-6], help="Adam learning rates")
    p.add_argument("--warmup", type=int, default=3, help="Adam steps before measuring")
    p.add_argument("--steps", type=int, default=3, help="measured deltas per learning rate")
    return p.parse_args()


def _log(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)


def _run_lr(lr: float, shapes: list[tuple[int, ...]], warmup: int, steps: int) -> Row:
    import torch

    from astraflow.weights import StateManifest, WeightChain, apply, encode

    gen = torch.Generator().manual_seed(0)
    master = [
        torch.nn.Parameter(torch.randn(s, generator=gen) * 0.02 if len(s) > 1 else torch.ones(s))
        for s in shapes
    ]
    signal = [torch.randn(s, generator=gen) for s in shapes]
    opt = torch.optim.Adam(master, lr=lr, betas=(0.9, 0.999), eps=1e-8)
    names = [f"layers.{i}.{'weight' if len(s) > 1 else 'norm'}" for i, s in enumerate(shapes)]

    def step() -> None:
        for p, sig in zip(master, signal, strict=True):
            p.grad = 0.5 * sig + torch.randn(p.shape, generator=gen)
        opt.step()

    def publish() -> dict[str, torch.Tensor]:
        return {n: p.detach().to(torch.bfloat16) for n, p in zip(names, master, strict=True)}

    for i in range(warmup):
        _log(f"  lr={lr:g}: warm-up Adam step {i + 1}/{warmup}")
        step()
    prev = publish()
    chain = WeightChain.from_state(prev, 0)
    manifest = StateManifest.of(prev)
    params = sum(p.numel() for p in master)
    mb = 2 * params / 1e6
    t_enc = t_app = t_copy = t_cold = c_enc = c_app = 0.0
    sizes, changed = [], []
    for v in range(1, steps + 1):
        _log(f"  lr={lr:g}: delta {v}/{steps} (Adam step, publish bf16, encode, apply)")
        step()
        new = publish()
        t0, c0 = time.perf_counter(), time.process_time()
        delta = encode(prev, new, base_version=v - 1, version=v, base_manifest=manifest)
        t_enc += time.perf_counter() - t0
        c_enc += time.process_time() - c0
        t0 = time.perf_counter()
        encode(prev, new, base_version=v - 1, version=v)
        t_cold += time.perf_counter() - t0
        t0, c0 = time.perf_counter(), time.process_time()
        result = chain.apply_delta(v, delta)
        t_app += time.perf_counter() - t0
        c_app += time.process_time() - c0
        t0 = time.perf_counter()
        copied = apply(prev, delta, base_manifest=manifest)
        t_copy += time.perf_counter() - t0
        if result.status.value != "applied":
            raise SystemExit(f"bench: WeightChain refused delta {v}: {result.reason}")
        for n in names:
            if not (
                torch.equal(chain.state[n].view(torch.int16), new[n].view(torch.int16))
                and torch.equal(copied[n].view(torch.int16), new[n].view(torch.int16))
            ):
                raise SystemExit(f"bench: tensor {n} differs after apply: the codec is broken")
        sizes.append(delta.nbytes)
        changed.append(delta.trailer.n_changed)
        prev, manifest = new, delta.manifest
    ours, k = sum(sizes) / steps, sum(changed) / steps
    return Row(
        lr=lr,
        params=params,
        deltas=steps,
        changed_fraction=k / params,
        ours_bytes=ours,
        reference_bytes=6 * k,
        full_bf16_bytes=2 * params,
        ours_bytes_per_changed=ours / k,
        reference_over_ours=6 * k / ours,
        encode_mb_s=mb * steps / t_enc,
        apply_mb_s=mb * steps / t_app,
        apply_copy_mb_s=mb * steps / t_copy,
        encode_cold_mb_s=mb * steps / t_cold,
        encode_cpu_mb_s=mb * steps / c_enc,
        apply_cpu_mb_s=mb * steps / c_app,
    )


def _table(rows: list[Row]) -> str:
    """Sizes, then throughput: wall clock (what this shared host gave us) and per CPU second."""
    head = (
        f"{'lr':>6} {'changed':>8} {'B/chg':>6} {'ref B/chg':>9} {'ours MB':>8} {'ref MB':>7} {'full MB':>8} | "
        f"{'enc':>5} {'apply':>5} {'apply()':>7} {'enc cold':>8} | {'enc/CPU':>7} {'apply/CPU':>9}"
    )
    bar1 = head.index("|")
    bar2 = head.index("|", bar1 + 1)
    group = " " * bar1 + "| " + "MB/s, wall clock".ljust(bar2 - bar1 - 2) + "| MB/s per CPU second"
    lines = [group, head, "-" * len(head)]
    for r in rows:
        lines.append(
            f"{r.lr:>6.0e} {r.changed_fraction:>8.2%} {r.ours_bytes_per_changed:>6.3f} {6:>9} "
            f"{r.ours_bytes / 1e6:>8.2f} {r.reference_bytes / 1e6:>7.2f} {r.full_bf16_bytes / 1e6:>8.1f} | "
            f"{r.encode_mb_s:>5.0f} {r.apply_mb_s:>5.0f} {r.apply_copy_mb_s:>7.0f} {r.encode_cold_mb_s:>8.0f} | "
            f"{r.encode_cpu_mb_s:>7.0f} {r.apply_cpu_mb_s:>9.0f}"
        )
    worst = min(rows, key=lambda r: r.reference_over_ours)
    lines.append(
        f"headline: reference / ours = {worst.reference_over_ours:.2f}x smaller (worst lr {worst.lr:g}: "
        f"{worst.ours_bytes_per_changed:.3f} B per changed element vs 6; {rows[0].params:,} parameters)"
    )
    return "\n".join(lines)


def main() -> None:
    args = _parse()
    # torch's OpenMP workers otherwise spin for a while after each Adam step and take CPU from
    # the codec measured right after; a real trainer does its math on the GPU.
    os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")
    import torch

    torch.manual_seed(0)
    # 100.7M parameters as 8 matrices of 4096 x 3072 plus 8 norm vectors (fp32 masters).
    rows_cols = (1024, 1536) if args.quick else (4096, 3072)
    shapes: list[tuple[int, ...]] = []
    for _ in range(8):
        shapes += [rows_cols, (rows_cols[0],)]
    t0 = time.perf_counter()
    load_before = os.getloadavg()[0]
    rows = [_run_lr(lr, shapes, args.warmup, args.steps) for lr in args.lr]
    load_after = os.getloadavg()[0]
    print(
        f"host: {os.cpu_count()} CPUs, load average {load_before:.1f} before / {load_after:.1f} after "
        "(other processes share these CPUs: MB/s scale with what is left)"
    )
    print(_table(rows))
    meta = {
        "torch": torch.__version__,
        "torch_threads": torch.get_num_threads(),
        "load_average_before": load_before,
        "load_average_after": load_after,
        "seconds": time.perf_counter() - t0,
    }
    _common.write_json(args.json, "weights", {
        "meta": meta, "rows": [asdict(r) for r in rows],
        "headline_reference_over_ours": min(r.reference_over_ours for r in rows),
    }, terms=TERMS, quick=args.quick)


if __name__ == "__main__":
    main()
