"""Counted crash test of the stream apps' exactly-once: kill -9 workers while they run, then count.

    python -m bench.exactly_once --app curate [--kills 3] [--guarantee at_least_once] [--json out.json]
    python -m bench.exactly_once --app reward

A fixed input trickles into the app's source topic (~25 s) while workers run as separate
processes (`astraflow app run APP`, exactly as operators start them): one worker is `kill -9`ed
`--kills` times at random moments while it handles records (each time restarted at once), and
a second worker joins after the first kill, so partitions also move by rebalance. When the output has been stable for a while,
it is read `read_committed` (what the trainer reads) and counted:

* curate: complete groups of 4 (rewards 1,0,1,0), partial groups of 2 (emitted whole after the
  group timeout, min size 2), partial groups of 1 (dropped as incomplete), and redelivered
  trajectories (the same trajectory_id again, before and after its group left). Expected: one
  train sample per member of the complete and 2-member groups, each sample_id once, and every
  group whole (all its samples, or none).
* reward: trajectories, some sent twice; every record of the input is scored exactly once
  (a trajectory sent twice is scored twice, no more).

Controls that prove the count can fail: the same topic read `read_uncommitted` shows the
aborted records of the transactions the kills interrupted, and a run with `--guarantee
at_least_once` shows duplicates (reward) where exactly-once shows none.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import signal
import subprocess
import sys
import threading
import time
import uuid
from collections import Counter
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]


@dataclass
class CrashReport:
    """What one crash run produced, counted."""

    app: str
    guarantee: str
    kills: int  # kill -9 actually delivered to a live worker
    rebalances: int  # workers started while another ran (joins) + restarts after kills
    input_records: int  # records produced to the source topic (duplicates included)
    expected: int  # distinct outputs expected
    committed: int  # outputs read read_committed
    distinct: int  # distinct output ids among them
    duplicates: int  # committed outputs beyond the first of their id
    missing: int  # expected ids never read
    unexpected: int  # ids read that were not expected
    split_groups: int  # curate: groups with some but not all of their samples
    uncommitted_extra: int  # records of the output (and curate's changelogs) seen read_uncommitted only: aborted
    seconds: float  # wall time of the run
    missing_groups: list[str] = field(default_factory=list)  # groups with a missing sample (first 10)
    worker_logs: list[str] = field(default_factory=list)  # where the workers' logs are

    @property
    def exact(self) -> bool:
        return self.duplicates == 0 and self.missing == 0 and self.unexpected == 0 and self.split_groups == 0


def _traj(group: str, i: int, size: int, reward: float | None, seed: int) -> Any:
    from astraflow.testing import make_trajectory

    t = make_trajectory(128, task_id=group, sample_index=i, group_size=size, seed=seed, reward=reward)
    t.group_id, t.prompt_id = group, f"p-{group}"
    t.final_answer = "4" if i % 2 == 0 else "5"
    return t


def curate_input(run: str, rng: random.Random) -> tuple[list[Any], dict[str, int]]:
    """(records in send order, expected samples per group) for curate.

    Partial groups come first (they time out while the run goes on); a complete group's members
    are sent close together (shuffled among a few neighbours), so only a stall longer than the
    group timeout could split one. Redelivered copies go anywhere after their original.
    """
    partial, expected = [], {}
    for g in range(8):
        name = f"{run}-half-{g}"
        partial += [_traj(name, i, 4, 1.0 if i % 2 == 0 else 0.0, 1000 + g * 10 + i) for i in range(2)]
        expected[name] = 2
    for g in range(4):
        name = f"{run}-lone-{g}"
        partial.append(_traj(name, 0, 4, 1.0, 2000 + g))
        expected[name] = 0
    full = []
    for g in range(48):
        name = f"{run}-full-{g}"
        full += [_traj(name, i, 4, 1.0 if i % 2 == 0 else 0.0, g * 10 + i) for i in range(4)]
        expected[name] = 4
    for start in range(0, len(full), 12):  # three groups at a time, interleaved
        block = full[start:start + 12]
        rng.shuffle(block)
        full[start:start + 12] = block
    records = partial + full
    for t in rng.sample(records, 16):  # redelivered: the same trajectory_id again, later
        records.insert(rng.randrange(records.index(t) + 1, len(records) + 1), t)
    return records, expected


def reward_input(run: str, rng: random.Random) -> list[Any]:
    records = [_traj(f"{run}-r-{g}", i, 4, None, g * 10 + i) for g in range(60) for i in range(4)]
    rng.shuffle(records)
    for t in rng.sample(records, 16):
        records.insert(rng.randrange(len(records) + 1), t)
    return records


def _read(kafka: Any, topic: str | list[str], isolation: str, quiet_s: float, deadline: float, want: int,
          decode: bool = True) -> list[Any]:
    """Every record of `topic` (decoded) until nothing new came for `quiet_s` after `want` were read."""
    from confluent_kafka import Consumer

    from astraflow.serde import AvroSerde

    serde = AvroSerde()
    c = Consumer({**kafka.client_config(), "group.id": f"count-{uuid.uuid4().hex}", "auto.offset.reset": "earliest",
                  "enable.auto.commit": False, "isolation.level": isolation})
    c.subscribe([topic] if isinstance(topic, str) else topic)
    out: list[Any] = []
    last = time.monotonic()
    try:
        while time.monotonic() < deadline:
            msgs = c.consume(500, 0.5)
            got = [m for m in msgs if m.error() is None]
            out += [serde.loads(m.value()) if decode else m.offset() for m in got]
            if got:
                last = time.monotonic()
            elif len(out) >= want and time.monotonic() - last >= quiet_s:
                break
    finally:
        c.close()
    return out


def _feed(producer: Any, topic: str, records: list[Any], seconds: float) -> None:
    """Produces `records` evenly over `seconds`."""
    pause = seconds / max(1, len(records))
    for t in records:
        producer.send(topic, t, key=t.group_id)
        producer.poll(0)
        time.sleep(pause)
    producer.flush()


class Workers:
    """Worker processes of one app (separate processes, so kill -9 is real)."""

    def __init__(self, app: str, experiment: str, args: list[str], logs: Path) -> None:
        self.app, self.experiment, self.args, self.logs = app, experiment, args, logs
        self.procs: dict[str, subprocess.Popen[bytes]] = {}
        self.started = 0
        self.started_as: dict[str, int] = {}

    def start(self, name: str) -> None:
        from stream_apps.launch import app_command

        self.started += 1
        self.started_as[name] = self.started
        log = open(self.logs / f"{name}-{self.started}.log", "wb")  # noqa: SIM115 - closed with the process
        env = {**os.environ, "PYTHONPATH": f"{ROOT}{os.pathsep}{os.environ.get('PYTHONPATH', '')}"}
        self.procs[name] = subprocess.Popen(app_command(self.app, self.experiment, *self.args), stdout=log,
                                            stderr=subprocess.STDOUT, env=env, cwd=ROOT)

    def wait_started(self, name: str, timeout_s: float = 60.0, mark: bytes = b": first record, ") -> bool:
        """Until the worker logged `mark` (default: it handles records; a kill before tests nothing)."""
        log = self.logs / f"{name}-{self.started_as[name]}.log"
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if mark in log.read_bytes():
                return True
            time.sleep(0.2)
        return False

    def kill(self, name: str) -> bool:
        proc = self.procs[name]
        if proc.poll() is not None:
            return False
        os.kill(proc.pid, signal.SIGKILL)
        proc.wait()
        return True

    def stop_all(self) -> None:
        for proc in self.procs.values():
            if proc.poll() is None:
                proc.send_signal(signal.SIGTERM)
        for proc in self.procs.values():
            try:
                proc.wait(30)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()


def run_crash(kafka: Any, app: str, *, guarantee: str = "exactly_once", kills: int = 3, seed: int = 0,
              work: Path | None = None, partitions: int = 2, group_timeout_s: float = 90.0) -> CrashReport:
    """One crash run on a fresh experiment (deleted afterwards); see the module doc.

    `group_timeout_s` must exceed the longest stall a kill causes (session timeout, restart,
    Faust's recovery: 30-60 s on a loaded machine), or a complete group whose members straddle
    a kill times out, is emitted with the members it had, and its last ones arrive late: curate
    doing what its settings say, but not what this count expects.
    """
    from astraflow.config import TopicSettings
    from astraflow.kafka.clients import RecordProducer
    from astraflow.kafka.topics import TopicAdmin, Topics, topic_specs

    rng = random.Random(seed)
    run = uuid.uuid4().hex[:6]
    experiment = f"crash-{app}-{run}"
    work = work or Path(f"/tmp/astraflow-crash-{run}")
    work.mkdir(parents=True, exist_ok=True)
    admin = TopicAdmin(kafka)
    specs = topic_specs(experiment, ["policy"], TopicSettings(partitions=partitions))
    admin.create(specs)
    topics = Topics(experiment)
    if app == "curate":
        records, per_group = curate_input(run, rng)
        source, sink = topics.scored, topics.train("policy")
        expected_ids = {f"{t.trajectory_id}#policy" for t in records if per_group[t.group_id]}
        args = ["--policy", "policy", "--group-timeout", str(group_timeout_s), "--min-group-size", "2"]
    elif app == "reward":
        records, per_group = reward_input(run, rng), {}
        source, sink = topics.rollouts, topics.scored
        expected_ids = {t.trajectory_id for t in records}
        args = []
    else:
        raise SystemExit(f"--app must be curate or reward, not {app}")
    workers = Workers(app, experiment, [*args, "--guarantee", guarantee, "--metrics-interval", "60"], work)
    producer = RecordProducer(kafka)
    t0 = time.monotonic()
    delivered = 0
    try:
        workers.start("a")
        workers.wait_started("a", mark=b" started (Faust app ")
        # Records trickle in (~25 s) while worker a is killed: each kill lands while it is
        # handling records, so most often inside an open transaction.
        feeder = threading.Thread(target=_feed, args=(producer, source, records, 25.0), daemon=True)
        feeder.start()
        for k in range(kills):
            workers.wait_started("a", timeout_s=30)  # it handles records (its recovery is over)
            time.sleep(rng.uniform(0.5, 2.5))
            delivered += workers.kill("a")
            workers.start("a")
            if k == 0:
                workers.start("b")  # joins while a runs: partitions move by rebalance
            workers.wait_started("a", mark=b" started (Faust app ")
        feeder.join()
        if app == "curate":  # partial groups time out (they came first)
            time.sleep(max(0.0, group_timeout_s - (time.monotonic() - t0)))
        deadline = time.monotonic() + 90
        committed = _read(kafka, sink, "read_committed", 12.0, deadline, len(expected_ids))
        # The control: the same topics read_uncommitted (curate's state changelogs too: a kill often
        # interrupts a transaction that holds group members and no train sample yet).
        seen = [sink, *([f"af.{experiment}.curate-{t}-changelog" for t in ("groups", "members", "emitted")]
                        if app == "curate" else [])]
        both = [len(_read(kafka, seen, iso, 3.0, time.monotonic() + 60, 1, decode=False))
                for iso in ("read_committed", "read_uncommitted")]
    finally:
        workers.stop_all()
        admin.delete([s.name for s in specs])
    ids = [s.sample_id if app == "curate" else s.trajectory_id for s in committed]
    counts = Counter(ids)
    if app == "reward":  # a trajectory sent twice is scored twice: count against the input's multiplicity
        want = Counter(t.trajectory_id for t in records)
        duplicates = sum(max(0, counts[k] - want[k]) for k in counts)
        missing = sum(max(0, want[k] - counts[k]) for k in want)
        split = 0
        missing_groups = sorted({k.split("/")[0] for k in want if counts[k] < want[k]})[:10]
    else:
        duplicates = sum(n - 1 for n in counts.values() if n > 1)
        missing = len(expected_ids - set(counts))
        missing_groups = sorted({i.split("/")[0] for i in expected_ids - set(counts)})[:10]
        by_group = Counter(s.group_id for s in {s.sample_id: s for s in committed}.values())
        split = sum(1 for g, n in per_group.items() if by_group.get(g, 0) not in (0, n) or (n == 0 and by_group.get(g)))
    return CrashReport(
        app=app, guarantee=guarantee, kills=delivered, rebalances=workers.started - 1, input_records=len(records),
        expected=len(expected_ids) if app == "curate" else len(records), committed=len(committed), distinct=len(counts),
        duplicates=duplicates, missing=missing, unexpected=len(set(counts) - expected_ids), split_groups=split,
        uncommitted_extra=both[1] - both[0], seconds=round(time.monotonic() - t0, 1),
        missing_groups=missing_groups,
        worker_logs=sorted(str(p) for p in work.glob("*.log")),
    )


def main(argv: list[str] | None = None) -> int:
    from astraflow.config import KafkaSettings

    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--app", choices=["curate", "reward"], default="curate")
    p.add_argument("--guarantee", choices=["exactly_once", "at_least_once"], default="exactly_once")
    p.add_argument("--kills", type=int, default=3)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--bootstrap", default="127.0.0.1:19092")
    p.add_argument("--json", type=Path)
    a = p.parse_args(argv)
    report = run_crash(KafkaSettings(bootstrap_servers=a.bootstrap), a.app, guarantee=a.guarantee, kills=a.kills, seed=a.seed)
    out = {**asdict(report), "exact": report.exact}
    print(json.dumps(out, indent=2))
    if a.json:
        a.json.write_text(json.dumps(out, indent=2))
    return 0 if report.exact else 1


if __name__ == "__main__":
    sys.exit(main())
