"""Where the early steps' time goes in bench/multi_policy.py: a timeline per schedule and policy.

Every time is in seconds from the schedule's clock start (t0; the module doc of multi_policy.py
says what each clock includes). Per optimizer step k of a policy:

* `batch_ready`: its training data was complete. In-process: the step began (the batch is
  there then). Pipeline: the last trajectory of the groups the trainer's step k trained ended
  on the node (`Trajectory.timings.finished_at`).
* `began`, `ended`: the optimizer step (in-process: the learner's step and the hand-over of the
  weights to its engine; pipeline: the trainer's metrics timestamp minus `publish_s` and
  `step_s`, and minus `publish_s`).
* `snapshot`: version k where the benchmark scores it (in-process: when the learner handed it
  over; pipeline: when the benchmark's follower had it from Kafka). The time to target is the
  time of a snapshot.

Pipeline only: `before_t0` (the role processes started, every role ready, the curator resumed:
negative, outside the clock) and `node` (rollouts in flight on the node at each half second of
the first 20 s, their mean over the whole run against the node's `max_inflight`, and the mean
seconds per rollout spent generating, in tools and in all), from the trajectories' timings.
"""

from __future__ import annotations

from typing import Any

OCCUPANCY_EVERY_S = 0.5
OCCUPANCY_SPAN_S = 20.0


def steps_from_metrics(by_step: dict[int, dict[str, float]], t0: float) -> dict[int, dict[str, float]]:
    """Trainer steps from its metric records (`by_step[k]`: `ts`, the time it logged step k, after
    publishing, and its `step_s`, `publish_s`) -> began / ended / published, s from t0."""
    out = {}
    for k, m in by_step.items():
        if "step_s" not in m:
            continue
        publish = m.get("publish_s", 0.0)
        out[k] = {"began": round(m["ts"] - publish - m["step_s"] - t0, 3), "ended": round(m["ts"] - publish - t0, 3)}
        if "warm_up_s" in m:  # the trainer's warm-up while this batch filled (`PolicyTrainer.warm_up`)
            out[k]["warm_up_s"] = round(m["warm_up_s"], 3)
    return out


def batch_ready(groups: list[dict[str, Any]]) -> dict[int, float]:
    """Step -> when the last trajectory of the groups it trained ended (`group_diagnostics` rows)."""
    out: dict[int, float] = {}
    for g in groups:
        if g.get("ended_s") is not None:
            out[g["step"]] = max(out.get(g["step"], float("-inf")), g["ended_s"])
    return out


def pipeline_steps(groups: list[dict[str, Any]], trainer: dict[int, dict[str, float]],
                   snapshots: list[tuple[int, float]]) -> list[dict[str, Any]]:
    """One row per step of a policy: batch_ready, began, ended, snapshot (None where unknown)."""
    ready = batch_ready(groups)
    at = dict(snapshots)
    steps = sorted(set(ready) | set(trainer) | {v for v in at if v > 0})
    return [{"step": k, "batch_ready": ready.get(k), "began": trainer.get(k, {}).get("began"),
             "ended": trainer.get(k, {}).get("ended"), "snapshot": round(at[k], 3) if k in at else None,
             **({"warm_up_s": trainer[k]["warm_up_s"]} if "warm_up_s" in trainer.get(k, {}) else {})} for k in steps]


def node_occupancy(spans: list[tuple[float, float]], wall_s: float, max_inflight: int) -> dict[str, Any]:
    """Rollouts in flight from their (start, end) times (s from t0): at each OCCUPANCY_EVERY_S of
    the first OCCUPANCY_SPAN_S, and the time-weighted mean over [0, wall_s] against `max_inflight`."""
    marks = [i * OCCUPANCY_EVERY_S for i in range(int(OCCUPANCY_SPAN_S / OCCUPANCY_EVERY_S) + 1)]
    at = [sum(1 for s, e in spans if s <= m < e) for m in marks]
    busy = sum(max(0.0, min(e, wall_s) - max(s, 0.0)) for s, e in spans)
    mean = busy / wall_s if wall_s > 0 else 0.0
    return {"every_s": OCCUPANCY_EVERY_S, "inflight": at, "mean_inflight": round(mean, 1),
            "share_of_max": round(mean / max_inflight, 3) if max_inflight else None}


def rollout_times(trajectories: list[Any], t0: float) -> tuple[list[tuple[float, float]], dict[str, float]]:
    """(start, end) of every trajectory (s from t0) and the mean generate / tool / total seconds."""
    spans = [(t.timings.started_at / 1000 - t0, t.timings.finished_at / 1000 - t0) for t in trajectories]
    n = max(1, len(trajectories))
    means = {"generate_s": round(sum(t.timings.generate_s for t in trajectories) / n, 3),
             "tool_s": round(sum(t.timings.tool_s for t in trajectories) / n, 3),
             "rollout_s": round(sum(e - s for s, e in spans) / n, 3)}
    return spans, means


def in_process_row(version: int, began: float, ended: float) -> dict[str, Any]:
    """The in-process learner's step `version`: its batch was there when it began."""
    return {"step": version, "batch_ready": round(began, 3), "began": round(began, 3), "ended": round(ended, 3),
            "snapshot": round(ended, 3)}


def print_timeline(mode: str, timeline: dict[str, Any], steps: int = 5) -> None:
    """The first `steps` steps of each policy, and the pipeline's node and start-up lines."""
    def f(x: float | None) -> str:
        return "-" if x is None else f"{x:.2f}"

    for p, rows in timeline.get("steps", {}).items():
        cells = [f"{r['step']}: {f(r['batch_ready'])}/{f(r['began'])}/{f(r['ended'])}/{f(r['snapshot'])}"
                 for r in rows[:steps]]
        warm = [r["warm_up_s"] for r in rows if "warm_up_s" in r]
        print(f"    {mode} {p} steps (batch ready/began/ended/snapshot, s): " + "  ".join(cells)
              + (f"; warm-up before step 1: {warm[0]:.2f} s" if warm else ""), flush=True)
    if before := timeline.get("before_t0"):
        print("    before t0: " + ", ".join(f"{k} {v:.2f}s" for k, v in before.items()), flush=True)
    if node := timeline.get("node"):
        occ = node["occupancy"]
        print(f"    node: mean {occ['mean_inflight']} rollouts in flight ({occ['share_of_max']:.0%} of max); "
              f"first 10 s every {occ['every_s']} s: {occ['inflight'][:21]}; per rollout " +
              ", ".join(f"{k} {v:.2f}" for k, v in node["per_rollout"].items()), flush=True)
