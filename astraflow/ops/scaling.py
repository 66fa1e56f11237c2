"""Per-region throughput and version lag, and an autoscaling signal, from what `status` measures.

Pure functions over `astraflow.ops.status`'s records (`collect_status` calls them):

- `regions_of`: per region label of the RaaS nodes (`raas serve --region`): nodes, rollouts/s,
  rollouts in flight, and the version lag (newest published version of a policy minus the
  oldest version a node of the region serves, over its policies).
- `autoscale_of`: the RaaS autoscaling signal and its rule. `task_lag` is the lag of the nodes'
  consumer group on the tasks topic (tasks issued and not yet finished by any node, the ones in
  flight included); `backlog_s` is that lag divided by the rate tasks are written (in steady
  state the rate they are finished); `target_s` is how long a task may wait. The rule:

  * scale out when `backlog_s > target_s`: add `ceil(nodes * (backlog_s / target_s - 1))` nodes
    (at least one; with no node at all, one);
  * scale in by one when `backlog_s < target_s / 4` and some node has nothing in flight;
  * otherwise hold.

  A curator with `--max-ahead` bounds the lag, so a lag at that bound for long means the nodes
  are the bottleneck; the gauges are exported by `astraflow metrics serve`
  (`astraflow_autoscale_desired_nodes_delta`, `..._task_lag`, `..._backlog_s`), for an autoscaler
  (KEDA, a HorizontalPodAutoscaler on an external metric) to act on.
"""

from __future__ import annotations

import math
from collections.abc import Iterable
from dataclasses import dataclass

TARGET_WAIT_S = 30.0


@dataclass
class RegionStatus:
    """The RaaS nodes of one region."""

    region: str
    nodes: int
    rollouts_per_s: float
    inflight: float
    version_lag: int | None  # newest published version minus the oldest a node here serves (max over policies)


@dataclass
class AutoscaleSignal:
    """See the module doc for the rule."""

    nodes: int
    task_lag: int
    tasks_per_s: float
    backlog_s: float | None  # None: no task written in the window
    target_s: float
    desired_delta: int  # nodes to add (> 0) or remove (< 0)
    reason: str


def regions_of(nodes: Iterable, latest: dict[str, int], stale_after_s: float = 60.0) -> list[RegionStatus]:
    """`nodes`: `NodeStatus` records; those not heard from for `stale_after_s` are left out."""
    by: dict[str, list] = {}
    for n in nodes:
        if n.last_seen_s <= stale_after_s:
            by.setdefault(n.region, []).append(n)
    out = []
    for region, ns in sorted(by.items()):
        lags = [latest[p] - v for n in ns for p, v in n.versions.items() if p in latest]
        out.append(RegionStatus(region, len(ns), sum(n.rollouts_per_s for n in ns), sum(n.inflight for n in ns),
                                max(0, max(lags)) if lags else None))
    return out


def autoscale_of(task_lag: int, tasks_per_s: float, nodes: Iterable, target_s: float = TARGET_WAIT_S,
                 stale_after_s: float = 60.0) -> AutoscaleSignal:
    live = [n for n in nodes if n.last_seen_s <= stale_after_s]
    backlog = task_lag / tasks_per_s if tasks_per_s > 0 else None
    if not live:
        want, why = (1, "tasks wait and no node serves") if task_lag > 0 else (0, "no node and no task waiting")
        return AutoscaleSignal(0, task_lag, tasks_per_s, backlog, target_s, want, why)
    if task_lag > 0 and (backlog is None or backlog > target_s):
        add = len(live) if backlog is None else max(1, math.ceil(len(live) * (backlog / target_s - 1)))
        why = "tasks wait and none is being issued" if backlog is None else f"backlog {backlog:.0f}s > {target_s:.0f}s"
        return AutoscaleSignal(len(live), task_lag, tasks_per_s, backlog, target_s, add, why)
    idle = [n for n in live if n.inflight == 0]
    if len(live) > 1 and idle and (backlog is None or backlog < target_s / 4):
        return AutoscaleSignal(len(live), task_lag, tasks_per_s, backlog, target_s, -1,
                               f"{len(idle)} node(s) idle, backlog {backlog or 0:.0f}s < {target_s / 4:.0f}s")
    return AutoscaleSignal(len(live), task_lag, tasks_per_s, backlog, target_s, 0, "within target")
