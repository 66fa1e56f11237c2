"""What a multi-policy demo sees and leaves behind: per-policy curves, plot and summary.json.

`PairMonitor` is the demo `Monitor` with every figure kept per policy (label `policy` of the
evaluators' and trainers' metrics; each policy's reward component of the scored trajectories).
"""

from __future__ import annotations

import csv
import json
import time
from collections import defaultdict
from pathlib import Path
from typing import Any

from astraflow.demo.monitor import Monitor
from astraflow.records import Metric, Trajectory

METRIC_OF = {"solver": "success", "verifier": "accuracy"}


class PairMonitor(Monitor):
    """Per-policy held-out evaluations, trainer versions, trained samples and training rewards."""

    def __post_init__(self) -> None:
        super().__post_init__()
        self.evals_by: dict[str, list[dict]] = defaultdict(list)
        self.greedy_by: dict[str, dict[int, float]] = defaultdict(dict)
        self.version_by: dict[str, int] = {}
        self.samples_by: dict[str, int] = defaultdict(int)
        self.rewards_by: dict[str, list[tuple[float, float]]] = defaultdict(list)  # policy -> (t, reward)

    def _apply(self, rec: object, now: float) -> None:
        if isinstance(rec, Metric) and rec.component in ("eval", "trainer") and "bucket" not in rec.labels:
            policy = rec.labels.get("policy", "")
            version = int(rec.labels.get("version", -1))
            if rec.name == "eval_success_greedy":
                self.greedy_by[policy][version] = rec.value
            elif rec.name == "eval_success":
                self.evals_by[policy].append({"t": now, "policy": policy, "version": version, "success": rec.value,
                                              "greedy": self.greedy_by[policy].get(version)})
            elif rec.name == "trainer.policy_version":
                self.version_by[policy] = int(rec.value)
            elif rec.name == "trainer.samples":
                self.samples_by[policy] += int(rec.value)
            return
        if isinstance(rec, Trajectory) and rec.reward is not None:
            for key, reward in rec.reward_components.items():
                if key.startswith("policy."):
                    self.rewards_by[key.removeprefix("policy.")].append((now, float(reward)))
        super()._apply(rec, now)

    def reached(self, policies: tuple[str, ...], versions: int) -> bool:
        """Every policy has published `versions` versions and has a held-out evaluation."""
        with self._lock:
            return all(self.version_by.get(p, 0) >= versions and self.evals_by.get(p) for p in policies)

    def line(self) -> str:
        """One line of figures for the console."""
        with self._lock:
            parts = [f"{time.monotonic() - self.t0:6.0f}s  trajectories {len(self.rows):5d}"]
            for policy in sorted(set(self.rewards_by) | set(self.evals_by)):
                recent = [r for _, r in self.rewards_by[policy][-64:]]
                ev = self.evals_by[policy][-1] if self.evals_by[policy] else None
                parts.append(f"{policy}: v{self.version_by.get(policy, 0)} reward {_mean(recent)} "
                             f"held-out {'n/a' if ev is None else format(ev['success'], '.1%')}")
            return "  |  ".join(parts) + f"  |  dlq {len(self.dlq)}"


def _mean(xs: list[float]) -> str:
    return "n/a" if not xs else f"{sum(xs) / len(xs):.3f}"


def policy_summary(monitor: PairMonitor, policy: str) -> dict[str, Any]:
    evals = monitor.evals_by.get(policy, [])
    warm = next((e for e in evals if e["version"] == 0), evals[0] if evals else None)
    return {
        "eval_metric": METRIC_OF.get(policy, "success"),
        "eval_warm_start": warm["success"] if warm else None,
        "eval_final": evals[-1]["success"] if evals else None,
        "eval_best": max((e["success"] for e in evals), default=None),
        "eval_greedy_warm_start": warm["greedy"] if warm else None,
        "eval_greedy_final": evals[-1]["greedy"] if evals else None,
        "eval_points": len(evals),
        "eval_curve": [[round(e["t"], 1), e["version"], e["success"], e["greedy"]] for e in evals],
        "versions_published": monitor.version_by.get(policy),
        "samples_trained": monitor.samples_by.get(policy, 0),
        "training_reward_first_64": _avg([r for _, r in monitor.rewards_by.get(policy, [])[:64]]),
        "training_reward_last_64": _avg([r for _, r in monitor.rewards_by.get(policy, [])[-64:]]),
    }


def _avg(xs: list[float]) -> float | None:
    return round(sum(xs) / len(xs), 4) if xs else None


def write_pair_report(monitor: PairMonitor, run_dir: Path, policies: list[str], extra: dict[str, Any]) -> dict[str, Any]:
    """eval.csv (every evaluation of every policy), learning.png and summary.json."""
    with (run_dir / "eval.csv").open("w", newline="") as f:
        w = csv.DictWriter(f, ["t", "policy", "version", "success", "greedy"])
        w.writeheader()
        for policy in policies:
            w.writerows(monitor.evals_by.get(policy, []))
    write_plot(monitor, policies, run_dir / "learning.png")
    summary = {"experiment": monitor.experiment, "policies": {p: policy_summary(monitor, p) for p in policies},
               "eval_protocol": "solver: held-out problems, success sampled at T=1 (2 episodes each) and greedy; "
                                "verifier: a fixed balanced held-out set of judgements (half right proposals), accuracy",
               "trajectories": len(monitor.rows), "dead_letters": len(monitor.dlq), **extra}
    (run_dir / "summary.json").write_text(json.dumps(summary, indent=2) + "\n")
    return summary


def write_plot(monitor: PairMonitor, policies: list[str], out: Path) -> Path:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, max(1, len(policies)), figsize=(5.5 * max(1, len(policies)), 4), squeeze=False)
    for ax, policy in zip(axes[0], policies, strict=False):
        bins: dict[int, list[float]] = defaultdict(list)
        for t, r in monitor.rewards_by.get(policy, []):
            bins[int(t // 15)].append(r)
        if bins:
            xs = sorted(bins)
            ax.plot([(x + 0.5) * 15 for x in xs], [sum(bins[x]) / len(bins[x]) for x in xs], ".-",
                    label="training reward (mean per 15 s)")
        evals = monitor.evals_by.get(policy, [])
        name = METRIC_OF.get(policy, "success")
        if evals:
            ax.plot([e["t"] for e in evals], [e["success"] for e in evals], "o-", label=f"held-out {name} (sampled)")
            ax.plot([e["t"] for e in evals], [e["greedy"] for e in evals], "s--", label=f"held-out {name} (greedy)")
        ax.set_xlabel("wall time (s)")
        ax.set_ylim(-0.02, 1.22)
        ax.legend(loc="upper left", fontsize=8)
        ax.set_title(policy)
    fig.suptitle(f"AstraFlow solver + verifier — experiment {monitor.experiment}")
    fig.tight_layout()
    fig.savefig(out, dpi=110)
    plt.close(fig)
    return out
