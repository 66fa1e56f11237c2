"""The fault harness's run: its own brokers, the pipeline's roles as processes, phases of faults, the drain.

`Harness(args).run()` does what `bench/faults.py` describes (its module doc: phases, faults,
what is counted) and returns `_fault_report.Report`. It is the supervisor of the roles: a
killed role is started again at once, a role that exited on its own is recorded and restarted.
"""

from __future__ import annotations

import argparse
import random
import time
import uuid
from dataclasses import dataclass, field
from pathlib import Path

from _brokers import Brokers
from _fault_report import Report, build_report
from _ledger import Ledger, TopicReader
from _pipeline import (
    PipelineSpec,
    app_role,
    create_experiment,
    interrupt_on_sigterm,
    node_role,
    pipeline_roles,
    wait_ready,
    write_dataset,
)

from astraflow.config import load_config
from astraflow.demo.common import role_env
from astraflow.demo.supervisor import Role, Supervisor, tail
from astraflow.kafka.clients import reader, watermarks
from astraflow.kafka.topics import Topics

ROLE_KILLS = ("curator", "reward", "curate", "trainer", "nodes")
FILTERS_OFF = ("filter.zero_variance", "filter.length", "filter.staleness")


@dataclass
class FaultEvent:
    """One injected fault, with wall-clock times (epoch seconds)."""

    kind: str  # kill, broker-kill, broker-outage, rebalance
    target: str  # role or broker
    start: float
    end: float = 0.0  # when the fault was over (role restarted, broker back, workers gone)


@dataclass
class PhaseRecord:
    """What happened in one phase: its window, the trained-log lines it wrote, faults and exits."""

    name: str
    start: float
    end: float = 0.0
    log_lines: tuple[int, int] = (0, 0)  # trained-log lines [start, end) written in this phase
    faults: list[FaultEvent] = field(default_factory=list)
    exits: list[dict] = field(default_factory=list)  # roles that exited on their own
    drained: bool = False  # every task issued so far trained or accounted for at the phase end


class Harness:
    """Runs the phases (see the module doc)."""

    def __init__(self, args: argparse.Namespace) -> None:
        self.args = args
        self.rng = random.Random(args.seed)
        self.exp = f"faults-{uuid.uuid4().hex[:8]}"
        self.work = Path(args.work_dir) / self.exp
        self.work.mkdir(parents=True, exist_ok=True)
        self.brokers = Brokers(self.work / "kafka", args.port, args.brokers)
        b = self.brokers
        self.cfg = load_config(env={}, overrides=[f"kafka.bootstrap_servers={b.bootstrap}",
                                                  f"topics.replication_factor={b.replication_factor}",
                                                  *([f"topics.min_insync_replicas={b.min_insync_replicas}"]
                                                    if b.min_insync_replicas else [])])
        self.topics = Topics(self.exp)
        self.sup = Supervisor(self.work / "logs")
        self.roles: dict[str, Role] = {}
        self.phases: list[PhaseRecord] = []
        self.restart_due: dict[str, float] = {}  # role -> earliest restart after an exit of its own
        self.trained_log = self.work / "trained.jsonl"
        self.marks: dict[str, int] = {}  # role -> its output at its last fault (see await_work)

    # ---- setup -----------------------------------------------------------------------------------

    def setup(self) -> None:
        import _rl

        a = self.args
        self.brokers.up()
        model = _rl.tiny_model_dir()
        tasks, _ = _rl.make_tasks(a.prompts, a.seed, "a")
        self.spec = PipelineSpec(
            model, write_dataset(tasks, self.work / "train.jsonl"), self.work / "run", "rlvr", a.group, a.max_ahead,
            a.max_tokens, 1, a.batch, a.max_wait_s, a.group * a.max_ahead, a.max_ahead, a.seed,
            curate_extra=("--group-timeout", str(a.group_timeout_s), *a.curate_arg),
            trainer_sets=(f"trainer.trained_log={self.trained_log}", *a.trainer_set))
        self.specs, self.control = create_experiment(self.cfg, self.exp, filters_off=FILTERS_OFF)
        nodes = [node_role(self.exp, self.spec, self.node_env(), i + 1) for i in range(a.nodes)]
        for role in [*pipeline_roles(self.exp, self.spec, self.env(), nodes=0), *nodes]:
            self.roles[role.name] = self.sup.start(role)
        from confluent_kafka.admin import AdminClient

        self.probe = reader(self.cfg.kafka, f"{self.exp}-probe", log_level=2)
        wait_ready(AdminClient(self.cfg.kafka.client_config()),
                   [self.topics.raas_group, self.topics.group("reward"), self.topics.group("curate")], self.probe,
                   self.topics.weights("policy"), self.sup, a.ready_timeout_s)
        self.ledger = Ledger(self.cfg.kafka, self.topics.tasks, self.topics.dlq, self.trained_log)
        self.rollouts = TopicReader(self.cfg.kafka, self.topics.rollouts)
        self.node_output: dict[str, int] = {}  # node id -> trajectories seen

    def env(self) -> dict[str, str]:
        """Every role's environment: the harness's cluster and its topic durability settings."""
        t = self.cfg.topics
        return {**role_env(self.brokers.bootstrap), "ASTRAFLOW__TOPICS__REPLICATION_FACTOR": str(t.replication_factor),
                **({"ASTRAFLOW__TOPICS__MIN_INSYNC_REPLICAS": str(t.min_insync_replicas)} if t.min_insync_replicas else {})}

    def node_env(self) -> dict[str, str]:
        """A node's environment: `env()`, with `--session-s` as its group session when given."""
        session = getattr(self.args, "session_s", None)
        return {**self.env(), **({"ASTRAFLOW__KAFKA__GROUP_SESSION_TIMEOUT_S": f"{session:g}"} if session else {})}

    # ---- supervision -----------------------------------------------------------------------------

    def supervise(self, phase: PhaseRecord) -> None:
        """Restarts a role that exited on its own (at most every 10 s), recording the exit."""
        now = time.time()
        for name, role in list(self.roles.items()):
            code = role.proc.poll() if role.proc else None
            if code is None:
                continue
            if name not in self.restart_due:
                phase.exits.append({"role": name, "code": code, "at": now, "log": tail(role.log, 15)})
                print(f"  ! {name} exited with code {code}; restarting it", flush=True)
                self.restart_due[name] = now + (0 if len([e for e in phase.exits if e["role"] == name]) <= 1 else 10)
            if now >= self.restart_due[name]:
                self.sup.restart(role)
                del self.restart_due[name]

    def wait(self, seconds: float, phase: PhaseRecord) -> None:
        end = time.time() + seconds
        while time.time() < end:
            self.supervise(phase)
            time.sleep(min(0.5, max(0.0, end - time.time())))

    # ---- faults ----------------------------------------------------------------------------------

    def output(self, role: str) -> int:
        """How much the role has written so far (records of its output topic; trainer: steps logged)."""
        if role == "trainer":
            return _lines(self.trained_log)
        if role.startswith("raas-"):  # trajectories of that node
            for rec, _ in self.rollouts.read(10.0):
                self.node_output[rec.node.node_id] = self.node_output.get(rec.node.node_id, 0) + 1
            return self.node_output.get(role, 0)
        topic = {"curator": self.topics.tasks, "reward": self.topics.scored, "curate": self.topics.train("policy")}[role]
        return sum(watermarks(self.probe, topic, p)[1] for p in range(self.cfg.topics.partitions))

    def await_work(self, role: str, phase: PhaseRecord, then_s: tuple[float, float] = (0.5, 4.0)) -> None:
        """Until `role` wrote something since its last fault (at most busy_timeout_s), then a random
        `then_s` more: so every fault hits work in flight, not a role still starting."""
        mark = self.marks.get(role)
        deadline = time.time() + self.args.busy_timeout_s
        while mark is not None and self.output(role) <= mark and time.time() < deadline:
            self.wait(1.0, phase)
        self.wait(self.rng.uniform(*then_s), phase)

    def kill_role(self, name: str) -> FaultEvent:
        ev = FaultEvent("kill", name, time.time())
        self.sup.kill(self.roles[name])
        self.marks[name] = self.output(name)
        self.sup.restart(self.roles[name])
        ev.end = time.time()
        return ev

    def broker_kill(self, phase: PhaseRecord, kind: str, down_s: float, index: int | None = None,
                    mode: str = "kill") -> FaultEvent:
        """Brokers down (all of them, or `index`) for `down_s`, then back on their data."""
        ev = FaultEvent(kind, "all brokers" if index is None else f"broker {index}", time.time())
        if mode == "stop":
            self.brokers.pause(index)
            self.wait(down_s, phase)
            self.brokers.resume(index)
        else:
            self.brokers.kill(index)
            self.wait(down_s, phase)
            self.brokers.start(index)
        ev.end = time.time()
        return ev

    def rebalance(self, phase: PhaseRecord, hold_s: float) -> FaultEvent:
        ev = FaultEvent("rebalance", "curate-2,reward-2,raas-3", time.time())
        env = self.env()
        extra = [app_role(self.exp, self.spec, env, "curate", "curate-2"), app_role(self.exp, self.spec, env, "reward", "reward-2"),
                 node_role(self.exp, self.spec, self.node_env(), self.args.nodes + 1)]
        for r in extra:
            self.roles[r.name] = self.sup.start(r)
        self.wait(hold_s, phase)
        for r in extra:
            del self.roles[r.name]
            self.sup.stop(r)
        ev.end = time.time()
        return ev

    # ---- phases ----------------------------------------------------------------------------------

    def plan(self) -> list[tuple[str, list[tuple[str, str]]]]:
        """(phase name, [(fault kind, target)]) in run order."""
        a, nodes = self.args, [f"raas-{i + 1}" for i in range(self.args.nodes)]
        if a.quick:
            return [("kill-roles", [("kill", r) for r in ("curate", "trainer", "raas-1", "reward", "curator")]),
                    ("broker-restart", [("broker-restart", "0")])]
        out: list[tuple[str, list[tuple[str, str]]]] = [("baseline", []), ("broker-outage", [("broker-outage", "0")])]
        if self.brokers.count >= 3:
            out.append(("broker-1-of-3", [("broker-1-of-3", "1")]))
        out.append(("broker-restart", [("broker-restart", "0")] * a.broker_restarts))
        for role in ROLE_KILLS:
            targets = nodes if role == "nodes" else [role]
            out.append((f"kill-{role}", [("kill", t) for t in targets for _ in range(a.kills)]))
        out.append(("rebalance", [("rebalance", "")]))
        if not a.only:
            return out
        return sorted((p for p in out if p[0] in a.only), key=lambda p: a.only.index(p[0]))  # in the order given

    def run_phase(self, name: str, faults: list[tuple[str, str]]) -> PhaseRecord:
        a = self.args
        line0 = _lines(self.trained_log)
        phase = PhaseRecord(name, time.time(), log_lines=(line0, line0))
        self.phases.append(phase)
        duration = a.phase_s
        if any(k == "broker-outage" for k, _ in faults):
            duration = max(duration, a.outage_s + 0.5 * a.phase_s)
        # One slot per fault, a random moment inside each (faults of a phase never overlap).
        slots = len(faults) or 1
        lead = 0.1 * duration
        width = (duration - 2 * lead) / slots
        at = [lead + i * width + self.rng.uniform(0.1, 0.6) * width for i in range(len(faults))]
        if any(k == "broker-outage" for k, _ in faults):  # the outage fills the phase: it starts early
            at = [self.rng.uniform(0.2, 0.5) * a.phase_s]
        print(f"phase {name}: {duration:.0f}s, faults at {[round(t) for t in at]}", flush=True)
        self.control.set("curator", "pause", "off", issued_by="faults")
        t0 = time.time()
        for (kind, target), t in zip(faults, at, strict=True):
            self.wait(max(0.0, t0 + t - time.time()), phase)
            self.await_work(target if kind == "kill" else "trainer", phase)
            if kind == "kill":
                ev = self.kill_role(target)
            elif kind == "broker-restart":
                ev = self.broker_kill(phase, kind, 0.0)
            elif kind == "broker-outage":
                ev = self.broker_kill(phase, kind, a.outage_s, mode=a.outage_mode)
            elif kind == "broker-1-of-3":
                ev = self.broker_kill(phase, kind, a.one_down_s, index=int(target))
            else:
                ev = self.rebalance(phase, a.rebalance_hold_s)
            phase.faults.append(ev)
            if kind != "kill":
                self.marks["trainer"] = self.output("trainer")
            print(f"  {ev.kind} {ev.target} at +{ev.start - t0:.0f}s ({ev.end - ev.start:.1f}s)", flush=True)
        self.wait(max(0.0, t0 + duration - time.time()), phase)
        # Every role killed in the phase is back at work before the curator pauses (a curator
        # killed late in a phase would otherwise "recover" only when the next phase resumes it).
        for target in dict.fromkeys(ev.target for ev in phase.faults if ev.kind == "kill"):
            self.await_work(target, phase, then_s=(0.0, 0.0))
        self.control.set("curator", "pause", "on", issued_by="faults")
        phase.drained = self.drain(phase)
        t = self.ledger.tally([x for x in self.ledger.tasks.values() if x.ts_ms / 1000 >= phase.start])
        print(f"  so far: {t.tasks_issued} tasks issued, {t.tasks_trained} trained, {t.lost} samples not trained yet",
              flush=True)
        phase.end = time.time()
        phase.log_lines = (line0, _lines(self.trained_log))
        return phase

    def drain(self, phase: PhaseRecord) -> bool:
        """Until every issued task is trained or accounted for, or nothing moved for drain_idle_s."""
        last, moved = None, time.time()
        deadline = time.time() + self.args.drain_timeout_s
        while time.time() < deadline:
            self.ledger.refresh()
            left = self.ledger.outstanding()
            if left == 0:
                return True
            if left != last:
                last, moved = left, time.time()
            elif time.time() - moved > self.args.drain_idle_s:
                break
            self.wait(2.0, phase)
        print(f"  drain: {last} samples still outstanding", flush=True)
        return False

    @interrupt_on_sigterm()  # `timeout`/`kill` too: the phases so far are counted, every role and broker stopped
    def run(self) -> Report:
        t_start = time.time()
        try:
            print(f"experiment {self.exp}; broker {self.brokers.bootstrap}; logs in {self.work / 'logs'}", flush=True)
            self.setup()
            print(f"roles ready after {time.time() - t_start:.0f}s", flush=True)
            try:
                for name, faults in self.plan():
                    self.run_phase(name, faults)
            except (KeyboardInterrupt, SystemExit) as exc:  # a deadline: report the phases so far
                print(f"stopped ({exc or 'interrupt'}); counting the phases so far", flush=True)
                last = self.phases[-1] if self.phases else None
                if last is not None and not last.end:
                    last.end, last.log_lines = time.time(), (last.log_lines[0], _lines(self.trained_log))
            self.ledger.refresh()
            return build_report(self.cfg.kafka, self.topics, self.ledger, self.phases, self.settings(),
                                wall_s=time.time() - t_start)
        finally:
            self.close()

    def close(self) -> None:
        """Stops every role, closes the harness's clients and stops the brokers."""
        self.sup.stop_all()
        if getattr(self, "ledger", None) is not None:
            self.ledger.close()
        for client in (getattr(self, "probe", None), getattr(self, "rollouts", None)):
            if client is not None:
                client.close()
        self.brokers.down()

    def settings(self) -> dict:
        a = vars(self.args).copy()
        a.update(experiment=self.exp, work_dir=str(self.work), brokers=self.brokers.count)
        return a


def _lines(path: Path) -> int:
    return path.read_text().count("\n") if path.exists() else 0
