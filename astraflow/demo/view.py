"""The live terminal view of a demo run (rich)."""

from __future__ import annotations

from typing import Any

from rich.panel import Panel
from rich.table import Table

from astraflow.demo.monitor import Snapshot


def _f(x: float | None, fmt: str = "{:.3f}") -> str:
    return "-" if x is None else fmt.format(x)


def render(s: Snapshot, settings: Any, experiment: str) -> Panel:
    t = Table.grid(padding=(0, 2))
    t.add_column(style="bold")
    t.add_column()
    t.add_row("elapsed", f"{s.elapsed_s:5.0f}s of {settings.minutes * 60:.0f}s")
    t.add_row("held-out success", f"{_f(s.eval_success, '{:.1%}')} (version {s.eval_version if s.eval_version is not None else '-'}; "
              f"target {settings.target_success:.0%})")
    t.add_row("training reward", f"{_f(s.reward_recent)} (mean of last 64 trajectories)")
    t.add_row("trainer", f"version {s.trainer_version if s.trainer_version is not None else '-'}, "
              f"{s.train_samples} samples trained")
    t.add_row("versions per node", ", ".join(f"{k}={v}" for k, v in sorted(s.versions_by_node.items())) or "-")
    t.add_row("trajectories", f"{s.trajectories} ({s.traj_per_s:.1f}/s over 30 s)")
    t.add_row("staleness", f"{_f(s.staleness_recent, '{:.2f}')} versions behind the newest version (last 64)")
    t.add_row("consumer lag", ", ".join(f"{k}={v}" for k, v in s.lags.items()) or "-")
    t.add_row("dead letters", str(s.dlq))
    return Panel(t, title=f"AstraFlow demo — {experiment}", border_style="cyan")
