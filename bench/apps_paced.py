"""The stream apps' CPU per record at the pipeline's pace: reward and curate as the pipeline runs
them (`astraflow app run reward|curate`, each its own process, exactly-once), fed trajectories
the way a RaaS node writes them during `bench/vs_trl.py --workloads a`: a step of 64 short
trajectories (8 groups of 8, `--tokens` 64) every `--step-s` (0.27 s), each group's 8 written
together (zstd, librdkafka, as the node's producer), the groups of a step `--step-s` / 8 apart.

`bench/apps.py` measures throughput on a topic filled in advance (every fetch full, few
transactions); here records trickle in as in the pipeline, so the per-fetch, per-transaction and
per-timer costs weigh as they do there. Reported, from the first record written until a
read_committed reader of the train topic (the trainer's view) has every train sample: the CPU seconds of the reward and curate processes
(/proc, every thread) and of the broker (`java`, shared: run it alone), per record, the
transactions each app committed (markers on `scored` and the train topic), the offsets of curate's
changelogs (records and markers) and the tail: from
the last group written to its last train sample read (latency: see vs_trl's stage timeline).

With `--profile PY_SPY` py-spy samples both apps over the run (`record --format raw --gil`:
only the thread holding the GIL, so a thread waiting for it in C is not counted busy; files
named in the output).

Usage: python bench/apps_paced.py [--steps 64] [--step-s 0.27] [--tokens 64] [--profile PY_SPY] [--json OUT]
"""

from __future__ import annotations

import argparse
import os
import signal
import subprocess
import sys
import tempfile
import threading
import time
import uuid
from pathlib import Path

import _common
from _pipeline import _processes, create_experiment
from confluent_kafka import TopicPartition

from astraflow.config import AstraflowConfig
from astraflow.demo.common import PY, role_env
from astraflow.kafka.clients import RecordProducer, reader, watermarks
from astraflow.kafka.topics import TopicAdmin, Topics

TERMS = {  # what the figures compare (written into the results JSON)
    "ours": "reward and curate as pipeline processes, fed at the pipeline's pace",
    "against": "none: CPU per record and transactions, absolute",
    "settings": "steps of 64 trajectories of --tokens tokens every --step-s seconds, exactly-once",
}


GROUP = 8
PER_STEP = 64


class TrainCount:
    """Counts the train topic's records as the trainer reads them (read_committed), in a thread."""

    def __init__(self, cfg: AstraflowConfig, topic: str, partitions: int) -> None:
        self.n = 0
        self._stop = threading.Event()
        self._c = reader(cfg.kafka, f"count-{uuid.uuid4().hex}")
        self._c.assign([TopicPartition(topic, p, 0) for p in range(partitions)])
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while not self._stop.is_set():
            self.n += sum(1 for m in self._c.consume(512, 0.1) if m.error() is None)

    def wait(self, n: int, timeout_s: float) -> bool:
        deadline = time.monotonic() + timeout_s
        while self.n < n and time.monotonic() < deadline:
            time.sleep(0.005)
        return self.n >= n

    def close(self) -> None:
        self._stop.set()
        self._thread.join(5)
        self._c.close()


def cpu_of(pids: dict[str, int]) -> dict[str, float]:
    """CPU seconds (user + system) of each app and of the broker, and each app's system share."""
    procs = _processes()
    out = {name: procs[pid][3] if pid in procs else 0.0 for name, pid in pids.items()}
    for name, pid in pids.items():
        f = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
        out[f"{name} sys"] = int(f[12]) / os.sysconf("SC_CLK_TCK")
    out["java"] = sum(p[3] for p in procs.values() if p[0] == "java")
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=64)
    ap.add_argument("--step-s", type=float, default=0.27)
    ap.add_argument("--tokens", type=int, default=64)
    ap.add_argument("--profile", default=None, metavar="PY_SPY")
    ap.add_argument("--json", default=None)
    args = ap.parse_args()
    cfg = AstraflowConfig()
    parts = cfg.topics.partitions
    exp = f"paced-{uuid.uuid4().hex[:8]}"
    topics = Topics(exp)
    specs, _control = create_experiment(cfg, exp, filters_off=("filter.zero_variance", "filter.length"))
    env = {**os.environ, **role_env(cfg.kafka.bootstrap_servers)}
    env["PYTHONPATH"] = str(Path(__file__).resolve().parent.parent)
    logdir = Path(tempfile.mkdtemp(prefix="apps-paced-"))
    procs = {app: subprocess.Popen([*PY, "app", "run", app, "-e", exp, *(["--policy", "policy"] if app == "curate" else [])],
                                   env=env, stdout=open(logdir / f"{app}.log", "w"),  # noqa: SIM115 (the role keeps it)
                                   stderr=subprocess.STDOUT)
             for app in ("reward", "curate")}
    spies: list[subprocess.Popen[bytes]] = []
    count = TrainCount(cfg, topics.train("policy"), parts)
    rprobe = reader(cfg.kafka, f"probe-{exp}")
    producer = RecordProducer(cfg.kafka)
    trajs = _common.trajectories((args.steps + 1) * PER_STEP, args.tokens, GROUP)
    from astraflow.testing import issue_tasks

    issue_tasks(cfg.kafka, exp, trajs)  # curate takes each group from its task, as the curator signed it
    data = [(producer.serde.dumps(t), t.group_id) for t in trajs]
    try:
        # Warm-up: one step, until curate committed it (both apps joined, tables recovered).
        for value, key in data[:PER_STEP]:
            producer.send_raw(topics.rollouts, value, key=key)
        producer.flush(30)
        if not count.wait(PER_STEP, 120):
            raise SystemExit(f"the apps did not take the warm-up step; logs in {logdir}")
        time.sleep(1.0)
        pids = {app: p.pid for app, p in procs.items()}
        if args.profile:
            for app, pid in pids.items():
                out = logdir / f"{app}.pyspy.txt"
                spies.append(subprocess.Popen([args.profile, "record", "--pid", str(pid), "--rate", "200", "--format", "raw", "--gil",
                                               "--output", str(out), "--nonblocking"],
                                              stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL))
            time.sleep(1.0)
        cpu0, t0 = cpu_of(pids), time.monotonic()
        gap = args.step_s / (PER_STEP // GROUP)
        due = t0
        n = args.steps * PER_STEP
        for g in range(n // GROUP):
            due += gap
            for value, key in data[PER_STEP + g * GROUP:PER_STEP + (g + 1) * GROUP]:
                producer.send_raw(topics.rollouts, value, key=key)
            producer.flush(10)
            time.sleep(max(0.0, due - time.monotonic()))
        sent_at = time.monotonic()
        if not count.wait(PER_STEP + n, 60):
            raise SystemExit(f"curate did not write every train sample; logs in {logdir}")
        done = time.monotonic()
        cpu1 = cpu_of(pids)
        for spy in spies:
            spy.send_signal(signal.SIGINT)
        for spy in spies:
            spy.wait(60)
        scored_end = sum(watermarks(rprobe, topics.scored, p)[1] for p in range(parts))
        train_end = sum(watermarks(rprobe, topics.train("policy"), p)[1] for p in range(parts))
        samples = PER_STEP + n
        changelogs = {t: sum(watermarks(rprobe, topics.changelog("curate", t), p)[1] for p in range(parts))
                      for t in ("groups", "emitted")}
        result = {
            "steps": args.steps, "records": n, "step_s": args.step_s, "tokens": args.tokens, "wall_s": round(done - t0, 2),
            "tail_s": round(done - sent_at, 3),
            "cpu_s": {k: round(cpu1[k] - cpu0[k], 2) for k in cpu1},
            "cpu_us_per_record": {k: round((cpu1[k] - cpu0[k]) / n * 1e6) for k in cpu1},
            "markers_scored": scored_end - samples, "markers_train": train_end - samples,  # warm-up included
            "changelog_offsets": changelogs,  # curate's tables: records and transaction markers, warm-up included
        }
        print(f"{n} records over {result['wall_s']} s (tail {result['tail_s']} s), load {os.getloadavg()[0]:.2f}")
        print("  CPU s: " + ", ".join(f"{k} {v:.2f}" for k, v in result["cpu_s"].items())
              + "  | us per record: " + ", ".join(f"{k} {v}" for k, v in result["cpu_us_per_record"].items()))
        print(f"  transaction markers (warm-up included): scored {result['markers_scored']}, train {result['markers_train']}; "
              "curate's changelogs, records and markers: " + ", ".join(f"{k} {v}" for k, v in changelogs.items()))
        if args.profile:
            print(f"  py-spy: {logdir}/reward.pyspy.txt, {logdir}/curate.pyspy.txt")
        if args.json:
            _common.write_json(args.json, "apps_paced", result, terms=TERMS, quick=False)
    finally:
        for spy in spies:
            if spy.poll() is None:
                spy.kill()
        for p in procs.values():
            p.send_signal(signal.SIGTERM)
        for p in procs.values():
            try:
                p.wait(30)
            except subprocess.TimeoutExpired:
                p.kill()
        count.close()
        rprobe.close()
        TopicAdmin(cfg.kafka).delete([*(s.name for s in specs), *(topics.changelog("curate", t) for t in ("groups", "emitted"))])
        sys.stdout.flush()


if __name__ == "__main__":
    main()
