"""The real two-policy pipeline as a benchmark subject (`bench/multi_policy.py --modes pipeline`).

The `solver-verifier` demo's roles as separate processes on Kafka, on topics of their own: a
curator issuing `solver_verifier` tasks for both policies (`--max-ahead` = 8 x (1 + staleness)
prompts), the reward app (`solver_verifier`, the same bonus as the in-process runs), curate
writing each policy's samples to its own train topic, one `astraflow train` per policy
(batches of exactly 64 samples, lr 3e-4, fp32 weights) and one RaaS node serving both policies
(64 rollouts in flight, the calculator behind `--tool-latency`). Nothing is simulated: tasks,
trajectories, scored trajectories, train samples and both policies' weights go through Kafka,
in Avro. Curate's zero-variance and length filters are off, as in `bench/_pipeline.py`, so every
group is trained and a step costs the same 64 rollouts as in the in-process schedules, except
what a per-policy staleness limit drops (`max_staleness`, curate's `filter.staleness@<policy>`:
a sample whose oldest trained token is more than that many versions behind the policy's trainer
when curate sees it is not trained; the policy's trainer then waits for more groups).

The clock starts at the first task's Kafka timestamp and stops when both policies' weights of
version `steps` have reached the benchmark's followers; snapshots of each policy every
`eval_every` versions (a cheap copy of the followed weights, timed when the follower has them)
are scored after the run, as the in-process runs' are. A policy's snapshots stop at version
`steps`. The trainers' metrics logs give each step's staleness (versions behind of its samples).
"""

from __future__ import annotations

import csv
import json
import os
import tempfile
import time
import uuid
from pathlib import Path
from typing import Any

import _mp_timeline
import _pipeline
import _rl
import torch
from _stale_drops import stale_dropped
from confluent_kafka import Consumer, TopicPartition
from confluent_kafka.admin import AdminClient

from astraflow.config import load_config
from astraflow.demo.common import PY, curate_role, role_env
from astraflow.demo.supervisor import Role, Supervisor
from astraflow.kafka.clients import reader
from astraflow.kafka.topics import TopicAdmin, Topics
from astraflow.records import Task
from astraflow.weights.follow import KafkaWeightFollower


def _roles(exp: str, policies: tuple[str, ...], models: dict[str, str], dataset: Path, run_dir: Path, *,
           staleness: int, sigma: float, median_s: float, seed: int, bonus: float, env: dict[str, str],
           trainer_loss: dict[str, dict[str, Any]] | None = None, staleness_check: bool = True) -> list[Role]:
    ahead = _rl.PROMPTS_PER_STEP * (1 + staleness)
    out = [
        Role("curator", [*PY, "app", "run", "curator", "-e", exp, *(a for p in policies for a in ("--policy", p)),
                         "--dataset", str(dataset), "--workflow", "solver_verifier", "--n-samples", str(_rl.GROUP),
                         "--max-ahead", str(ahead), "--temperature", "1.0", "--max-tokens", "24", "--max-turns", "2"], env),
        Role("reward", [*PY, "app", "run", "reward", "-e", exp, "--default",
                        f"reward=solver_verifier:{json.dumps({'bonus': bonus})}"], env),
        curate_role(exp, policies, env),
    ]
    for p in policies:
        sets = [f"run_dir={run_dir / p}", f"trainer.lr={_rl.LR}", f"trainer.batch_size={_rl.SLOTS}",
                "trainer.max_wait_s=600", "trainer.progress_bar=false", "trainer.publish_dtype=float32",
                *loss_sets((trainer_loss or {}).get(p, {})), *(() if staleness_check else ("trainer.max_staleness=null",))]
        out.append(Role(f"trainer-{p}", [*PY, "train", "-e", exp, "-p", p, "-m", models[p],
                                         *[a for kv in sets for a in ("--set", kv)]], env))
    served = [a for p in policies for a in ("-p", f"{p}={models[p]}")]
    out.append(Role("raas-1", [*PY, "raas", "serve", "-e", exp, *served, "--max-inflight", str(_rl.SLOTS),
                               "--max-batch", str(_rl.SLOTS), "--prefetch", str(ahead), "--threads", "1",
                               "--seed", str(seed), "--node-id", "raas-1", "--tool-latency", f"calc={median_s}:{sigma}"],
                    env))
    return out


def _cpu_s(sessions: list[int]) -> float:
    """User + system CPU seconds so far of every live process in these sessions (each role is a
    session of its own, so its children, like the node's engine process, count too)."""
    total, tick = 0.0, os.sysconf("SC_CLK_TCK")
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
            if int(fields[3]) in sessions:
                total += (int(fields[11]) + int(fields[12])) / tick
        except (OSError, IndexError, ValueError):
            pass
    return total


@_pipeline.interrupt_on_sigterm()
def run_pair_pipeline(policies: tuple[str, ...], models: dict[str, str], tasks: list[Task], *, steps: int,
                      eval_every: int, staleness: int, sigma: float, median_s: float, seed: int, bonus: float,
                      max_staleness: dict[str, int] | None = None, trainer_loss: dict[str, dict[str, Any]] | None = None,
                      staleness_filters: bool = True, timeout_s: float = 1800.0) -> dict[str, Any]:
    """One pipeline run. Returns wall_s, cpu_s (every role process during the run), trajectories,
    per policy the weight snapshots [(version, t, state)] including version 0, and `groups`
    (`group_diagnostics`). `max_staleness`: policy -> curate's staleness limit for it;
    `trainer_loss`: policy -> fields of its trainer's `trainer.loss` (`loss_sets`);
    `staleness_filters=False`: curate's `filter.staleness` off and the trainers' staleness check
    off (`trainer.max_staleness=null`), so no sample is dropped for its staleness, as in the
    in-process schedules."""
    if max_staleness and not staleness_filters:
        raise ValueError("per-policy staleness limits need curate's staleness filter: drop one of the two")
    cfg = load_config()
    exp = f"bench-pair-{uuid.uuid4().hex[:8]}"
    run_dir = Path(tempfile.gettempdir()) / "astraflow-bench" / exp
    run_dir.mkdir(parents=True, exist_ok=True)
    off = ("filter.zero_variance", "filter.length", *(() if staleness_filters else ("filter.staleness",)))
    specs, control = _pipeline.create_experiment(cfg, exp, filters_off=off, policies=policies)
    for slot, strategy, params in staleness_controls(max_staleness or {}):
        control.set("curate", slot, strategy, params, issued_by="bench")
    admin_t = TopicAdmin(cfg.kafka)
    topics = Topics(exp)
    sup = Supervisor(run_dir / "logs")
    followers = {p: KafkaWeightFollower(cfg.kafka, exp, p, request_snapshots=False, requester="bench") for p in policies}
    probe = reader(cfg.kafka, f"{exp}-probe")
    snapshots: dict[str, list[tuple[int, float, dict[str, torch.Tensor]]]] = {p: [] for p in policies}
    try:
        started_at = time.time()
        for role in _roles(exp, policies, models, _pipeline.write_dataset(tasks, run_dir / "train.jsonl"), run_dir,
                           staleness=staleness, sigma=sigma, median_s=median_s, seed=seed, bonus=bonus,
                           env=role_env(cfg.kafka.bootstrap_servers), trainer_loss=trainer_loss,
                           staleness_check=staleness_filters):
            sup.start(role)
        admin = AdminClient(cfg.kafka.client_config())
        for p in policies:  # every group has a member and each trainer has published its version 0
            _pipeline.wait_ready(admin, [topics.raas_group, topics.group("reward"), topics.group("curate")], probe,
                                 topics.weights(p), sup, _pipeline.READY_TIMEOUT_S)
        ready_at = time.time()
        for f in followers.values():
            f.start()
        pids = [r.proc.pid for r in sup.roles if r.proc is not None]
        names = {r.proc.pid: r.name for r in sup.roles if r.proc is not None}
        by_role0 = {names[pid]: _cpu_s([pid]) for pid in pids}
        cpu0, load0 = _cpu_s(pids), os.getloadavg()[0]
        resumed_at = time.time()
        control.set("curator", "pause", "off", issued_by="bench")
        marks = {p: eval_every for p in policies}
        deadline = time.monotonic() + timeout_s
        while True:
            for p, f in followers.items():
                f.poll(timeout_s=0.1)
                version = f.follower.version or 0
                if snapshots[p] and snapshots[p][-1][0] >= steps:
                    continue  # this policy's run is over; the other's may go on
                if version >= min(marks[p], steps) and (not snapshots[p] or snapshots[p][-1][0] < version):
                    snapshots[p].append((version, time.time(), {k: v.detach().clone().float()
                                                                 for k, v in f.follower.state.items()}))
                    marks[p] = (version // eval_every + 1) * eval_every
            if all(s and s[-1][0] >= steps for s in snapshots.values()):
                rolled_out = _pipeline._end_offsets(probe, topics.rollouts, cfg.topics.partitions)
                cpu1, load1 = _cpu_s(pids), os.getloadavg()[0]
                by_role = {names[pid]: round(_cpu_s([pid]) - by_role0[names[pid]], 2) for pid in pids}
                break
            sup.check()
            if time.monotonic() > deadline:
                raise TimeoutError(f"both policies' version {steps} not published within {timeout_s:.0f}s; logs in "
                                   f"{run_dir / 'logs'}")
        t0 = _pipeline._first_timestamp_s(probe, topics.tasks, cfg.topics.partitions)
        assert t0 is not None, "no task was issued"
        wall = max(s[-1][1] for s in snapshots.values()) - t0
        result = {"wall_s": wall, "cpu_s": cpu1 - cpu0, "cpu_s_by_role": by_role, "load": (round(load0, 2), round(load1, 2)),
                  "trajectories": rolled_out, "logs": str(run_dir / "logs"),
                  "snapshots": {p: [(v, t - t0, st) for v, t, st in s] for p, s in snapshots.items()}}
        stamps = {t: _stamps(probe, t, cfg.topics.partitions)
                  for t in (topics.tasks, topics.rollouts, topics.scored, *(topics.train(p) for p in policies))}
        trajectories = _records(probe, topics.rollouts, cfg.topics.partitions)
        result["groups"] = group_diagnostics(
            trajectories,
            {p: _records(probe, topics.train(p), cfg.topics.partitions) for p in policies},
            {p: _trained_log(run_dir / p) for p in policies}, steps, t0, _rl.TOOL_TIMEOUT_S)
        result["stale_drops"] = stale_dropped(_records(probe, topics.lineage, 1), trajectories)  # read after them
        by_step = {p: _step_metrics(probe, topics.metrics, p) for p in policies}
        result["first_version"] = {
            p: _first_version_hops(run_dir / p, stamps[topics.tasks], stamps[topics.rollouts], stamps[topics.scored],
                                   stamps[topics.train(p)], _first_step_metric(by_step[p]),
                                   next((t for v, t, _ in snapshots[p] if v >= 1), None), t0)
            for p in policies}
        spans, per_rollout = _mp_timeline.rollout_times(trajectories, t0)
        result["timeline"] = {
            "before_t0": {"roles_started": round(started_at - t0, 3), "roles_ready": round(ready_at - t0, 3),
                          "curator_resumed": round(resumed_at - t0, 3)},
            "node": {"occupancy": _mp_timeline.node_occupancy(spans, wall, _rl.SLOTS), "per_rollout": per_rollout},
            "steps": {p: _mp_timeline.pipeline_steps(result["groups"][p]["groups"],
                                                     _mp_timeline.steps_from_metrics(by_step[p], t0),
                                                     [(v, t) for v, t, _ in result["snapshots"][p]])
                      for p in policies}}
    finally:
        sup.stop_all()
        for f in followers.values():
            f.close()
        probe.close()
        admin_t.delete([s.name for s in specs])
    # the trainers have written their logs
    result["staleness"] = {p: _staleness(run_dir / p, steps) for p in policies}
    result["stale_dropped"] = {p: _staleness(run_dir / p, steps, "train/stale_dropped_frac") for p in policies}
    return result


def loss_sets(fields: dict[str, Any]) -> list[str]:
    """A trainer's `--set` overrides of its loss: `trainer.loss.<field>=<value>` (None as `null`)."""
    return [f"trainer.loss.{k}={'null' if v is None else v}" for k, v in sorted(fields.items())]


def staleness_controls(max_staleness: dict[str, int]) -> list[tuple[str, str, dict[str, str]]]:
    """Curate's control settings for per-policy staleness limits: (slot, strategy, params)."""
    return [(f"filter.staleness@{p}", "staleness", {"max_staleness": str(int(k))}) for p, k in sorted(max_staleness.items())]


def _stamps(consumer: Consumer, topic: str, partitions: int) -> dict[tuple[int, int], tuple[str, float]]:
    """(partition, offset) -> (key, Kafka timestamp in s) of every record a read_committed reader gets."""
    from astraflow.kafka.clients import watermarks

    out: dict[tuple[int, int], tuple[str, float]] = {}
    for p in range(partitions):
        low, high = watermarks(consumer, topic, p)
        if high <= low:
            continue
        consumer.assign([TopicPartition(topic, p, low)])
        while True:
            msg = consumer.poll(2.0)
            if msg is None:
                break
            if msg.error() is None:
                out[(p, msg.offset())] = ((msg.key() or b"").decode(), msg.timestamp()[1] / 1000)
                if msg.offset() >= high - 1:
                    break
    return out


def _records(consumer: Consumer, topic: str, partitions: int) -> list[Any]:
    """Every record a read_committed reader gets from `topic`, decoded."""
    from astraflow.kafka.clients import watermarks
    from astraflow.serde import AvroSerde

    serde, out = AvroSerde(), []
    for p in range(partitions):
        low, high = watermarks(consumer, topic, p)
        if high <= low:
            continue
        consumer.assign([TopicPartition(topic, p, low)])
        while (msg := consumer.poll(2.0)) is not None:
            if msg.error() is None:
                out.append(serde.loads(msg.value()))
                if msg.offset() >= high - 1:
                    break
    return out


def _trained_log(trainer_dir: Path) -> dict[str, int]:
    """sample_id -> the optimizer step that trained it, from the trainer's `trained-samples.jsonl`."""
    out: dict[str, int] = {}
    for path in trainer_dir.glob("**/trained-samples.jsonl"):
        for line in path.read_text().splitlines():
            row = json.loads(line)
            out.setdefault(row["sample_id"], int(row["step"]))
    return out


CALL_BUCKETS = ((0.0, "<1s"), (1.0, "1-5s"), (5.0, "5-10s"))  # a group's slowest tool call; cut calls apart
STALE_BUCKETS = ("0", "1", "2", "3", "4+")


def group_diagnostics(trajectories: list[Any], samples: dict[str, list[Any]], trained: dict[str, dict[str, int]],
                      steps: int, t0: float, timeout_s: float) -> dict[str, Any]:
    """Per policy, for the samples its first `steps` optimizer steps trained: how stale each group
    was against its slowest tool call, and the policy's reward per staleness.

    `trajectories`: the rollouts (Trajectory); `samples[p]`: p's train topic (TrainSample);
    `trained[p]`: sample_id -> step (step k trains at version k - 1, so a sample's staleness is
    k - 1 - its `min_version`, the trainer's own definition). A group's slowest call is the
    longest tool call of its trajectories (0 without any); a call at the node's timeout (or with
    an error saying so) counts as cut. Also: when each group's last trajectory ended (s from t0),
    and the mean issue order of the groups each step trained (task ids end in their issue number)
    against the step's own place, to show groups trained out of order."""
    slowest: dict[str, float] = {}
    cut: dict[str, bool] = {}
    ended: dict[str, float] = {}
    for t in trajectories:
        calls = [c.latency_s for c in t.tool_calls]
        slowest[t.group_id] = max([slowest.get(t.group_id, 0.0), *calls])
        cut[t.group_id] = cut.get(t.group_id, False) or any(
            c.latency_s >= timeout_s - 0.05 or "timed out" in (c.error or "") for c in t.tool_calls)
        ended[t.group_id] = max(ended.get(t.group_id, 0.0), t.timings.finished_at / 1000 - t0)

    def bucket(g: str) -> str:
        if cut.get(g):
            return "cut"
        return next(name for lo, name in reversed(CALL_BUCKETS) if slowest.get(g, 0.0) >= lo)

    out: dict[str, Any] = {}
    for p, recs in samples.items():
        groups: dict[str, dict[str, list[float]]] = {}
        by_stale: dict[str, list[float]] = {b: [] for b in STALE_BUCKETS}
        for s in recs:
            step = trained[p].get(s.sample_id)
            if step is None or step > steps:
                continue
            lag = max(0, step - 1 - int(s.min_version))
            by_stale[STALE_BUCKETS[min(lag, 4)]].append(float(s.reward))
            g = groups.setdefault(s.group_id, {"lag": [], "reward": [], "step": []})
            g["lag"].append(lag)
            g["reward"].append(float(s.reward))
            g["step"].append(step)
        by_call: dict[str, dict[str, list[float]]] = {}
        rows = []
        for gid, g in groups.items():
            lag, reward = sum(g["lag"]) / len(g["lag"]), sum(g["reward"]) / len(g["reward"])
            b = by_call.setdefault(bucket(gid), {"lag": [], "reward": []})
            b["lag"].append(lag)
            b["reward"].append(reward)
            issued = gid.rsplit("-", 1)[-1]
            rows.append({"group": gid, "issued": int(issued) if issued.isdigit() else None, "step": min(g["step"]),
                         "slowest_call_s": round(slowest.get(gid, 0.0), 3), "cut": cut.get(gid, False),
                         "ended_s": round(ended[gid], 3) if gid in ended else None,
                         "staleness": round(lag, 3), "reward": round(reward, 4)})

        def mean(xs: list[float]) -> float | None:
            return round(sum(xs) / len(xs), 4) if xs else None

        out[p] = {
            "by_slowest_call": {k: {"groups": len(v["lag"]), "staleness": mean(v["lag"]), "reward": mean(v["reward"])}
                                for k, v in sorted(by_call.items(), key=lambda kv: [*(n for _, n in CALL_BUCKETS), "cut"].index(kv[0]))},
            "by_staleness": {k: {"samples": len(v), "reward": mean(v)} for k, v in by_stale.items()},
            "on_train_topic": len(recs),  # curate's output for this policy, trained in `steps` or not
            "groups": sorted(rows, key=lambda r: (r["step"], r["issued"] if r["issued"] is not None else -1)),
        }
    return out


def _step_metrics(consumer: Consumer, topic: str, policy: str) -> dict[int, dict[str, float]]:
    """The policy's trainer steps from the metrics topic: step -> `ts` (when it logged the step, in
    s; it logs after publishing) and its per-step metrics by name (`step_s`, `publish_s`, ...)."""
    from astraflow.kafka.clients import watermarks
    from astraflow.records import Metric
    from astraflow.serde import AvroSerde

    serde, by_step = AvroSerde(), {}
    low, high = watermarks(consumer, topic, 0)
    consumer.assign([TopicPartition(topic, 0, low)])
    while high > low and (msg := consumer.poll(2.0)) is not None:
        if msg.error() is None:
            rec = serde.loads(msg.value())
            if isinstance(rec, Metric) and rec.labels.get("policy") == policy and "step" in rec.labels:
                got = by_step.setdefault(int(rec.labels["step"]), {"ts": rec.ts / 1000})
                got[rec.name.removeprefix("trainer.")] = rec.value
            if msg.offset() >= high - 1:
                break
    return by_step


def _first_step_metric(by_step: dict[int, dict[str, float]]) -> tuple[float, float, float] | None:
    """The trainer's first step (`_step_metrics`): (time it logged it, `step_s`, `publish_s`).
    It logs after publishing; `publish_s` is the checkpoint and the publication of that version."""
    first = by_step.get(min(by_step)) if by_step else None
    if first is None or "step_s" not in first:
        return None
    return first["ts"], first["step_s"], first.get("publish_s", 0.0)


def _first_version_hops(trainer_dir: Path, tasks: dict, rollouts: dict, scored: dict, train: dict,
                        step: tuple[float, float, float] | None, followed: float | None, t0: float) -> dict[str, float]:
    """Seconds from the first task to each hop of a policy's first version, for the groups its
    first step trained (from its `trained-samples.jsonl`): the last of their tasks issued, the
    last of their trajectories produced (node), scored (reward), of their samples written
    (curate, what the trainer took), the trainer's step begun and ended, the version
    checkpointed and published, and at the benchmark's follower. A record's timestamp is when it was produced;
    a transaction's records become readable when it commits, which the next hop includes."""
    taken: list[tuple[int, int]] = []
    for path in trainer_dir.glob("**/trained-samples.jsonl"):
        for line in path.read_text().splitlines():
            row = json.loads(line)
            if row.get("step") == 1:
                taken.append((row["partition"], row["offset"]))
    groups = {train[k][0] for k in taken if k in train}
    if not groups:
        return {}

    def last(stamps: dict) -> float:
        return max((ts for key, ts in stamps.values() if key in groups), default=float("nan")) - t0

    out = {"first_rollout": min(ts for _, ts in rollouts.values()) - t0, "tasks": last(tasks),
           "rolled_out": last(rollouts), "scored": last(scored),
           "curated": max(train[k][1] for k in taken if k in train) - t0}
    if step is not None:
        logged, step_s, publish_s = step
        out["step_began"], out["step_ended"] = logged - publish_s - step_s - t0, logged - publish_s - t0
        out["published"] = logged - t0
    if followed is not None:
        out["followed"] = followed - t0
    return {k: round(v, 3) for k, v in out.items()}


def _staleness(trainer_dir: Path, steps: int, column: str = "train/staleness_mean") -> list[float]:
    """Per optimizer step below version `steps`: the mean versions behind of its samples, from the
    trainer's metrics log (`train/staleness_mean`, the same definition as `_rl.Learner`'s), or
    another column of it (`train/stale_dropped_frac`: the share of its tokens the loss's
    max_staleness zeroed, logged only when set)."""
    out: dict[int, float] = {}
    for path in trainer_dir.glob("**/metrics.csv"):
        with path.open(newline="") as fh:
            for row in csv.DictReader(fh):
                if row.get("train/policy_version") and row.get(column):
                    version = int(float(row["train/policy_version"]))
                    if version < steps:
                        out[version] = float(row[column])
    return [out[v] for v in sorted(out)]
