"""The fault harness's figures per phase, from the topics and the trained-sample log.

Besides `_ledger`'s counts (issued, trained, lost, trained twice, accounted for), per phase:

* **versions**: PolicyVersion manifests on the weights topic created in the phase; **version
  conflicts**: a version number whose manifest was published again with another
  `state_checksum` (two different weights under one number);
* **train-topic duplicates**: sample ids written twice to `<policy>.train` (`read_committed`),
  the second copy in the phase: duplicates curate let through, whether or not the trainer
  then trained them (its sample-id guard, where there is one, is a second line of defence);
* **largest version gap at the nodes**: every `policy_version` metric of a node (every 5 s)
  against the version of the newest manifest created before it;
* **recovery**: from the end of a fault (the killed role started again, the broker back) to the
  first output after it of the role that was killed (curator: a task; node: a trajectory of
  that node; reward: a scored trajectory; curate: a train sample; trainer: an optimizer step);
  for broker faults and rebalances, to the first trainer step. The worst of the phase. Each
  fault's `next_step_s` (to the first trainer step after it, whatever was killed) is in the JSON;
* **task wait** (node kills): the longest wait of a task after the kill, from the later of its
  issue and the kill to its first trajectory, over the tasks issued up to 30 s after the kill
  (a dead node's partitions wait for its group session to expire, `kafka.group_session_timeout_s`);
* **exits**: roles that exited on their own (the aim is none, a 5-minute outage included).

A lost sample is also located: the last topic it reached (rollouts, scored, train), so a loss
points at the hop that lost it; on `scored`, whether curate's consumer group had committed an
offset past it (read and lost inside curate) or not (never read: a partition that stopped).
"""

from __future__ import annotations

import bisect
from collections import Counter
from dataclasses import dataclass, field
from typing import Any

from _ledger import POLICY, Ledger, TopicReader, expected_samples, lineage, task_of

from astraflow.config import KafkaSettings
from astraflow.kafka.topics import Topics


@dataclass
class PhaseFigures:
    """One row of the report."""

    phase: str
    faults: list[dict[str, Any]]  # kind, target, start (s from run start), lasted_s, recovery_s, rollout_recovery_s
    tasks_issued: int
    tasks_trained: int
    lost: int
    trained_twice: int
    accounted: int  # not trained, with a reason (DLQ)
    train_topic_duplicates: int
    versions: int
    version_conflicts: int
    max_version_gap: int | None
    recovery_s: float | None  # worst over the phase's faults
    exits: list[dict[str, Any]]
    drained: bool
    seconds: float
    lost_ids: list[str] = field(default_factory=list)
    lost_at: dict[str, int] = field(default_factory=dict)  # last topic a lost sample reached -> count
    twice_ids: list[str] = field(default_factory=list)


@dataclass
class Report:
    """The whole run."""

    phases: list[PhaseFigures]
    totals: dict[str, Any]
    settings: dict[str, Any]
    dead_letter_reasons: dict[str, int]
    clean: bool  # 0 lost, trained twice, written twice to the train topic, version conflicts, exits


def _first_after(times: list[float], t: float) -> float | None:
    i = bisect.bisect_right(times, t)
    return times[i] - t if i < len(times) else None


def longest_task_wait(first_rollout: dict[str, float], issued_at: dict[str, float], kill_at: float,
                      window_s: float = 30.0) -> float | None:
    """Longest wait of a task after a node's kill: tasks issued before kill_at + window_s whose first
    trajectory (`first_rollout`: task id -> epoch s) came after the kill, from the later of their
    issue (`issued_at`) and the kill to that trajectory. Also used by bench/regions.py."""
    waits = [first - max(issued_at[tid], kill_at) for tid, first in first_rollout.items()
             if first > kill_at and issued_at.get(tid, float("inf")) < kill_at + window_s]
    return max(waits) if waits else None


def build_report(kafka: KafkaSettings, topics: Topics, ledger: Ledger, phases: list[Any], settings: dict[str, Any],
                 wall_s: float) -> Report:
    from astraflow.records import Metric, PolicyVersion, TrainSample, Trajectory

    def read(topic: str) -> list[tuple[Any, int]]:
        r = TopicReader(kafka, topic)
        try:
            return r.read(120)
        finally:
            r.close()

    manifests = sorted(((rec.created_at / 1000, rec) for rec, _ in read(topics.weights(POLICY))
                        if isinstance(rec, PolicyVersion)), key=lambda x: x[0])
    first_checksum: dict[int, str] = {}
    conflicts: list[float] = []
    for t, pv in manifests:
        if first_checksum.setdefault(pv.version, pv.state_checksum) != pv.state_checksum:
            conflicts.append(t)
    mtimes = [t for t, _ in manifests]
    step_times, node_versions = [], []
    for rec, _ in read(topics.metrics):
        if not isinstance(rec, Metric):
            continue
        if rec.component == "trainer" and "step" in rec.labels and "bucket" not in rec.labels:
            step_times.append(rec.ts / 1000)
        elif rec.component == "raas" and rec.name == "policy_version":
            node_versions.append((rec.ts / 1000, rec.value))
    step_times = sorted(set(step_times))
    rollouts = [(rec, ts) for rec, ts in read(topics.rollouts) if isinstance(rec, Trajectory)]
    rolled_ids = {f"{rec.trajectory_id}#{POLICY}" for rec, _ in rollouts}
    reader = TopicReader(kafka, topics.scored)
    try:
        scored_at = [(rec, ts, p, o) for rec, ts, p, o in reader.read_located(120) if isinstance(rec, Trajectory)]
    finally:
        reader.close()
    scored = [(rec, ts) for rec, ts, _, _ in scored_at]
    scored_where = {f"{rec.trajectory_id}#{POLICY}": (p, o) for rec, _, p, o in scored_at}
    scored_ids = set(scored_where)
    curate_read = committed_offsets(kafka, topics.group("curate"), topics.scored)
    train = sorted(((rec, ts) for rec, ts in read(topics.train(POLICY)) if isinstance(rec, TrainSample)), key=lambda x: x[1])
    train_seen: Counter[str] = Counter()
    train_dup_times: list[float] = []
    for rec, ts in train:
        train_seen[rec.sample_id] += 1
        if train_seen[rec.sample_id] == 2:
            train_dup_times.append(ts / 1000)
    # What each role writes, in time order: its recovery is its first output after the fault.
    outputs: dict[str, list[float]] = {
        "curator": sorted(t.ts_ms / 1000 for t in ledger.tasks.values()),
        "reward": sorted(ts / 1000 for _, ts in scored),
        "curate": sorted(ts / 1000 for _, ts in train),
        "trainer": step_times,
    }
    for rec, ts in rollouts:
        outputs.setdefault(rec.node.node_id, []).append(ts / 1000)
    for v in outputs.values():
        v.sort()
    first_rollout: dict[str, float] = {}  # task id -> its first trajectory (any node)
    for rec, ts in rollouts:
        first_rollout[rec.task_id] = min(ts / 1000, first_rollout.get(rec.task_id, float("inf")))
    issued_at = {t.task_id: t.ts_ms / 1000 for t in ledger.tasks.values()}

    def task_wait(kill_at: float) -> float | None:
        return longest_task_wait(first_rollout, issued_at, kill_at)

    def gap_in(t0: float, t1: float) -> int | None:
        gaps = []
        for t, v in node_versions:
            if t0 <= t < t1:
                i = bisect.bisect_right(mtimes, t) - 1
                if i >= 0:
                    gaps.append(max(0, int(manifests[i][1].version - v)))
        return max(gaps) if gaps else None

    trained_ids = ledger.trained_counts()
    run_start = phases[0].start if phases else 0.0
    rows: list[PhaseFigures] = []
    for k, ph in enumerate(phases):
        t0, t1 = ph.start, (phases[k + 1].start if k + 1 < len(phases) else float("inf"))
        mine = [t for t in ledger.tasks.values() if t0 <= t.ts_ms / 1000 < t1 or (k == 0 and t.ts_ms / 1000 < t0)]
        tally = ledger.tally(mine, ph.log_lines)
        lost_at: Counter[str] = Counter()
        for t in mine:
            for sid in expected_samples(t.task_id, t.n_samples):
                if sid in trained_ids or sid in ledger.accounted:
                    continue
                if sid in scored_ids and not train_seen[sid]:  # did curate read it (its group's offset is past it)?
                    p, o = scored_where[sid]
                    lost_at["scored, read by curate" if curate_read.get(p, -1) > o else "scored, not read by curate"] += 1
                    continue
                lost_at["train topic" if train_seen[sid] else "rollouts" if sid in rolled_ids else "tasks"] += 1
        faults = []
        for ev in ph.faults:
            role_out = outputs.get(ev.target.removesuffix("-2"), step_times) if ev.kind == "kill" else step_times
            faults.append({"kind": ev.kind, "target": ev.target, "start_s": round(ev.start - run_start, 1),
                           "lasted_s": round(ev.end - ev.start, 1),
                           "recovery_s": _round(_first_after(role_out, ev.end)),
                           "next_step_s": _round(_first_after(step_times, ev.end)),
                           **({"task_wait_s": _round(task_wait(ev.start))} if ev.target.startswith("raas-") else {})})
        recoveries = [f["recovery_s"] for f in faults if f["recovery_s"] is not None]
        rows.append(PhaseFigures(
            phase=ph.name, faults=faults, tasks_issued=tally.tasks_issued, tasks_trained=tally.tasks_trained,
            lost=tally.lost, trained_twice=tally.trained_twice, accounted=tally.accounted,
            train_topic_duplicates=sum(t0 <= t < t1 for t in train_dup_times),
            versions=sum(t0 <= t < t1 for t in mtimes), version_conflicts=sum(t0 <= t < t1 for t in conflicts),
            max_version_gap=gap_in(t0, t1), recovery_s=max(recoveries) if recoveries else None,
            exits=[{**e, "at": round(e["at"] - run_start, 1)} for e in ph.exits], drained=ph.drained,
            seconds=round(ph.end - ph.start, 1), lost_ids=tally.lost_ids, lost_at=dict(lost_at),
            twice_ids=tally.twice_ids))
    whole = ledger.tally(ledger.tasks.values())
    issued_ids = set(ledger.tasks)
    totals = {
        "tasks_issued": whole.tasks_issued, "tasks_trained": whole.tasks_trained, "samples_expected": whole.samples_expected,
        "samples_trained": whole.samples_trained, "lost": whole.lost, "trained_twice": whole.trained_twice,
        "accounted": whole.accounted, "train_topic_duplicates": len(train_dup_times),
        "trained_never_issued": sum(1 for sid in trained_ids if task_of(sid) not in issued_ids),
        "tasks_written_twice": ledger.duplicate_tasks, "versions": len({pv.version for _, pv in manifests}),
        "manifests": len(manifests), "version_conflicts": len(conflicts), "trainer_steps_logged": len(ledger.steps), "trainer_runs": len({s.run for s in ledger.steps}),
        "steps_discarded": len(ledger.steps) - len(lineage(ledger.steps)),  # re-trained after a trainer restart
        "torn_log_lines": ledger.torn_lines, "unattributed_dead_letters": len(ledger.unattributed_dead_letters),
        "wall_s": round(wall_s, 1),
    }
    reasons = Counter(ledger.accounted.values()) + Counter(ledger.unattributed_dead_letters)
    clean = (whole.lost == 0 and whole.trained_twice == 0 and not train_dup_times and not conflicts
             and totals["trained_never_issued"] == 0 and not any(r.exits for r in rows))
    return Report(rows, totals, settings, dict(reasons.most_common(20)), clean)


def committed_offsets(kafka: KafkaSettings, group: str, topic: str) -> dict[int, int]:
    """Partition -> the consumer group's committed offset on `topic` (partitions it never committed are absent)."""
    from confluent_kafka import TopicPartition

    from astraflow.kafka.clients import reader

    c = reader(kafka, group, log_level=2)
    try:
        parts = sorted(c.list_topics(topic, timeout=30).topics[topic].partitions)
        return {tp.partition: tp.offset for tp in c.committed([TopicPartition(topic, p) for p in parts], timeout=30)
                if tp.offset >= 0}
    finally:
        c.close()


def _round(x: float | None) -> float | None:
    return None if x is None else round(x, 1)


def _fmt(x: Any) -> str:
    return "-" if x is None else f"{x:.0f}" if isinstance(x, float) else str(x)


def print_report(report: Report) -> None:
    cols = ("phase", "faults", "issued", "trained", "lost", "twice", "dlq", "dup@train", "versions", "v-conflicts",
            "max gap", "recovery s", "exits")
    rows = [(r.phase, len(r.faults), r.tasks_issued, r.tasks_trained, r.lost, r.trained_twice, r.accounted,
             r.train_topic_duplicates, r.versions, r.version_conflicts, r.max_version_gap, r.recovery_s, len(r.exits))
            for r in report.phases]
    t = report.totals
    rows.append(("total", sum(len(r.faults) for r in report.phases), t["tasks_issued"], t["tasks_trained"], t["lost"],
                 t["trained_twice"], t["accounted"], t["train_topic_duplicates"], t["versions"], t["version_conflicts"],
                 None, None, sum(len(r.exits) for r in report.phases)))
    cells = [[_fmt(v) for v in row] for row in rows]
    widths = [max(len(c), *(len(row[i]) for row in cells)) for i, c in enumerate(cols)]
    print("  ".join(c.rjust(w) if i else c.ljust(w) for i, (c, w) in enumerate(zip(cols, widths, strict=True))))
    for row in cells:
        print("  ".join(c.rjust(w) if i else c.ljust(w) for i, (c, w) in enumerate(zip(row, widths, strict=True))))
    for r in report.phases:
        if r.lost or r.trained_twice or r.exits or not r.drained:
            print(f"{r.phase}: lost {r.lost} (last topic reached: {r.lost_at}) e.g. {r.lost_ids[:3]}; "
                  f"twice {r.trained_twice} e.g. {r.twice_ids[:3]}; drained {r.drained}")
            for e in r.exits:
                print(f"  {e['role']} exited with code {e['code']} at {e['at']}s; log tail:\n    "
                      + "\n    ".join(e["log"].splitlines()[-5:]))
    waits = [f"{f['target']} {f['task_wait_s']:.1f}s" for r in report.phases for f in r.faults
             if f.get("task_wait_s") is not None]
    if waits:
        print("longest task wait after a node's kill -9:", "; ".join(waits))
    if report.dead_letter_reasons:
        print("dead letters:", report.dead_letter_reasons)
    print(f"trained but never issued: {t['trained_never_issued']}; tasks written twice: {t['tasks_written_twice']}; "
          f"torn trained-log lines: {t['torn_log_lines']}; wall {t['wall_s']:.0f}s")
    print("CLEAN: 0 lost, 0 trained twice, 0 written twice to the train topic, no version conflict, no role exited"
          if report.clean else "NOT CLEAN (see above)")

