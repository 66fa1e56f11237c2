"""Counted crash test of the stream apps' exactly-once: kill -9 workers while they run, then count.

    python -m bench.exactly_once --app curate [--kills 3] [--guarantee at_least_once] [--json out.json]
    python -m bench.exactly_once --app reward
    python -m bench.exactly_once --app curate --state memory    # the control: a plain at-least-once curate

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

Controls that prove the count can fail:

* the same output topic read `read_uncommitted` shows the aborted records of the transactions
  the kills interrupted (`sink_aborted`; each kill waits, after its random delay, until the
  output topic's last stable offset is below its end, i.e. a transaction holding outputs is
  open, so the kills do hit uncommitted outputs; the
  workers run with `--commit-idle 1`: fed a trickle, with the default 0.05 s a worker commits
  after nearly every record and a kill finds its outputs already committed);
* `--guarantee at_least_once` runs the same workers without transactions. The reward app
  then scores redelivered records twice (duplicates). Curate at-least-once still keeps its
  groups in changelog-backed tables, which drop a re-read trajectory whose group was already
  emitted: what it shows is the table's own protection, not transactions;
* `--state memory` (curate only, implies at-least-once) is the curate of a plain consumer:
  the same app with its groups in the worker's memory, no changelog (`MemoryStateCurate`).
  A killed worker forgets its groups in assembly and its emitted ids, re-reads from the last
  committed offset and emits again: duplicates and split groups, which the count must see.
"""

from __future__ import annotations

import argparse
import json
import random
import sys
import threading
import time
import uuid
from collections import Counter
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from bench._crash_parts import OpenTransactions, Workers, curate_input, feed, read_topic, reward_input
from stream_apps.curate import CurateApp
from stream_apps.groups import GroupStore


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
    sink_aborted: int  # of which on the output topic itself
    seconds: float  # wall time of the run
    state: str = "tables"  # curate's state: tables (changelog-backed) | memory (the control)
    missing_groups: list[str] = field(default_factory=list)  # groups with a missing sample (first 10)
    worker_logs: list[str] = field(default_factory=list)  # where the workers' logs are

    @property
    def exact(self) -> bool:
        return self.duplicates == 0 and self.missing == 0 and self.unexpected == 0 and self.split_groups == 0


def run_crash(kafka: Any, app: str, *, guarantee: str = "exactly_once", kills: int = 3, seed: int = 0,
              work: Path | None = None, partitions: int = 2, group_timeout_s: float = 90.0,
              state: str = "tables") -> CrashReport:
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
        from astraflow.testing import issue_tasks

        issue_tasks(kafka, experiment, records)  # curate takes each group from its task, as the curator signed it
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
    if state == "memory":
        if app != "curate":
            raise SystemExit("--state memory is a curate control")
        guarantee = "at_least_once"
    workers = Workers("curate-memory" if state == "memory" else app, experiment,
                      [*args, "--guarantee", guarantee, "--metrics-interval", "60", "--commit-idle", "1"], work)
    watch = OpenTransactions(kafka, sink)
    producer = RecordProducer(kafka)
    t0 = time.monotonic()
    delivered = 0
    try:
        workers.start("a")
        workers.wait_started("a", mark=b" started (Faust app ")
        # Records trickle in (~25 s) while worker a is killed: each kill lands while it is
        # handling records, so most often inside an open transaction.
        feeder = threading.Thread(target=feed, args=(producer, source, records, 25.0), daemon=True)
        feeder.start()
        for k in range(kills):
            workers.wait_started("a", timeout_s=30)  # it handles records (its recovery is over)
            time.sleep(rng.uniform(0.5, 2.5))
            watch.wait_open(5.0)  # outputs in a transaction still open (at-least-once: never; kill anyway)
            delivered += workers.kill("a")
            workers.start("a")
            if k == 0:
                workers.start("b")  # joins while a runs: partitions move by rebalance
            workers.wait_started("a", mark=b" started (Faust app ")
        feeder.join()
        if app == "curate":  # partial groups time out (they came first)
            time.sleep(max(0.0, group_timeout_s - (time.monotonic() - t0)))
        deadline = time.monotonic() + 90
        committed = read_topic(kafka, sink, "read_committed", 12.0, deadline, len(expected_ids))
        # The control: the same topics read_uncommitted (curate's state changelogs too: a kill often
        # interrupts a transaction that holds group members and no train sample yet).
        seen = [sink, *([topics.changelog("curate", t) for t in ("groups", "emitted")]
                        if app == "curate" else [])]
        both = [len(read_topic(kafka, seen, iso, 3.0, time.monotonic() + 60, 1, decode=False))
                for iso in ("read_committed", "read_uncommitted")]
        on_sink = len(read_topic(kafka, sink, "read_uncommitted", 3.0, time.monotonic() + 60, 1, decode=False))
    finally:
        watch.close()
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
        uncommitted_extra=both[1] - both[0], sink_aborted=on_sink - len(committed), state=state,
        seconds=round(time.monotonic() - t0, 1),
        missing_groups=missing_groups,
        worker_logs=sorted(str(p) for p in work.glob("*.log")),
    )


class MemoryStateCurate(CurateApp):
    """Curate with its groups in worker memory (no tables, no changelog): the control of `--state memory`."""

    tables = ()

    @property
    def store(self) -> GroupStore:
        if self._store is None:
            self._store = GroupStore({}, {}, self._decode, self.worker.reread, self.group_timeout_s, self.emitted_ttl_s)
        return self._store


def serve_memory_curate(argv: list[str]) -> int:
    """Runs one `MemoryStateCurate` worker (the `--state memory` control) until SIGTERM."""
    import logging

    from astraflow.config import KafkaSettings
    from stream_apps.engine import EngineSettings, StreamEngine

    p = argparse.ArgumentParser()
    p.add_argument("experiment")
    p.add_argument("--policy", action="append", default=[])
    p.add_argument("--group-timeout", type=float, default=90.0)
    p.add_argument("--min-group-size", type=int, default=2)
    p.add_argument("--guarantee", default="at_least_once")
    p.add_argument("--metrics-interval", type=float, default=60.0)
    p.add_argument("--commit-idle", type=float, default=0.05)  # at-least-once: Faust's own commits, unused
    a = p.parse_args(argv)
    logging.basicConfig(level=logging.INFO, stream=sys.stdout, format="%(asctime)s %(name)s %(message)s")
    handler = MemoryStateCurate(a.policy, group_timeout_s=a.group_timeout, min_group_size=a.min_group_size)
    engine = StreamEngine(handler, EngineSettings(a.experiment, KafkaSettings(), guarantee="at_least_once",
                                                  metrics_interval_s=a.metrics_interval))
    engine.install_signal_handlers()
    engine.run()
    return 0


def main(argv: list[str] | None = None) -> int:
    from astraflow.config import KafkaSettings

    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["--serve-memory-curate"]:
        return serve_memory_curate(argv[1:])
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--app", choices=["curate", "reward"], default="curate")
    p.add_argument("--guarantee", choices=["exactly_once", "at_least_once"], default="exactly_once")
    p.add_argument("--state", choices=["tables", "memory"], default="tables",
                   help="curate's state: changelog-backed tables, or worker memory (the control; at-least-once)")
    p.add_argument("--kills", type=int, default=3)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--bootstrap", default="127.0.0.1:19092")
    p.add_argument("--json", type=Path)
    a = p.parse_args(argv)
    report = run_crash(KafkaSettings(bootstrap_servers=a.bootstrap), a.app, guarantee=a.guarantee, kills=a.kills, seed=a.seed,
                       state=a.state)
    out = {**asdict(report), "exact": report.exact}
    print(json.dumps(out, indent=2))
    if a.json:
        a.json.write_text(json.dumps(out, indent=2))
    return 0 if report.exact else 1


if __name__ == "__main__":
    sys.exit(main())
