"""Learning at high staleness (issue 22): off-policy corrections x staleness x seeds vs the sync loop.

Runs the in-process schedules of `bench/_rl.py` (workload, model, prompts, reward, GRPO, lr,
one 64-slot rollout engine, one trainer: see there) on workload b (multi-turn `tool_use`, the
calculator behind a log-normal delay):

* `sync`: the trainer-centred loop (staleness 0), with the trainer's default loss;
* `dataflow` at each `--staleness` K (groups start at most K versions ahead of the trainer) with
  each `--corrections` loss (`astraflow.rl.policy_loss` modes; see docs/training.md). With 64
  rollouts in flight and a trainer faster than the rollouts, a batch is rarely more than 1-3
  versions old whatever K (measured: mean 1.4, max 3 at K = 8). A real pipeline gets older
  samples when batches queue between rollout and training; to reproduce that on one machine,
  the rollout engine receives the weights K - 1 versions late (`_rl.dataflow_mode`'s
  `weight_lag`), so trained samples are about K versions stale, at the same compute per sample
  (`--no-lag` runs the plain schedule). The staleness each run really had is reported.

Every run trains the same number of samples (`--steps` x 64) on the same tasks in the same
order, with `--minibatches` optimizer steps per batch (so decoupled PPO's proximal policy, the
model before the batch's first step, differs from the current one from the second step on).
Per run: wall time, trained samples/s, the measured staleness of its samples (mean and max),
the per-batch spread of the importance weights, and held-out success per snapshot. Per setting
(over `--seeds`): held-out success after the full sample budget (equal samples) and at the
wall time of the fastest run of the grid (equal time: the last snapshot taken by then), mean
and standard error, and samples/s relative to sync. Results are written after every run
(`--json`), so an interrupted grid keeps what it finished; `--report JSON` re-makes the table
and the plot from such a file.

Usage: python bench/staleness.py [--staleness 1,2,4,8] [--corrections decoupled,tis,mis,m2po,stale]
       [--seeds 0,1,2] [--steps 10] [--sigma 1.0] [--minibatches 2] [--no-sync] [--json OUT] [--plot PNG]
       python bench/staleness.py --report A.json[,B.json...] [--plot PNG]   (e.g. one file per seed or K;
       a (setting, seed) present in several files counts once)
"""

from __future__ import annotations

import argparse
import json
import math
import time
from pathlib import Path
from typing import Any

import _common
import _rl
import numpy as np
import torch

from astraflow.rl import PolicyLossConfig

TERMS = {  # what the figures compare (written into the results JSON)
    "ours": "the dataflow schedule at staleness bound K with each off-policy correction (in one process)",
    "against": "the sync loop (staleness 0) on the same seeds",
    "settings": "workload b at sigma 1.0, 64 samples per batch in --minibatches optimizer steps, same sample budget; "
                "the rollout engine gets the weights K - 1 versions late (simulated staleness, not the real pipeline); "
                "the dataflow trains the first groups to complete",
}


BASE = {"eps_low": 0.2, "eps_high": 0.28}  # the trainer's default clip (trainers/config.py)
CORRECTIONS: dict[str, dict[str, Any]] = {
    "ppo": {"mode": "ppo"},  # ratio against the behaviour policy, dual clip
    "decoupled": {"mode": "decoupled", "tis_cap": 2.0},  # the trainer's default
    "tis": {"mode": "tis", "tis_cap": 2.0},
    "mis": {"mode": "mis", "tis_cap": 2.0},
    "m2po": {"mode": "m2po", "m2_threshold": 0.04},
    "stale": {"mode": "decoupled", "tis_cap": 2.0, "staleness_weight": "inverse"},  # 1/lag weight
}
SYNC_LOSS = "decoupled"


def loss_config(name: str) -> PolicyLossConfig:
    return PolicyLossConfig(**{**BASE, **CORRECTIONS[name]})


def run_row(run: _rl.Run, setting: str, staleness: int, correction: str, seed: int) -> dict[str, Any]:
    lm = run.learner_metrics

    def mean(key: str) -> float | None:
        vals = [m[key] for m in lm if key in m and math.isfinite(m[key])]
        return float(np.mean(vals)) if vals else None

    return {"setting": setting, "staleness": staleness, "correction": correction, "seed": seed,
            "wall_s": run.wall_s, "trained": run.trained, "trajectories": run.trajectories,
            "samples_per_s": run.trained / run.wall_s if run.wall_s else 0.0,
            "success": run.success,  # (step, t, held-out success) per snapshot
            "train_reward": run.train_reward,  # mean reward of each trained batch
            "staleness_mean": mean("staleness_mean"), "staleness_max": max((m["staleness_max"] for m in lm), default=0.0),
            "is_weight_std": mean("is_weight_std"), "log_mu_pi_std": mean("log_mu_pi_std"),
            "clip_frac": mean("clip_frac"), "masked_frac": mean("is_masked_frac")}


def unique_rows(rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The first row of each (setting, seed): files of several invocations may repeat a run."""
    seen: set[tuple[str, int]] = set()
    out = []
    for r in rows:
        if (r["setting"], r["seed"]) not in seen:
            seen.add((r["setting"], r["seed"]))
            out.append(r)
    return out


def success_at(row: dict[str, Any], t: float) -> float:
    """Held-out success of the last snapshot taken by wall time `t`."""
    got = [s for _, ts, s in row["success"] if ts <= t + 1e-9]
    return got[-1] if got else row["success"][0][2]


def per_seed(rows: list[dict[str, Any]]) -> dict[str, dict[str, Any]]:
    """Per seed and setting: samples/s, staleness and held-out success after the full budget."""
    out: dict[str, dict[str, Any]] = {}
    for r in rows:
        out.setdefault(str(r["seed"]), {})[r["setting"]] = {
            "samples_per_s": r["samples_per_s"], "staleness_mean": r["staleness_mean"], "final_success": r["success"][-1][2]}
    return out


def mean_sem(values: list[float]) -> tuple[float, float]:
    if not values:
        return float("nan"), float("nan")
    sem = float(np.std(values, ddof=1) / math.sqrt(len(values))) if len(values) > 1 else float("nan")
    return float(np.mean(values)), sem


def table(rows: list[dict[str, Any]]) -> tuple[list[str], list[dict[str, Any]]]:
    """The per-setting summary lines and figures (sync first)."""
    t_equal = min(r["wall_s"] for r in rows)
    settings = sorted({r["setting"] for r in rows}, key=lambda s: (s != "sync", s))
    sync_sps = mean_sem([r["samples_per_s"] for r in rows if r["setting"] == "sync"])[0]
    lines = [f"equal wall time = {t_equal:.1f}s (the fastest run)",
             f"{'setting':<22} {'seeds':>5} {'samples/s':>9} {'x sync':>6} {'staleness mean/max':>18} "
             f"{'success @ equal samples':>24} {'success @ equal time':>21} {'IS-w std':>8} {'clip/mask':>9}"]
    out = []
    for name in settings:
        rs = [r for r in rows if r["setting"] == name]
        final = mean_sem([r["success"][-1][2] for r in rs])
        timed = mean_sem([success_at(r, t_equal) for r in rs])
        sps = float(np.mean([r["samples_per_s"] for r in rs]))
        stale = float(np.mean([r["staleness_mean"] or 0.0 for r in rs]))
        smax = max(r["staleness_max"] for r in rs)
        isw = [r["is_weight_std"] for r in rs if r["is_weight_std"] is not None]
        clip = [r["clip_frac"] for r in rs if r["clip_frac"] is not None]
        fig = {"setting": name, "seeds": len(rs), "samples_per_s": sps, "x_sync": sps / sync_sps if sync_sps else None,
               "staleness_mean": stale, "staleness_max": smax, "final_mean": final[0], "final_sem": final[1],
               "equal_time_mean": timed[0], "equal_time_sem": timed[1]}
        out.append(fig)
        lines.append(f"{name:<22} {len(rs):>5} {sps:>9.1f} {fig['x_sync'] or 0:>5.2f}x {stale:>11.2f} / {smax:<4.0f} "
                     f"{final[0]:>15.3f} ± {final[1]:.3f} {timed[0]:>12.3f} ± {timed[1]:.3f} "
                     f"{np.mean(isw) if isw else 0:>8.3f} {np.mean(clip) if clip else 0:>9.3f}")
    return lines, out


def plot(rows: list[dict[str, Any]], path: Path) -> None:
    """Success against trained samples and against wall time, one line per setting (mean over
    seeds), one row of panels per staleness, the sync loop on every panel."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    levels = sorted({r["staleness"] for r in rows if r["setting"] != "sync"})
    fig, axes = plt.subplots(max(1, len(levels)), 2, figsize=(11, 3.2 * max(1, len(levels))), squeeze=False)
    for i, k in enumerate(levels or [0]):
        names = ["sync", *sorted({r["setting"] for r in rows if r["staleness"] == k and r["setting"] != "sync"})]
        for name in names:
            rs = [r for r in rows if r["setting"] == name]
            if not rs:
                continue
            n = min(len(r["success"]) for r in rs)
            steps = [rs[0]["success"][j][0] * _rl.SLOTS for j in range(n)]
            ys = np.mean([[r["success"][j][2] for j in range(n)] for r in rs], axis=0)
            ts = np.mean([[r["success"][j][1] for j in range(n)] for r in rs], axis=0)
            style = {"color": "black", "lw": 2} if name == "sync" else {}
            axes[i][0].plot(steps, ys, marker="o", ms=3, label=name, **style)
            axes[i][1].plot(ts, ys, marker="o", ms=3, label=name, **style)
        axes[i][0].set_title(f"staleness {k}: success vs trained samples", fontsize=9)
        axes[i][1].set_title(f"staleness {k}: success vs wall time (s)", fontsize=9)
        axes[i][0].set_ylabel("held-out success")
        axes[i][1].legend(fontsize=7, loc="lower right")
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=90)
    print(f"wrote {path}")


def report(rows: list[dict[str, Any]], plot_path: Path) -> list[dict[str, Any]]:
    lines, figures = table(rows)
    print("\n".join(lines), flush=True)
    plot(rows, plot_path)
    return figures


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--staleness", default="1,2,4,8", help="dataflow staleness bounds K")
    ap.add_argument("--corrections", default="decoupled,tis,mis,m2po,stale", help=f"of {','.join(CORRECTIONS)}")
    ap.add_argument("--seeds", default="0,1,2")
    ap.add_argument("--steps", type=int, default=10, help="optimizer batches of 64 samples per run")
    ap.add_argument("--eval-every", type=int, default=2)
    ap.add_argument("--sigma", type=float, default=1.0, help="log-normal sigma of the tool delay")
    ap.add_argument("--median-s", type=float, default=0.2)
    ap.add_argument("--minibatches", type=int, default=2, help="optimizer steps per batch")
    ap.add_argument("--no-lag", action="store_true",
                    help="no weight lag: the plain dataflow schedule at bound K (samples then 1-3 versions stale)")
    ap.add_argument("--quick", action="store_true",
                    help="K=8, decoupled and m2po, seeds 0,1, 4 batches, 64 held-out problems (what `make bench-quick` runs)")
    ap.add_argument("--json", default=None, help="default bench/results/[quick/]staleness.json")
    ap.add_argument("--plot", default=None,
                    help="where to draw the plot (default: beside the JSON, .png; docs/img/staleness.png is the "
                         "documented figure: pass it to replace that)")
    ap.add_argument("--heldout", type=int, default=_rl.N_HELDOUT, help="held-out problems (2 episodes each) per snapshot")
    ap.add_argument("--report", default=None, help="only re-make table and plot from these JSON files (comma-separated)")
    ap.add_argument("--no-sync", action="store_true", help="skip the sync runs (when another invocation of the grid made them)")
    args = ap.parse_args()
    if args.plot is None:
        json_path = Path(args.json) if args.json else (_common.QUICK_RESULTS if args.quick else _common.RESULTS) / "staleness.json"
        args.plot = str(json_path.with_suffix(".png"))
    if args.report:
        rows = unique_rows([r for path in args.report.split(",") for r in json.loads(Path(path).read_text())["rows"]])
        report(rows, Path(args.plot))
        return
    if args.quick:
        args.staleness, args.corrections, args.seeds, args.steps, args.heldout = "8", "decoupled,m2po", "0,1", 4, 64
    corrections = args.corrections.split(",")
    if bad := [c for c in corrections if c not in CORRECTIONS]:
        ap.error(f"unknown correction(s) {bad}; choose from {', '.join(CORRECTIONS)}")
    levels = [int(k) for k in args.staleness.split(",")]
    seeds = [int(s) for s in args.seeds.split(",")]
    torch.set_num_threads(1)
    model_dir = _rl.warm_model_dir()
    rows: list[dict[str, Any]] = []
    plan = [] if args.no_sync else [(seed, "sync", 0, SYNC_LOSS) for seed in seeds[:1]]
    for seed in seeds:
        if seed != seeds[0] and not args.no_sync:
            plan.append((seed, "sync", 0, SYNC_LOSS))
        plan += [(seed, f"K={k} {c}", k, c) for k in sorted(levels, reverse=True) for c in corrections]
    t_start = time.monotonic()
    meta = {"workload": _rl.WORKLOADS["b"]["label"], "sigma": args.sigma, "median_s": args.median_s,
            "steps": args.steps, "samples_per_step": _rl.SLOTS, "lr": _rl.LR, "minibatches": args.minibatches,
            "seeds": seeds, "staleness": levels, "heldout_episodes": 2 * args.heldout, "corrections": {c: CORRECTIONS[c] for c in corrections},
            "base": BASE, "planned_runs": len(plan), "weight_lag": "none" if args.no_lag else "K - 1"}
    for i, (seed, setting, k, corr) in enumerate(plan, 1):
        tasks, heldout = _rl.make_tasks(args.steps * _rl.PROMPTS_PER_STEP * 4, seed, "b", args.heldout)
        mode = "sync" if setting == "sync" else "dataflow"
        run = _rl.one_run(mode, "b", args.sigma, steps=args.steps, eval_every=args.eval_every, staleness=k, seed=seed,
                          median_s=args.median_s, model_dir=model_dir, tasks=tasks, heldout=heldout,
                          loss=loss_config(corr), minibatches=args.minibatches,
                          weight_lag=0 if args.no_lag or mode == "sync" else max(0, k - 1))
        row = run_row(run, setting, k, corr, seed)
        rows.append(row)
        print(f"[{i}/{len(plan)} {time.monotonic() - t_start:.0f}s] seed {seed} {setting}: {run.wall_s:.1f}s "
              f"{row['samples_per_s']:.1f} samples/s staleness {row['staleness_mean']:.2f}/{row['staleness_max']:.0f} "
              "success " + " ".join(f"{s:.3f}" for _, _, s in run.success), flush=True)
        _common.write_json(args.json, "staleness", {**meta, "completed_runs": len(rows), "rows": rows,
                                                     "per_seed": per_seed(rows)}, terms=TERMS, quick=args.quick)
    figures = report(rows, Path(args.plot))
    _common.write_json(args.json, "staleness", {**meta, "completed_runs": len(rows), "rows": rows, "per_seed": per_seed(rows),
                                                 "figures": figures}, terms=TERMS, quick=args.quick)


if __name__ == "__main__":
    main()
