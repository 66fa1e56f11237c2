"""The run of bench/regions.py (its module doc says what is measured): brokers with a WAN listener,
the proxy, the roles, the phases and the figures."""

from __future__ import annotations

import argparse
import signal
import subprocess
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from _cpuquota import CpuQuota
from _ledger import Ledger, TopicReader
from _pipeline import PipelineSpec, create_experiment, pipeline_roles, wait_ready, write_dataset
from confluent_kafka import KafkaException, TopicPartition

from astraflow.config import KafkaSettings, LocalKafkaSettings, WanSettings, load_config
from astraflow.demo.common import PY, role_env
from astraflow.demo.supervisor import Role, Supervisor
from astraflow.kafka.local import LocalKafka
from astraflow.kafka.topics import Topics
from astraflow.kafka.wan import Link, Wan
from astraflow.records import Metric, PolicyVersion, Trajectory, TrajectoryStatus
from astraflow.weights.versions import SNAPSHOT_PARTITION

FILTERS_OFF = ("filter.zero_variance", "filter.length", "filter.staleness")
NODES = (("raas-a1", "a"), ("raas-a2", "a"), ("raas-b1", "b"))  # name, region
NODES_MM2 = (*NODES, ("raas-b2", "b"))  # --via mm2: two nodes in B, so a node's loss is not the region's
# the elastic phase: (what, node): SIGTERM (a node leaves), kill -9 (a host dies), each followed by a restart
EVENTS = {"wan": (("sigterm", "raas-b1"), ("kill9", "raas-a1")),  # kill -9 of the fastest node, loaded
          "mm2": (("sigterm", "raas-a1"), ("kill9", "raas-b1"))}  # raas-b2 stays in B


def node_cpus(spec: str, names: list[str]) -> dict[str, float]:
    """`--node-cpus` ("raas-a1=0.3,raas-a2=0.1,...") -> node -> cores, for the nodes of this run
    (0 or not named: uncapped; a node of the other `--via` is ignored)."""
    out = dict.fromkeys(names, 0.0)
    for item in filter(None, (x.strip() for x in spec.split(","))):
        name, _, cores = item.partition("=")
        if name not in {n for n, _ in NODES_MM2}:
            raise ValueError(f"--node-cpus names {name!r}, not a node ({', '.join(n for n, _ in NODES_MM2)})")
        if name in out:
            out[name] = float(cores)
    return out


CURATOR_REGION_GAUGES = ("region_share.", "region_transit_s.", "tasks_reserve.", "tasks_outstanding.")


@dataclass
class Seen:
    """What the run has read back from Kafka so far."""

    rollouts: list[tuple[str, float, str, int]] = field(default_factory=list)  # node, ts s, task id, version
    started: list[tuple[str, str, float, float]] = field(default_factory=list)  # node, task id, queued s, started s (its clock)
    inflight: list[tuple[str, float, float]] = field(default_factory=list)  # node, ts s, rollouts in flight
    node_version: list[tuple[str, float, int]] = field(default_factory=list)  # node, ts s, applied version
    manifests: dict[int, PolicyVersion] = field(default_factory=dict)  # the stream's (what every follower pulls)
    snapshots: dict[int, PolicyVersion] = field(default_factory=dict)  # written beside it (joiners pull them)
    live_b: dict[int, float] = field(default_factory=dict)  # version -> applied by the WAN follower (epoch s)
    errors: dict[str, int] = field(default_factory=dict)  # node -> ERROR trajectories (not counted as rollouts)
    # the nodes' group's committed offsets of tasks, read about every second: (time s, partition,
    # offset, metadata: the node's commit round trip and speed, what the curator's placement uses)
    commits: list[tuple[float, int, int, str]] = field(default_factory=list)
    # the curator's region gauges (--via mm2): time s, name (`region_share.b`, `tasks_reserve.tasks`, ...), value
    curator: list[tuple[float, str, float]] = field(default_factory=list)


class RegionsRun:
    def __init__(self, args: argparse.Namespace, exp: str) -> None:
        self.a, self.exp = args, exp
        self.node_specs = NODES_MM2 if args.via == "mm2" else NODES
        self.cpus = node_cpus(args.node_cpus, [n for n, _ in self.node_specs])  # node -> cores (0: uncapped)
        self.work = Path(args.work_dir) / exp
        self.work.mkdir(parents=True, exist_ok=True)
        p = args.port
        self.kafka = LocalKafka(LocalKafkaSettings(data_dir=self.work / "kafka", port=p, controller_port=p + 1,
                                                   wan_proxy_port=p + 2, wan_port=p + 3, start_timeout_s=300.0))
        self.wan = Wan(WanSettings(data_dir=self.work / "wan", api_port=args.api_port, latency_ms=args.latency_ms,
                                   rate_kb_s=args.rate_kb_s))
        self.cfg = load_config(env={}, overrides=[f"kafka.bootstrap_servers={self.kafka.bootstrap}",
                                                  f"topics.tasks_partitions={args.tasks_partitions}"])
        self.wan_kafka = KafkaSettings(bootstrap_servers=f"127.0.0.1:{p + 2}")
        # --via mm2: region B has a cluster of its own (port + 10), fed by MirrorMaker 2, which runs in
        # region B and reaches A's cluster through the WAN link; B's node and follower use B's cluster.
        self.kafka_b: LocalKafka | None = None
        self.mirror: Any = None
        self.region_kafka = self.wan_kafka  # what region B's node and the benchmark's follower bootstrap at
        if args.via == "mm2":
            self.kafka_b = LocalKafka(LocalKafkaSettings(data_dir=self.work / "kafka-b", port=p + 10, controller_port=p + 11,
                                                         start_timeout_s=300.0, heap_mb=256))
            self.region_kafka = KafkaSettings(bootstrap_servers=self.kafka_b.bootstrap)
        self.topics = Topics(exp)
        self.sup = Supervisor(self.work / "logs")
        self.nodes: dict[str, Role] = {}
        self.quotas: dict[str, CpuQuota] = {}  # node -> its CPU group (--node-cpus; none: uncapped)
        self.seen = Seen()
        self.marks: dict[str, float] = {}  # event -> epoch s
        self.calib: dict[str, tuple[float, int, float]] = {}  # node -> (start, rollouts, seconds)
        self.wan_bytes: dict[str, dict] = {}
        self.trained_log = self.work / "trained.jsonl"
        self.readers: list[TopicReader] = []
        self.drain_end: str | None = None  # how the drain ended (`drain`); None: not reached or cut
        self.timing: dict[str, float] = {}  # where the time around the measured phases goes: step -> seconds
        self._step_at = time.time()

    def step(self, name: str) -> None:
        """Records the seconds since the previous step under `name` (the report's `timing_s`)."""
        now = time.time()
        self.timing[name] = round(now - self._step_at, 1)
        self._step_at = now

    # ---- setup -----------------------------------------------------------------------------------

    def setup(self) -> None:
        import _rl

        a = self.a
        self._step_at = time.time()
        self.kafka.up(echo=lambda *_: None)
        self.step("setup_kafka")
        self.wan.up([Link("kafka-1", a.port + 2, a.port + 3)], echo=print)
        self.step("setup_wan")
        if self.kafka_b is not None:
            self.kafka_b.up(echo=lambda *_: None)
            self.step("setup_kafka_b")
        model = _rl.tiny_model_dir()
        tasks, _ = _rl.make_tasks(a.prompts, a.seed, "a")
        self.spec = PipelineSpec(
            model, write_dataset(tasks, self.work / "train.jsonl"), self.work / "run", "rlvr", a.group, a.max_ahead,
            a.max_tokens, 1, a.batch, 3.0, a.inflight, a.prefetch, a.seed,
            trainer_sets=(f"trainer.trained_log={self.trained_log}", "trainer.publish_dtype=bfloat16",
                          f"trainer.snapshot_every_versions={a.snapshot_every}", "trainer.max_staleness=null"))
        _, self.control = create_experiment(self.cfg, self.exp, filters_off=FILTERS_OFF)
        self.step("setup_experiment")
        if self.kafka_b is not None:
            from astraflow.kafka.mirror import Mirror, MirrorPlan, prepare_topics

            plan = MirrorPlan(self.exp, "b", self.kafka.wan_bootstrap or "", self.kafka_b.bootstrap)
            prepare_topics(plan, ["policy"], self.cfg.topics)
            self.mirror = Mirror(plan, self.work / "mirror", libs=self.kafka.libs)
            self.mirror.up(echo=print, timeout_s=300.0)
            self.step("setup_mirror")
        for role in pipeline_roles(self.exp, self.spec, role_env(self.kafka.bootstrap), nodes=0):
            if role.name == "curator" and self.kafka_b is not None:  # a fixed share of the tasks for region B
                role.cmd += ["--region-share", f"b={a.region_share}", "--region-dead-s", str(a.region_dead_s)]
            self.sup.start(role)
        from confluent_kafka.admin import AdminClient

        from astraflow.kafka.clients import reader

        self.probe = reader(self.cfg.kafka, f"{self.exp}-probe", log_level=2)
        wait_ready(AdminClient(self.cfg.kafka.client_config()), [self.topics.group("reward"), self.topics.group("curate")],
                   self.probe, self.topics.weights("policy"), self.sup, 300.0)
        self.step("setup_roles_ready")
        self.ledger = Ledger(self.cfg.kafka, self.topics.tasks, self.topics.dlq, self.trained_log,
                             (self.topics.tasks_of("b"),) if self.kafka_b is not None else ())
        self.r_roll = TopicReader(self.cfg.kafka, self.topics.rollouts)
        self.r_metrics = TopicReader(self.cfg.kafka, self.topics.metrics)
        self.r_weights = TopicReader(self.cfg.kafka, self.topics.weights("policy"))
        self.readers = [self.r_roll, self.r_metrics, self.r_weights]
        # what the nodes report with their commits (the placement's speed and refill delay), read as
        # the curator's placer reads it: a reader named after the nodes' group, which never joins it
        self.commit_reader = reader(self.cfg.kafka, self.topics.raas_group, log_level=2)
        self._commits_at = 0.0
        self.quotas = {name: CpuQuota(f"{self.exp}-{name}", cpus) for name, cpus in self.cpus.items() if cpus}
        self.control.set("curator", "pause", "off", issued_by="bench-regions")
        self.step("setup_readers")
        print(f"setup: {self.timing}", flush=True)
        print(f"experiment {self.exp}: Kafka {self.kafka.bootstrap}, region B via {self.kafka.wan_bootstrap}", flush=True)

    def node_role(self, name: str, region: str) -> Role:
        s, i = self.spec, [n for n, _ in self.node_specs].index(name)
        boot = self.kafka.bootstrap if region == "a" else self.region_kafka.bootstrap_servers
        own = ["--tasks-region", region] if region != "a" and self.kafka_b is not None else []
        return Role(name, [*PY, "raas", "serve", "-e", self.exp, "-p", f"policy={s.model_dir}", "--max-inflight",
                           str(s.node_inflight), "--max-batch", str(s.node_inflight), "--prefetch", str(s.node_prefetch),
                           "--threads", "1", "--seed", str(s.seed + i), "--node-id", name, "--region", region, *own],
                    {**role_env(boot or ""), "ASTRAFLOW__RAAS__GROUP_SESSION_TIMEOUT_S": str(self.a.node_session_s)})

    def stop_node(self, name: str) -> None:
        """SIGTERM to the node's process only, as `docker stop` or Kubernetes send it (its engine
        process is its child and must live until the node has drained), then wait for the exit."""
        role = self.nodes[name]
        if role.proc is not None and role.proc.poll() is None:
            role.proc.send_signal(signal.SIGTERM)
            try:
                role.proc.wait(timeout=60)
            except subprocess.TimeoutExpired:
                self.sup.kill(role)
        self.sup.kill(role)  # anything of its process group left behind
        if role in self.sup.roles:
            self.sup.roles.remove(role)

    def kill_node(self, name: str) -> None:
        """kill -9 of the node's process group (the host dies)."""
        role = self.nodes[name]
        self.sup.kill(role)
        if role in self.sup.roles:
            self.sup.roles.remove(role)

    def start_node(self, name: str) -> float:
        region = next(n[1] for n in self.node_specs if n[0] == name)
        role = self.nodes.get(name)
        if role is None:
            role = self.nodes[name] = self.node_role(name, region)
        self.sup.start(role)  # supervised again (stop and kill_node drop it)
        return time.time()

    def apply_quota(self, name: str) -> None:
        """The node's CPU quota, applied once it serves (its hardware's speed, not a slower start-up:
        at a few percent of a core, loading torch alone would take minutes)."""
        role = self.nodes[name]
        if name in self.quotas and role.proc is not None:
            self.quotas[name].add_tree(role.proc.pid)

    # ---- reading back ----------------------------------------------------------------------------

    def refresh(self) -> None:
        for rec, ts in self.r_roll.read(10.0):  # rollouts and started stay in step (one entry each per trajectory)
            if isinstance(rec, Trajectory) and rec.status == TrajectoryStatus.ERROR:
                self.seen.errors[rec.node.node_id] = self.seen.errors.get(rec.node.node_id, 0) + 1
            elif isinstance(rec, Trajectory):
                v = max((int(seg.versions.max()) for seg in rec.segments if len(seg.versions)), default=-1)
                self.seen.rollouts.append((rec.node.node_id, ts / 1000, rec.task_id, v))
                self.seen.started.append((rec.node.node_id, rec.task_id, rec.timings.queued_at / 1000,
                                          rec.timings.started_at / 1000))
        for rec, _ in self.r_metrics.read(10.0):
            if isinstance(rec, Metric) and rec.component == "raas":
                if rec.name == "inflight":
                    self.seen.inflight.append((rec.instance, rec.ts / 1000, rec.value))
                elif rec.name == "policy_version":
                    self.seen.node_version.append((rec.instance, rec.ts / 1000, int(rec.value)))
            elif isinstance(rec, Metric) and rec.component == "curator" and rec.name.startswith(CURATOR_REGION_GAUGES):
                self.seen.curator.append((rec.ts / 1000, rec.name, rec.value))
        for rec, _, partition, _ in self.r_weights.read_located(10.0):
            if isinstance(rec, PolicyVersion):
                beside = partition == SNAPSHOT_PARTITION
                (self.seen.snapshots if beside else self.seen.manifests).setdefault(rec.version, rec)
        if getattr(self, "commit_reader", None) is not None and time.time() - self._commits_at >= 1.0:
            self._commits_at = time.time()
            try:
                got = self.commit_reader.committed([TopicPartition(self.topics.tasks, p) for p in range(self.a.tasks_partitions)],
                                                   timeout=5.0)
            except KafkaException:
                got = []
            self.seen.commits.extend((self._commits_at, tp.partition, tp.offset, tp.metadata or "") for tp in got if tp.offset >= 0)
        self.sup.check()

    def wait(self, seconds: float) -> None:
        end = time.time() + seconds
        while time.time() < end:
            self.refresh()
            time.sleep(min(1.0, max(0.0, end - time.time())))

    def first_after(self, node: str, t: float, timeout_s: float = 180.0) -> float | None:
        """The first trajectory of `node` after `t` (waits for it)."""
        deadline = time.time() + timeout_s
        while time.time() < deadline:
            self.refresh()
            ts = [r[1] for r in self.seen.rollouts if r[0] == node and r[1] > t]
            if ts:
                return min(ts)
            time.sleep(1.0)
        return None

    def count(self, node: str | None, t0: float, t1: float) -> int:
        return sum(1 for r in self.seen.rollouts if (node is None or r[0] == node) and t0 <= r[1] < t1)

    def follow_wan(self, stop) -> None:
        """Region B's view of the weights (runs in a thread): when each version is applied there."""
        from astraflow.weights.follow import KafkaWeightFollower

        f = KafkaWeightFollower(self.region_kafka, self.exp, "policy", request_snapshots=False,
                                requester="bench-regions", report_refusals=False)
        try:
            f.start(timeout_s=60.0)
            while not stop.is_set():
                f.poll(timeout_s=0.5)
                v = f.follower.version
                if v is not None and v not in self.seen.live_b:
                    self.seen.live_b[v] = time.time()
        finally:
            f.close()

    # ---- phases ----------------------------------------------------------------------------------

    def calibrate(self) -> None:
        for name, _ in self.node_specs:
            t = self.start_node(name)
            first = self.first_after(name, t)
            if first is None:
                raise RuntimeError(f"{name} wrote no trajectory within 180 s; see {self.work / 'logs'}")
            self.apply_quota(name)
            first = time.time()
            self.wait(self.a.calib_s)
            n = self.count(name, first, first + self.a.calib_s)  # so far: the report counts again, once all is read
            self.calib[name] = (first, n, self.a.calib_s)
            print(f"calibrate {name}: {n / self.a.calib_s:.2f} rollouts/s alone so far (first after {first - t:.0f}s)",
                  flush=True)
            self.stop_node(name)
        self.step("calibrate")

    def mixed(self) -> None:
        t = time.time()
        running = {n for n, r in self.nodes.items() if r.proc is not None and r.proc.poll() is None}
        for name, _ in self.node_specs:
            if name not in running:  # --outage: region A's nodes run since its alone phase
                self.start_node(name)
        for name, _ in self.node_specs:
            if name not in running:
                self.first_after(name, t)
                self.apply_quota(name)
        self.refresh()
        self.marks["mixed_start"] = time.time()
        self.wait(self.a.mixed_s)
        self.marks["mixed_end"] = time.time()
        self.step("mixed")
        print(f"mixed: {self.count(None, self.marks['mixed_start'], self.marks['mixed_end']) / self.a.mixed_s:.2f} rollouts/s",
              flush=True)

    def elastic(self) -> None:
        """Each event of EVENTS[--via]: the node leaves (SIGTERM) or dies (kill -9) while loaded,
        `--hold-s` later it starts again; marks `<what>_<node>` and `join_<node>`."""
        h = self.a.hold_s
        for what, node in EVENTS[self.a.via]:
            if what == "kill9":  # killed while loaded: once its last metric shows rollouts in flight (up to 20 s)
                since, deadline = time.time(), time.time() + 20.0
                while time.time() < deadline:
                    self.refresh()
                    last = [v for n, ts, v in self.seen.inflight if n == node and ts >= since]
                    if last and last[-1] > 0:
                        break
                    time.sleep(0.2)
            self.marks[f"{what}_{node}"] = time.time()
            (self.stop_node if what == "sigterm" else self.kill_node)(node)
            self.wait(h)
            self.marks[f"join_{node}"] = self.start_node(node)
            self.first_after(node, self.marks[f"join_{node}"])
            self.apply_quota(node)
            self.wait(h / 2)
        self.marks["elastic_end"] = time.time()
        self.step("elastic")

    def drain(self, idle_s: float = 60.0, timeout_s: float = 180.0) -> None:
        """Waits until every issued sample is trained or dead-lettered; `drain_end` says how it
        ended: "accounted" (nothing outstanding at two reads in a row and after the last one),
        "stalled" (nothing moved for `idle_s`: what is left is lost), "deadline" (still moving) or
        "late tasks" (more came after the check): the loss count is then unknown. Unset: the run
        was stopped before."""
        self.control.set("curator", "pause", "on", issued_by="bench-regions")
        last, moved, deadline = None, time.time(), time.time() + timeout_s
        self.drain_end, zero_seen = "deadline", False
        while time.time() < deadline:
            self.ledger.refresh()
            left = self.ledger.outstanding()
            if left == 0 and zero_seen:  # twice in a row: the curator's last transaction is read too
                self.drain_end = "accounted"
                break
            zero_seen = left == 0 and self.ledger.complete  # a read cut by its timeout proves nothing
            if left != last:
                last, moved = left, time.time()
            elif left and time.time() - moved > idle_s:
                self.drain_end = "stalled"
                break
            self.wait(2.0)
        self.refresh()
        self.ledger.refresh()
        if self.drain_end == "accounted" and self.ledger.outstanding():
            self.drain_end = "late tasks"  # tasks read after the check (run 12: 12 tasks): not a loss count
        self.marks["drained"] = time.time()
        self.step("drain")
        print(f"drain: {self.drain_end} after {self.timing['drain']:.0f} s", flush=True)

    # ---- figures ---------------------------------------------------------------------------------

    def node_log(self, name: str) -> str:
        path = self.work / "logs" / f"{name}.log"
        return path.read_text(errors="replace") if path.exists() else ""

    def save_raw(self, path: Path) -> None:
        """What the figures are computed from (the seen records, marks, calibration, issued tasks),
        so that they can be computed again from a finished run."""
        import pickle

        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_bytes(pickle.dumps({"seen": self.seen, "marks": self.marks, "calib": self.calib,
                                       "wan_bytes": self.wan_bytes, "args": vars(self.a), "exp": self.exp,
                                       "tasks": self.ledger.tasks, "logs": {n: self.node_log(n) for n, _ in self.node_specs}}))

    def report(self) -> dict:
        from _regions_report import build

        return build(self)

    def close_links(self) -> None:
        """Stops every role, so that every region-B connection closes: Toxiproxy 2.5 adds a
        connection's bytes to its counters only when the connection ends."""
        self._step_at = time.time()
        self.sup.stop_all()
        if self.mirror is not None:  # MM2's connections through the link close with it
            self.mirror.down(echo=lambda *_: None)
        self.wan_bytes["end"] = self.wan.bytes().get("kafka-1", {})
        self.step("stop_roles")

    def close(self) -> None:
        self.sup.stop_all()
        for r in self.readers:
            r.consumer.close()
        if getattr(self, "ledger", None) is not None:
            self.ledger.close()
        if getattr(self, "probe", None) is not None:
            self.probe.close()
        if getattr(self, "commit_reader", None) is not None:
            self.commit_reader.close()
        for q in self.quotas.values():
            q.remove()
        if self.mirror is not None:
            self.mirror.down(echo=lambda *_: None)
        self.wan.down(echo=lambda *_: None)
        if self.kafka_b is not None:
            self.kafka_b.down(echo=lambda *_: None)
        self.kafka.down(echo=lambda *_: None)


def print_table(r: dict) -> None:
    print(f"\nregions ({r['experiment']}; load average {r['load_avg']}; WAN {r['wan']})")
    print(f"{'node':10} {'region':6} {'alone r/s':>9} {'rel.speed':>9} {'mixed r/s':>9} {'reported':>8} {'share':>6} "
          f"{'expected':>8} {'dev':>6} {'idle':>5} {'on way':>6} {'delay s':>7} {'reserve':>7} {'held':>5}")
    def f(x: float | None, spec: str, width: int) -> str:
        sign, rest = (spec[0], spec[1:]) if spec[0] in "+- " else ("", spec)  # the sign goes before the width
        return f"{'n/a':>{width}}" if x is None else format(x, f"{sign}{width}{rest}")

    for n in r["nodes"]:
        print(f"{n['node']:10} {n['region']:6} {f(n['alone_rps'], '.2f', 9)} {f(n['rel_speed'], '.2f', 9)} "
              f"{n['mixed_rps']:9.2f} {f(n['reported_speed_rps'], '.2f', 8)} {n['share']:6.2f} {f(n['expected_share'], '.2f', 8)} "
              f"{f(n['share_dev'], '+.0%', 6)} {n['idle_while_waiting']:5.0%} {n['idle_while_on_the_way']:6.0%} "
              f"{f(n['refill_delay_s'], '.2f', 7)} {f(n['reserve_tasks'], '.1f', 7)} {n['tasks_held_mean']:5.1f}")
    for k, v in r["figures"].items():
        print(f"  {k}: {v}")
