"""`bench/regions.py --outage`: all of region B killed, then back (with `--via mm2`: region B on a
cluster of its own, the curator's shares following the regions' live nodes).

Phases (instead of calibration and the elastic phase):
1. **alone**: region A's nodes only (region B's never started: the curator, having heard from
   none of B's nodes for `--region-dead-s` since its start, sends B nothing), `--alone-s` from
   A's first trajectories: region A's throughput alone.
2. **mixed**: region B's nodes start too (B's share returns as their metrics arrive), `--mixed-s`.
3. **outage**: every node of region B killed with `kill -9` while loaded, `--outage-s` (quick
   30 s, else 120 s); then B's nodes start again and run `--hold-s` more.
4. **drain** and the books (`bench/_ledger.py`): lost and trained twice over every task.

Figures (`outage` in the JSON, and `outage_a_vs_alone`, `rebalance_s`, `lost`, `trained_twice`
at its top):
* `outage_a_vs_alone`: region A's rollouts/s from the kill to the restart over its rollouts/s
  alone (phase 1); also over the mixed phase's;
* `rebalance_s.to_a`: from the kill to the first task the curator gave back (a Task written
  again with `given_back_from`), i.e. how long B's outstanding tasks waited;
* `rebalance_s.back_to_b`: from region B's first node metric after the restart (the node is up
  and reports) to the first new task the curator wrote to `tasks.b` after it; and from the
  restart of the processes (`back_to_b_from_restart`);
* `given_back`: tasks written again elsewhere; `lost` / `trained_twice`: samples, over all tasks;
* `curator_mixed_mean`: the curator's region gauges over the mixed phase (share, transit s,
  reserve and tasks outstanding per region: `tasks` is region A).
"""

from __future__ import annotations

import time
from typing import Any


def region_nodes(run: Any, region: str) -> list[str]:
    return [n for n, r in run.node_specs if r == region]


def alone(run: Any) -> None:
    """Region A's nodes alone, `alone_s` from their first trajectories."""
    t = time.time()
    for name in region_nodes(run, "a"):
        run.start_node(name)
    for name in region_nodes(run, "a"):
        run.first_after(name, t)
        run.apply_quota(name)
    run.wait(5.0)  # the nodes under their quotas
    run.marks["alone_start"] = time.time()
    run.wait(run.a.alone_s)
    run.marks["alone_end"] = time.time()
    run.step("alone")
    rate = run.count(None, run.marks["alone_start"], run.marks["alone_end"]) / run.a.alone_s
    print(f"alone: region A {rate:.2f} rollouts/s", flush=True)


def outage(run: Any) -> None:
    """Every node of region B killed (kill -9, once one has rollouts in flight), `outage_s`, restarted."""
    b = region_nodes(run, "b")
    since, deadline = time.time(), time.time() + 20.0
    while time.time() < deadline:
        run.refresh()
        if any(v > 0 for n, ts, v in run.seen.inflight if n in b and ts >= since):
            break
        time.sleep(0.2)
    run.marks["outage_start"] = time.time()
    for name in b:
        run.kill_node(name)
    print(f"outage: killed {', '.join(b)}", flush=True)
    run.wait(run.a.outage_s)
    run.marks["outage_end"] = time.time()
    for name in b:
        run.start_node(name)
    for name in b:
        run.first_after(name, run.marks["outage_end"])
        run.apply_quota(name)
    run.wait(run.a.hold_s)
    run.marks["outage_after"] = time.time()
    run.step("outage")


def figures(run: Any, report: dict) -> dict:
    """The outage's figures (see the module doc), from what the run read."""
    m = run.marks
    a_nodes, b_nodes = region_nodes(run, "a"), region_nodes(run, "b")
    tasks_b = run.topics.tasks_of("b")

    def rate(nodes: list[str], t0: float, t1: float) -> float:
        return sum(run.count(n, t0, t1) for n in nodes) / max(1e-9, t1 - t0)

    out: dict[str, Any] = {}
    a_alone = rate(a_nodes, m["alone_start"], m["alone_end"]) if "alone_end" in m else None
    a_mixed = rate(a_nodes, m["mixed_start"], m["mixed_end"])
    b_mixed = rate(b_nodes, m["mixed_start"], m["mixed_end"])
    out.update(a_alone_rollouts_per_s=a_alone, a_mixed_rollouts_per_s=round(a_mixed, 2),
               b_mixed_rollouts_per_s=round(b_mixed, 2))
    by: dict[str, list[float]] = {}
    for ts, name, value in getattr(run.seen, "curator", []):
        if m["mixed_start"] <= ts <= m["mixed_end"]:
            by.setdefault(name, []).append(value)
    out["curator_mixed_mean"] = {name: round(sum(v) / len(v), 2) for name, v in sorted(by.items())}
    if "outage_end" in m:
        kill, back = m["outage_start"], m["outage_end"]
        a_out = rate(a_nodes, kill, back)
        out["a_outage_rollouts_per_s"] = round(a_out, 2)
        out["outage_a_vs_alone"] = None if not a_alone else round(a_out / a_alone, 3)
        out["outage_a_vs_mixed"] = None if not a_mixed else round(a_out / a_mixed, 3)
        half = kill + (back - kill) / 2  # after the curator's bound: A alone again
        out["outage_a_second_half_vs_alone"] = None if not a_alone else round(rate(a_nodes, half, back) / a_alone, 3)
        written = run.ledger.written
        given = sorted(ts / 1000 for _, _, ts, src in written if src == tasks_b)
        first_given = next((t for t in given if t >= kill), None)
        b_metric = min((ts for n, ts, _ in run.seen.inflight if n in b_nodes and ts >= back), default=None)
        first_b = min((ts / 1000 for _, topic, ts, src in written
                       if topic == tasks_b and src is None and ts / 1000 >= (b_metric or back)), default=None)
        out["rebalance_s"] = {
            "to_a": None if first_given is None else round(first_given - kill, 2),
            "back_to_b": None if first_b is None or b_metric is None else round(first_b - b_metric, 2),
            "back_to_b_from_restart": None if first_b is None else round(first_b - back, 2),
        }
        out["given_back"] = len(given)
        out["b_after_rollouts_per_s"] = round(rate(b_nodes, m.get("outage_after", back) - run.a.hold_s / 2,
                                                   m.get("outage_after", back)), 2)
    out["duplicate_task_records"] = run.ledger.duplicate_tasks
    return out
