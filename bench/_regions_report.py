"""The figures of bench/regions.py from what its run read back (see regions.py's module doc)."""

from __future__ import annotations

import bisect
import contextlib
import os
import statistics
from typing import Any

from _fault_report import longest_task_wait
from _ledger import expected_samples
from _regions_run import EVENTS, RegionsRun

from astraflow.kafka.task_placer import read_commit_metadata, refill_delay_s
from astraflow.records import WeightKind

PLACE_LAG_S = 0.2  # the curator's placement observes every 0.2 s (stream_apps/curator.py PLACE_INTERVAL_S)


def _r(x: float | None, nd: int = 2) -> float | None:
    return None if x is None else round(x, nd)


Where = tuple[str, int]  # (tasks topic, partition)


def owners(starts: list[tuple[str, Where, float]]) -> dict[Where, list[tuple[float, str]]]:
    """Who owned each partition when: (start time, node) of the rollouts started from it, in time
    order (a node owns a partition from its first start there until another node starts one)."""
    out: dict[Where, list[tuple[float, str]]] = {}
    for node, where, t in starts:
        out.setdefault(where, []).append((t, node))
    for v in out.values():
        v.sort()
    return out


def owner_at(by_part: dict[Where, list[tuple[float, str]]], where: Where, t: float) -> str | None:
    """The node that started the last rollout of `where` at or before t (before any: the first one)."""
    seq = by_part.get(where)
    if not seq:
        return None
    i = bisect.bisect_right(seq, (t, "\uffff")) - 1
    return seq[max(i, 0)][1]


def transit_s(node: str, starts: list[tuple[str, str, float]], written: dict[str, float]) -> float:
    """How long a task may still be crossing to `node` (`starts`: node, task id, start): three
    times the shortest time from a task's write to its start there. The shortest is one way (a
    WAN's latency, a mirror's delivery), for a task written just as the node's fetch reached the
    broker; one written just after that fetch's answer left waits for the next fetch: the answer's
    way back, the next request's way there, and its own answer's way back, three one-way trips.
    At least 0."""
    gaps = [t - written[tid] for n, tid, t in starts if n == node and tid in written]
    return 3 * max(0.0, min(gaps)) if gaps else 0.0


def busy_spans(spans: list[tuple[float, float]]) -> list[tuple[float, float]]:
    """The union of a node's rollouts' (start, end) spans: when it had at least one in flight."""
    out: list[tuple[float, float]] = []
    for a, b in sorted(spans):
        if out and a <= out[-1][1]:
            out[-1] = (out[-1][0], max(out[-1][1], b))
        else:
            out.append((a, b))
    return out


def idle_while_waiting(node: str, spans: list[tuple[float, float]], tasks: list[tuple[Where, float, float]],
                            by_part: dict[Where, list[tuple[float, str]]], transit: float, t0: float, t1: float) -> float:
    """The fraction of [t0, t1] in which the node had no rollout in flight (`spans`: its rollouts'
    start and end, from their trajectories) while a task it could take was waiting: in a
    partition it owned then, written at least `transit` before (arrived, not in transit), not
    started by anyone yet. Tasks in other nodes' partitions, in flight elsewhere or still crossing
    do not count (with `transit` 0, those crossing do: idle while its work is on the way).
    `tasks`: (where, written, first start or inf)."""
    if t1 <= t0:
        return 0.0
    gaps, t = [], t0
    for a, b in busy_spans(spans):
        if a > t:
            gaps.append((t, min(a, t1)))
        t = max(t, b)
        if t >= t1:
            break
    if t < t1:
        gaps.append((t, t1))
    idle = 0.0
    for g0, g1 in gaps:
        if g1 <= g0:
            continue
        waits = []
        for where, w, st in tasks:
            a, b = max(g0, w + transit), min(g1, st)
            if a < b and owner_at(by_part, where, a) == node:
                waits.append((a, b))
        idle += sum(b - a for a, b in busy_spans(waits))
    return idle / (t1 - t0)


def held_mean(spans: list[tuple[float, float]], t0: float, t1: float) -> float:
    """The mean number of (start, end) spans open over [t0, t1] (tasks written to a node's
    partitions and not yet done: its backlog as the placement counts it, in transit included)."""
    if t1 <= t0:
        return 0.0
    total = sum(max(0.0, min(b, t1) - max(a, t0)) for a, b in spans)
    return total / (t1 - t0)


def reported(node: str, commits: list[tuple[float, int, int, str]], topic: str,
             by_part: dict[Where, list[tuple[float, str]]], t0: float, t1: float, group: int) -> dict[str, float | None]:
    """What `node` reported with its commits over [t0, t1] (each poll of the group's committed
    offsets, its partitions then): its speed (the sum over its partitions, in rollouts/s: tasks/s
    x `group` samples), its commit round trip, the refill delay the placement derives from it
    and the reserve, speed x delay, in tasks (the placement's is max(speed, rate) x delay); the
    means over the polls. None where it reported nothing."""
    polls: dict[float, list[tuple[int, str]]] = {}
    for ts, p, _, meta in commits:
        if t0 <= ts < t1:
            polls.setdefault(ts, []).append((p, meta))
    speeds, rtts, delays, reserves = [], [], [], []
    for ts, parts in polls.items():
        speed = reserve = 0.0
        seen_speed = False
        for p, meta in parts:
            if owner_at(by_part, (topic, p), ts) != node:
                continue
            r = read_commit_metadata(meta)
            delay = refill_delay_s(r, PLACE_LAG_S)
            rtts.append(r.rtt_s)
            delays.append(delay)
            if r.speed is not None:
                seen_speed = True
                speed += r.speed
                reserve += r.speed * delay
        if seen_speed:
            speeds.append(speed * group)
            reserves.append(reserve)
    return {"reported_speed_rps": _r(statistics.mean(speeds)) if speeds else None,
            "commit_rtt_s": _r(statistics.median(rtts), 3) if rtts else None,
            "refill_delay_s": _r(statistics.median(delays)) if delays else None,
            "reserve_tasks": _r(statistics.mean(reserves), 1) if reserves else None}


def quantile(xs: list[float], q: float) -> float | None:
    xs = sorted(xs)
    return xs[int(q * (len(xs) - 1))] if xs else None


def recovered_after(times: list[float], t: float, end: float, base: float, width: float = 5.0,
                    step: float = 0.5) -> tuple[float | None, float | None]:
    """From `t` on, the first moment the total rate over the last `width` s is back to 90% of
    `base` (seconds after t: 0 if it already was), and the lowest such rate in the `3 x width` s
    after t, as a fraction of `base` (what a join costs the others). `times`: sorted."""
    back, low, x = None, None, t
    while x <= end:
        rate = (bisect.bisect_left(times, x) - bisect.bisect_left(times, x - width)) / width
        if back is None and rate >= 0.9 * base:
            back = x - t
        if x <= t + 3 * width:
            low = rate if low is None else min(low, rate)
        if back is not None and x > t + 3 * width:
            break
        x += step
    return back, None if low is None or not base else low / base


STARTUP = (("imports", "node starting"), ("engine_torch", "engine process: modules imported"),
           ("engine_transformers", "engine process: transformers imported"), ("engine_model", "engine process: model loaded"),
           ("backends", "backends built"), ("caught_up", "caught up in"), ("joined", "joining the tasks group"),
           ("assigned", "assigned ["))


def startup_parts(log_text: str, since: float, first_start: float | None, first_rollout: float | None) -> dict[str, float | None]:
    """A node's start after `since` (epoch s, when its process was started) in parts, from its log's
    lines (the first of each kind after `since`) and its first rollout's start and end: process
    start to modules imported, to its engine process's torch imported, transformers imported and
    model loaded (the engine starts right after the node's imports), to backends built (the node's
    own torch and tokenizer, overlapping the engine's), to caught up with the newest weights
    (the snapshot and deltas pulled), to its joining the tasks group (ready: it subscribes only
    then), to its tasks partitions assigned (the group's rebalance), to its
    first rollout started, to that rollout written. A part whose line is missing is None (the next
    part includes its time)."""
    import datetime as dt

    marks: dict[str, float] = {}
    for line in log_text.splitlines():
        try:
            t = dt.datetime.strptime(line[:23], "%Y-%m-%d %H:%M:%S,%f").timestamp()
        except ValueError:
            continue
        if t < since:
            continue
        for name, text in STARTUP:
            if name not in marks and text in line and not line.rstrip().endswith("[]"):
                marks[name] = t
    seq = [("start", since), *((n, marks.get(n)) for n, _ in STARTUP), ("first_start", first_start),
           ("first_rollout", first_rollout)]
    out: dict[str, float | None] = {}
    prev = since
    for (name, t) in seq[1:]:
        out[f"to_{name}"] = None if t is None or prev is None else round(t - prev, 2)
        prev = t if t is not None else prev
    out["total"] = None if first_rollout is None else round(first_rollout - since, 2)
    out["ready"] = None if "joined" not in marks else round(marks["joined"] - since, 2)  # process start -> joining
    return out


def open_tasks(ledger: Any) -> int:
    """Issued tasks with a sample neither trained nor dead-lettered yet."""
    trained = ledger.trained_counts()
    return sum(1 for t in ledger.tasks.values()
               if any(sid not in trained and sid not in ledger.accounted for sid in expected_samples(t.task_id, t.n_samples)))


def loss_figures(drain_end: str | None, unaccounted: int, tasks_open: int) -> dict[str, Any]:
    """The loss count only when the drain ended with nothing moving: every sample accounted for,
    or stalled (what is left will not come: lost). A drain cut by its deadline, or a run stopped
    before it ended, leaves samples on their way: the count is unknown, with how many were open."""
    if drain_end in ("accounted", "stalled"):
        return {"drain_end": drain_end, "samples_lost": unaccounted}
    why = {"deadline": "cut by its deadline", "late tasks": "ended before tasks read after it"}.get(
        drain_end or "", "not reached or cut (the run was stopped)")
    return {"drain_end": drain_end or "stopped", "samples_lost": None,
            "samples_not_accounted_at_cut": unaccounted, "tasks_not_accounted_at_cut": tasks_open,
            "samples_lost_unknown": f"drain {why}: {unaccounted} samples of {tasks_open} tasks not yet "
                                    "trained or dead-lettered (on their way or lost: unknown)"}


def build(run: RegionsRun) -> dict[str, Any]:
    seen, m, a = run.seen, run.marks, run.a
    t0, t1 = m["mixed_start"], m["mixed_end"]
    # counted now that every trajectory has been read back (at the end of a phase the reader may lag)
    alone = {n: run.count(n, c[0], c[0] + c[2]) / c[2] for n, c in run.calib.items()}
    total_alone = sum(alone.values()) or 1.0
    fastest = max(alone.values(), default=0.0) or 1.0
    mixed_total = run.count(None, t0, t1) or 1
    issued_at = {t.task_id: t.ts_ms / 1000 for t in run.ledger.tasks.values()}
    first_rollout: dict[str, float] = {}
    for _, ts, tid, _ in seen.rollouts:
        first_rollout[tid] = min(ts, first_rollout.get(tid, float("inf")))
    issued_sorted = sorted(issued_at.items(), key=lambda kv: kv[1])

    # idle, per node (see idle_while_waiting): a task's partition, write and first start
    first_start: dict[str, float] = {}
    for _, tid, _, st in seen.started:
        first_start[tid] = min(st, first_start.get(tid, float("inf")))
    where_of = {t.task_id: t.where for t in run.ledger.tasks.values() if t.where is not None}
    located = [(n, where_of[tid], st) for n, tid, _, st in seen.started if tid in where_of]
    by_part = owners(located)
    tasks = [(where_of[tid], at, first_start.get(tid, float("inf"))) for tid, at in issued_sorted
             if tid in where_of and at <= t1 and first_start.get(tid, float("inf")) >= t0]

    spans_of: dict[str, list[tuple[float, float]]] = {}  # node -> its rollouts' (start, end)
    for (node, ts, _, _), (_, _, _, st) in zip(seen.rollouts, seen.started, strict=True):
        spans_of.setdefault(node, []).append((st, ts))
    done_at: dict[str, float] = {}  # task -> its last trajectory
    for _, ts, tid, _ in seen.rollouts:
        done_at[tid] = max(ts, done_at.get(tid, 0.0))
    commits = getattr(seen, "commits", [])  # (not in the raw records of runs before it was read)
    nodes = []
    for name, region in run.node_specs:
        n = run.count(name, t0, t1)
        share = n / mixed_total
        expected = alone[name] / total_alone if name in alone else None  # None: not calibrated (--no-calibrate)
        transit = transit_s(name, [(n, tid, st) for n, tid, _, st in seen.started], issued_at)
        spans = spans_of.get(name, [])
        mine = [tid for tid, at in issued_sorted if tid in where_of and owner_at(by_part, where_of[tid], at) == name]
        to_start = [first_start[tid] - issued_at[tid] for tid in mine if t0 <= first_start.get(tid, -1.0) < t1]
        nodes.append({"node": name, "region": region, "cpus": run.cpus.get(name) or None,
                      "alone_rps": _r(alone.get(name)), "rel_speed": _r(alone[name] / fastest) if name in alone else None,
                      "mixed_rps": _r(n / (t1 - t0)), "share": _r(share), "expected_share": _r(expected),
                      "share_dev": None if expected is None else _r((share - expected) / expected if expected else 0.0),
                      **reported(name, commits, run.topics.tasks, by_part, t0, t1, a.group),
                      "idle_while_waiting": _r(idle_while_waiting(name, spans, tasks, by_part, transit, t0, t1)),
                      "idle_while_on_the_way": _r(idle_while_waiting(name, spans, tasks, by_part, 0.0, t0, t1)),
                      "idle": _r(idle_while_waiting(name, spans, [(w, t0, t1) for w in by_part], by_part, 0.0, t0, t1)),
                      "tasks_held_mean": _r(held_mean([(issued_at[t], done_at.get(t, float("inf"))) for t in mine], t0, t1), 1),
                      "write_to_start_s_median": _r(quantile(to_start, 0.5)), "write_to_start_s_p90": _r(quantile(to_start, 0.9)),
                      "transit_s": _r(transit), "error_trajectories": seen.errors.get(name, 0)})

    # Weights: the stream's payload per version (every version a delta, but a publisher's first),
    # the snapshots written beside it (only joiners read them); the WAN's bytes per version.
    manifests = sorted(seen.manifests.values(), key=lambda p: p.version)
    deltas = [p.payload_bytes for p in manifests if p.kind == WeightKind.DELTA]
    snaps = [p.payload_bytes for p in seen.snapshots.values()]
    # The link's counters over the whole run (Toxiproxy counts a connection when it closes):
    # region B is the node raas-b1 and this benchmark's WAN follower, both pulling every version.
    end = run.wan_bytes.get("end", {})
    down, up = end.get("downstream", 0), end.get("upstream", 0)
    n_versions = max(1, len(manifests) - 1)
    # Region B: its node's applied version against the newest published one; the WAN follower's delay.
    created = [(p.created_at / 1000, p.version) for p in manifests]
    ctimes = [c[0] for c in created]
    n_pub = [v for c, v in created if t0 <= c < t1]
    version_rate = len(n_pub) / (t1 - t0)

    def lag_of(name: str) -> tuple[list[int], list[float]]:
        """The node's version lag at each of its metric samples in the mixed phase: versions, and
        seconds since the first version it lacks was published."""
        versions, seconds = [], []
        for node, ts, v in seen.node_version:
            if node == name and t0 <= ts < t1:
                i = bisect.bisect_right(ctimes, ts) - 1
                if i >= 0:
                    versions.append(max(0, created[i][1] - v))
                    j = bisect.bisect_right([c[1] for c in created], v)  # the first version newer than v
                    seconds.append(max(0.0, ts - created[j][0]) if j <= i else 0.0)
        return versions, seconds

    lags, lag_by_node = lag_of("raas-b1")[0], {}
    for name, _ in run.node_specs:
        v, sec = lag_of(name)
        lag_by_node[name] = {"versions_mean": _r(statistics.mean(v)) if v else None, "versions_max": max(v) if v else None,
                             "seconds_mean": _r(statistics.mean(sec)) if sec else None,
                             "seconds_max": _r(max(sec)) if sec else None, "samples": len(v)}
    live = [seen.live_b[p.version] - p.created_at / 1000 for p in manifests if p.version in seen.live_b and p.version > 0]
    live_d = [seen.live_b[p.version] - p.created_at / 1000 for p in manifests
              if p.version in seen.live_b and p.kind == WeightKind.DELTA]
    # versions that have a snapshot (beside the stream: live in B by their delta all the same)
    live_s = [seen.live_b[p.version] - p.created_at / 1000 for p in manifests
              if p.version in seen.live_b and p.version in seen.snapshots and p.version > 0]

    # Calibration or distribution? Each node's rate while it had a rollout running in the mixed
    # phase (its in-run speed, measured, not derived from its share) against its speed alone: a
    # node capped by a CPU quota runs at its calibrated speed whatever the load, while uncapped
    # ones could lose CPU to each other. The share against in-run speeds differs from it only by
    # the nodes' busy fractions (share = busy x speed / the sum), i.e. where the idle time fell.
    for n in nodes:
        busy = 1.0 - (n["idle"] or 0.0)
        n["busy_speed_rps"] = _r(n["mixed_rps"] / busy) if busy > 0 else None
        n["busy_speed_over_alone"] = _r(n["busy_speed_rps"] / n["alone_rps"]) if n["busy_speed_rps"] and n["alone_rps"] else None
    busy_total = sum(n["busy_speed_rps"] or 0.0 for n in nodes)
    rate_total = sum(n["mixed_rps"] for n in nodes) or 1.0
    for n in nodes:  # deviations from the unrounded shares
        bs = (n["busy_speed_rps"] or 0.0) / busy_total if busy_total else 0.0
        n["busy_speed_share"] = _r(bs) if busy_total else None
        n["share_dev_busy_speed"] = _r((n["mixed_rps"] / rate_total - bs) / bs) if bs else None
    # The nodes' capacity (their reported speeds together) against what the pipeline took: well
    # below it, the run is bound by the trainer (the curator issues at its pace, max-ahead counts
    # what waits downstream), some node must idle, and shares follow the placement, not speed.
    reported_total = sum(n["reported_speed_rps"] or 0.0 for n in nodes)
    for n in nodes:
        rs = (n["reported_speed_rps"] or 0.0) / reported_total if reported_total else 0.0
        n["reported_share"] = _r(rs) if reported_total else None
        n["share_dev_reported"] = _r((n["mixed_rps"] / rate_total - rs) / rs) if rs else None
    figs: dict[str, Any] = {
        "mixed_rollouts_per_s": _r(mixed_total / (t1 - t0)),
        "nodes_reported_speed_rollouts_per_s": _r(reported_total) if reported_total else None,
        "mixed_over_reported_speed": _r(mixed_total / (t1 - t0) / reported_total) if reported_total else None,
        "sum_alone_rollouts_per_s": _r(sum(alone.values())) if alone else None,  # None: --no-calibrate
        "weights_delta_bytes_mean": int(statistics.mean(deltas)) if deltas else None,
        "weights_snapshot_bytes_mean": int(statistics.mean(snaps)) if snaps else None,
        "delta_over_snapshot": _r(statistics.mean(deltas) / statistics.mean(snaps), 3) if deltas and snaps else None,
        "versions": len(manifests),
        "wan_bytes_to_b_total": down,
        "wan_bytes_from_b_total": up,
        "wan_bytes_to_b_per_version": int(down / n_versions),
        "weights_bytes_per_version": int(sum(p.payload_bytes for p in manifests) / max(1, len(manifests))),
        "snapshot_bytes_per_version_beside": int(sum(snaps) / max(1, len(manifests))),
        "weights_bytes_per_version_if_all_snapshots": int(statistics.mean(snaps)) if snaps else None,
        "region_b_version_lag_mean": _r(statistics.mean(lags)) if lags else None,
        "region_b_version_lag_max": max(lags) if lags else None,
        "versions_per_s_mixed": _r(version_rate),
        "version_lag_by_node": lag_by_node,
        "publish_to_live_b_s_median": _r(statistics.median(live)) if live else None,
        "publish_to_live_b_s_delta_median": _r(statistics.median(live_d)) if live_d else None,
        "publish_to_live_b_s_snapshot_median": _r(statistics.median(live_s)) if live_s else None,
    }
    base = mixed_total / (t1 - t0)
    all_times = sorted(ts for _, ts, _, _ in seen.rollouts)
    events = EVENTS[a.via]
    last_seen = max((ts for _, ts, _, _ in seen.rollouts), default=t1)
    for i, (what, node) in enumerate(events):  # those that ran (a run stopped by a deadline: not all)
        if f"join_{node}" not in m:
            continue
        t_ev, t_join = m[f"{what}_{node}"], m[f"join_{node}"]
        nxt = f"{events[i + 1][0]}_{events[i + 1][1]}" if i + 1 < len(events) else "elastic_end"
        end = m.get(nxt, last_seen)
        before = [v for n, ts, v in seen.inflight if n == node and ts <= t_ev]
        figs[f"{what}_{node}_inflight_before"] = before[-1] if before else None
        figs[f"{what}_{node}_longest_task_wait_s"] = _r(longest_task_wait(first_rollout, issued_at, t_ev), 1)
        firsts = [ts for n, ts, _, _ in seen.rollouts if n == node and ts > t_join]
        figs[f"join_{node}_first_rollout_s"] = _r(min(firsts) - t_join if firsts else None, 1)
        starts = [st for n, _, _, st in seen.started if n == node and st > t_join]
        figs[f"join_{node}_startup_s"] = startup_parts(run.node_log(node), t_join, min(starts) if starts else None,
                                                       min(firsts) if firsts else None)
        parts = figs[f"join_{node}_startup_s"]
        figs[f"join_{node}_ready_s"] = parts["ready"]  # process start -> it joins the tasks group, ready to serve
        if parts["ready"] is not None:  # group join -> the total rate back to 90% of the mixed phase's
            back, low = recovered_after(all_times, t_join + parts["ready"], end, base)
            figs[f"join_{node}_throughput_back_after_join_s"] = _r(back, 1)
            figs[f"join_{node}_lowest_rate_after_join"] = _r(low)
    if run.drain_end != "accounted":  # stopped before the end: read what the stopped roles left last
        with contextlib.suppress(Exception):
            run.ledger.refresh(timeout_s=10.0)
    tally = run.ledger.tally(list(run.ledger.tasks.values()))
    figs.update(tasks_issued=tally.tasks_issued, tasks_trained=tally.tasks_trained,
                **loss_figures(run.drain_end, tally.lost, open_tasks(run.ledger)),
                samples_dead_lettered=tally.accounted, samples_trained_twice=tally.trained_twice)
    return {"experiment": run.exp, "load_avg": " ".join(f"{x:.1f}" for x in os.getloadavg()),
            "wan": f"{2 * a.latency_ms} ms RTT, {a.rate_kb_s} KB/s per connection",
            "settings": {k: v for k, v in vars(a).items()}, "nodes": nodes, "figures": figs,
            "marks": {k: round(v - m.get("mixed_start", v), 1) for k, v in m.items()}}
