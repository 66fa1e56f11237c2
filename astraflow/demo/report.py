"""What a demo run leaves in its run directory: metrics CSV, a plot, and summary.json."""

from __future__ import annotations

import csv
import json
from pathlib import Path
from typing import Any

from astraflow.demo.monitor import Monitor

# Under the axes, never over the curves (they span the whole 0..1 range as a run learns).
LEGEND_BELOW = {"loc": "upper center", "bbox_to_anchor": (0.5, -0.16), "fontsize": "small", "frameon": False}


def write_csv(monitor: Monitor, run_dir: Path) -> tuple[Path, Path]:
    traj = run_dir / "trajectories.csv"
    with traj.open("w", newline="") as f:
        w = csv.DictWriter(f, ["t", "reward", "version", "trainer_version", "node", "tool_calls", "status"])
        w.writeheader()
        w.writerows(monitor.rows)
    evals = run_dir / "eval.csv"
    with evals.open("w", newline="") as f:
        w = csv.DictWriter(f, ["t", "version", "success", "greedy"])
        w.writeheader()
        w.writerows(monitor.evals)
    return traj, evals


def write_plot(monitor: Monitor, run_dir: Path) -> Path:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows, evals = monitor.rows, monitor.evals
    fig, (a, b) = plt.subplots(1, 2, figsize=(11, 5))
    if rows:
        bin_s = 10.0
        bins: dict[int, list[float]] = {}
        for r in rows:
            bins.setdefault(int(r["t"] // bin_s), []).append(r["reward"])
        xs = sorted(bins)
        a.plot([(x + 0.5) * bin_s for x in xs], [sum(bins[x]) / len(bins[x]) for x in xs], ".-",
               label=f"training reward (mean per {bin_s:.0f} s)")
    if evals:
        a.plot([e["t"] for e in evals], [e["success"] for e in evals], "o-", label="held-out success (sampled)")
        a.plot([e["t"] for e in evals], [e["greedy"] for e in evals], "s--", label="held-out success (greedy)")
    a.set_xlabel("wall time (s)")
    a.set_ylabel("reward / success")
    a.set_ylim(-0.02, 1.02)
    a.legend(**LEGEND_BELOW)
    a.set_title("against wall time")
    by_version = monitor.by_version()
    if by_version:
        b.plot(list(by_version), list(by_version.values()), ".-", label="training reward of rollouts by version")
    if evals:
        b.plot([e["version"] for e in evals], [e["success"] for e in evals], "o-", label="held-out success (sampled)")
        b.plot([e["version"] for e in evals], [e["greedy"] for e in evals], "s--", label="held-out success (greedy)")
    b.set_xlabel("policy version")
    b.set_ylim(-0.02, 1.02)
    b.legend(**LEGEND_BELOW)
    b.set_title("against policy version")
    fig.suptitle(f"AstraFlow demo — experiment {monitor.experiment}")
    fig.tight_layout()
    out = run_dir / "learning.png"
    fig.savefig(out, dpi=110)
    plt.close(fig)
    return out


def write_summary(monitor: Monitor, run_dir: Path, extra: dict[str, Any]) -> dict[str, Any]:
    evals = monitor.evals
    warm = next((e["success"] for e in evals if e["version"] == 0), evals[0]["success"] if evals else None)
    final = evals[-1]["success"] if evals else None
    best = max((e["success"] for e in evals), default=None)
    warm_greedy = next((e["greedy"] for e in evals if e["version"] == 0), None)
    final_greedy = evals[-1]["greedy"] if evals else None
    summary = {
        "experiment": monitor.experiment,
        "eval_success_warm_start": warm,
        "eval_success_final": final,
        "eval_success_best": best,
        "eval_success_greedy_warm_start": warm_greedy,
        "eval_success_greedy_final": final_greedy,
        "eval_protocol": "held-out problems, tool protocol of the tool_use workflow; success = sampled at T=1, 2 episodes each",
        "eval_points": len(evals),
        "versions_published": monitor.trainer_version,
        "trajectories": len(monitor.rows),
        "samples_trained": monitor.trained_samples,
        "dead_letters": len(monitor.dlq),  # of the run's roles (DeadLetter.component), not of user processors
        "dead_letters_of_processors": dict(sorted(monitor.processor_dlq.items())),
        **extra,
    }
    (run_dir / "summary.json").write_text(json.dumps(summary, indent=2) + "\n")
    return summary
