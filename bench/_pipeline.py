"""The real AstraFlow pipeline as a benchmark subject: the demo's roles as separate processes on Kafka.

`run_pipeline` runs one experiment on its own topics: `astraflow app run curator` (the tasks of
`_rl.make_tasks`, in a dataset file), `app run reward`, `app run curate`, `astraflow train`
(batches of exactly 64 samples: `trainer.max_wait_s` is long, so no partial batch) and one
`astraflow raas serve` node (decode batches of 64, up to 71 rollouts in flight, one torch thread, the
calculator behind `--tool-latency calc=MEDIAN:SIGMA`). Nothing is simulated: tasks, trajectories,
scored trajectories, train samples and weights all go through Kafka, in Avro.

Two modes differ ONLY in the curator's `--max-ahead` (tasks between the curator and the
trainer, counted until the trainer has consumed their samples):

* **sync**: max-ahead 8 = one trainer batch. The curator issues 8 prompts, and only when the
  trainer has consumed their samples (it has trained on them) does it issue the next 8: the
  trainer-centred barrier, run on the same processes. One difference from a textbook sync loop,
  in its favour: the node may start the next batch a moment before it applies the new weights
  (staleness at most 1).
* **dataflow**: max-ahead 8 x (1 + staleness): the curator keeps `staleness` batches in flight
  beyond the one being trained, so rollouts, tools and training overlap.

The benchmark process pauses the curator (control topic) while the roles start, waits until the
node, reward and curate have joined their consumer groups and the trainer has published its
version 0, then resumes it. The clock
starts at the first task's Kafka timestamp and stops when the records of version `steps` have all
arrived at the benchmark process (`_weight_tap.WeightTap`, which only collects the weights
stream during the run); after the run the tap replays them through a `WeightFollower` for a copy
of the weights every `eval_every` versions (the bits `KafkaWeightFollower` gives), and
`_rl.score_snapshots` scores those (neither decoding nor evaluation costs the run anything). Curate's two filters that drop trajectories the other modes train are switched off
on the control topic: `filter.zero_variance` (groups whose 8 rewards are equal) and
`filter.length` (rollouts that hit the token limit). So every group is trained, as in the
in-process modes and in TRL, and a step costs the same 64 rollouts everywhere;
`product_filters=True` keeps curate's defaults (more rollouts per trained sample).

Ended by Ctrl-C, `timeout` or `kill` (SIGINT or SIGTERM), a run stops its role processes and
deletes its topics before it exits (`interrupt_on_sigterm`).
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import tempfile
import threading
import time
import uuid
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import _rl
from _weight_tap import WeightTap
from confluent_kafka import Consumer, TopicPartition
from confluent_kafka.admin import AdminClient

from astraflow.config import AstraflowConfig, load_config
from astraflow.control import ControlWriter
from astraflow.demo.common import PY, role_env
from astraflow.demo.supervisor import Role, Supervisor
from astraflow.kafka.clients import reader, watermarks
from astraflow.kafka.topics import TopicAdmin, Topics, topic_specs
from astraflow.records import Metric, Task

READY_TIMEOUT_S = 180.0
IDLE_PROBE_S = 2.0  # the roles' CPU is also measured this long while they are ready and idle, before the run


def write_dataset(tasks: list[Task], path: Path) -> Path:
    path.write_text("".join(json.dumps({"id": t.prompt_id, "prompt": t.prompt, "reference": t.reference,
                                        "dataset": t.dataset}) + "\n" for t in tasks))
    return path


@dataclass(frozen=True)
class PipelineSpec:
    """What the pipeline's role processes run (shared by the benchmarks and the fault harness)."""

    model_dir: str  # the policy's model (trainer and nodes)
    dataset: Path  # the curator's JSONL
    run_dir: Path  # the trainer's run directory (checkpoints, logs)
    workflow: str  # curator: workflow of every task
    n_samples: int  # curator: samples per task (one group)
    max_ahead: int  # curator: tasks ahead of the trainer
    max_tokens: int  # curator: tokens per model call
    max_turns: int  # curator: model turns per rollout
    batch_size: int  # trainer: samples per optimizer step
    max_wait_s: float  # trainer: longest wait for a full batch
    node_inflight: int  # node: its decode batch (rollouts in flight: this + n_samples - 1, see node_role)
    node_prefetch: int  # node: tasks fetched ahead
    seed: int = 0  # node i samples with seed + i
    node_extra: tuple[str, ...] = ()  # more `raas serve` options
    curate_extra: tuple[str, ...] = ()  # more `app run curate` options
    trainer_sets: tuple[str, ...] = ()  # more `--set key=value` of the trainer
    trainer_threads: int = 1  # trainer: torch intra-op threads (OMP_NUM_THREADS of its process; other roles 1)


def node_role(exp: str, spec: PipelineSpec, env: dict[str, str], index: int) -> Role:
    """RaaS node `raas-<index>` (1-based): `node_inflight` decode rows and up to `n_samples - 1`
    rollouts beyond them, waiting in the engine, so a row that frees is refilled in the same step
    without waiting for the node's turnaround (docs/raas.md, "How many rollouts a node runs")."""
    return Role(f"raas-{index}", [*PY, "raas", "serve", "-e", exp, "-p", f"policy={spec.model_dir}", "--max-inflight",
                                  str(spec.node_inflight + spec.n_samples - 1), "--max-batch", str(spec.node_inflight),
                                  "--prefetch",
                                  str(spec.node_prefetch), "--threads", "1", "--seed", str(spec.seed + index - 1),
                                  "--node-id", f"raas-{index}", *spec.node_extra], env)


def app_role(exp: str, spec: PipelineSpec, env: dict[str, str], app: str, name: str | None = None) -> Role:
    """Stream app `reward` or `curate` (several workers of one app share its consumer group)."""
    extra = ["--policy", "policy", *spec.curate_extra] if app == "curate" else []
    return Role(name or app, [*PY, "app", "run", app, "-e", exp, *extra], env)


def pipeline_roles(exp: str, spec: PipelineSpec, env: dict[str, str], nodes: int = 1) -> list[Role]:
    """curator, reward, curate, trainer and `nodes` RaaS nodes, as `Supervisor` roles with `env`
    (`astraflow.demo.common.role_env`, plus any setting all roles share)."""
    sets = [f"run_dir={spec.run_dir}", f"trainer.lr={_rl.LR}", f"trainer.batch_size={spec.batch_size}",
            f"trainer.max_wait_s={spec.max_wait_s}", "trainer.progress_bar=false", "trainer.publish_dtype=float32",
            *spec.trainer_sets]
    return [
        Role("curator", [*PY, "app", "run", "curator", "-e", exp, "--policy", "policy", "--dataset", str(spec.dataset),
                         "--workflow", spec.workflow, "--n-samples", str(spec.n_samples), "--max-ahead",
                         str(spec.max_ahead), "--temperature", "1.0", "--max-tokens", str(spec.max_tokens),
                         "--max-turns", str(spec.max_turns)], env),
        app_role(exp, spec, env, "reward"),
        app_role(exp, spec, env, "curate"),
        Role("trainer", [*PY, "train", "-e", exp, "-p", "policy", "-m", spec.model_dir,
                         *[a for kv in sets for a in ("--set", kv)]], {**env, "OMP_NUM_THREADS": str(spec.trainer_threads)}),
        *[node_role(exp, spec, env, i + 1) for i in range(nodes)],
    ]


def _roles(exp: str, mode: str, workload: str, sigma: float, *, staleness: int, median_s: float, seed: int,
           model_dir: str, dataset: Path, run_dir: Path, bootstrap: str, trainer_threads: int = 1) -> list[Role]:
    w = _rl.WORKLOADS[workload]
    ahead = _rl.PROMPTS_PER_STEP * (1 if mode == "sync" else 1 + staleness)
    spec = PipelineSpec(model_dir, dataset, run_dir, w["workflow"], _rl.GROUP, ahead, w["max_tokens"], w["max_turns"],
                        _rl.SLOTS, 600, _rl.SLOTS, ahead, seed, ("--tool-latency", f"calc={median_s}:{sigma}"),
                        trainer_threads=trainer_threads)
    return pipeline_roles(exp, spec, role_env(bootstrap))


def create_experiment(cfg: AstraflowConfig, exp: str, *, filters_off: tuple[str, ...],
                      policies: tuple[str, ...] = ("policy",)) -> tuple[list, ControlWriter]:
    """The experiment's topics for `policies`, and its control topic set so: curator paused, curate's
    `filters_off` off.

    Returns (topic specs, control writer)."""
    specs = topic_specs(exp, list(policies), cfg.topics)
    TopicAdmin(cfg.kafka).create(specs, cfg.topics.replication_factor)
    control = ControlWriter(cfg.kafka, exp)
    control.set("curator", "pause", "on", issued_by="bench")
    for slot in filters_off:
        control.set("curate", slot, "off", issued_by="bench")
    return specs, control


def wait_ready(admin: AdminClient, groups: list[str], probe: Consumer, weights: str, sup: Supervisor,
                timeout_s: float) -> None:
    """Until every group has a member (those roles have loaded their models and subscribed) and the
    trainer (which reads assigned partitions, without a group) has published its version 0."""
    deadline = time.monotonic() + timeout_s
    while True:
        sup.check()
        done = {g: f.result() for g, f in admin.describe_consumer_groups(groups, request_timeout=10).items()}
        missing = [g for g, d in done.items() if not d.members]
        if watermarks(probe, weights)[1] == 0:
            missing.append("the trainer's version 0")
        if not missing:
            return
        if time.monotonic() > deadline:
            raise TimeoutError(f"roles not ready after {timeout_s:.0f}s: waiting for {missing}; see the role logs")
        time.sleep(0.5)


def _processes() -> dict[int, tuple[str, int, int, float, int]]:
    """Every live process: pid -> (command name, parent pid, session, user + system CPU s, threads)."""
    out, tick = {}, os.sysconf("SC_CLK_TCK")
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            text = stat.read_text()
            name, rest = text.split(" (", 1)[1].rsplit(")", 1)
            f = rest.split()
            out[int(stat.parent.name)] = (name, int(f[1]), int(f[3]), (int(f[11]) + int(f[12])) / tick, int(f[17]))
        except (OSError, IndexError, ValueError):
            pass
    return out


def machine_busy_s() -> float:
    """CPU seconds the whole machine has spent busy since boot (all cores; /proc/stat, not idle or iowait)."""
    fields = [int(x) for x in Path("/proc/stat").read_text().split("\n", 1)[0].split()[1:9]]
    return (sum(fields) - fields[3] - fields[4]) / os.sysconf("SC_CLK_TCK")


class CpuAccount:
    """Where the cores went between creation and `stop`: CPU seconds of each role's process and
    of its descendants (`<role>+`: the node's engine process, in a session of its own), of this
    process, of the other processes by command name (the broker is `java`) and of the machine. A
    process that ended in between is not counted (none of the pipeline's does)."""

    def __init__(self, sup: Supervisor) -> None:
        self.roles = {r.proc.pid: r.name for r in sup.roles if r.proc is not None}
        self.start = _processes()
        self.t0, self.busy0 = time.monotonic(), machine_busy_s()
        self.cpu: dict[str, float] = {}
        self.threads: dict[str, int] = {}
        self.wall = self.machine = 0.0

    def _owner(self, procs: dict[int, tuple[str, int, int, float, int]], pid: int) -> str:
        """The role whose process tree holds `pid` (`<role>+` below the role's own process), else
        this process ('bench'), else 'other:<command name>'."""
        at = pid
        for _ in range(64):
            if at in self.roles:
                return self.roles[at] + ("" if at == pid else "+")
            if at == os.getpid():
                return "bench"
            if at not in procs or procs[at][1] <= 1:
                break
            at = procs[at][1]
        return f"other:{procs[pid][0]}"

    def stop(self) -> None:
        procs = _processes()
        self.wall, self.machine = time.monotonic() - self.t0, machine_busy_s() - self.busy0
        self.cpu = {name: 0.0 for name in self.roles.values()}
        for pid, (_, _, _, cpu, n) in procs.items():
            owner = self._owner(procs, pid)
            was = self.start.get(pid)
            self.cpu[owner] = self.cpu.get(owner, 0.0) + cpu - (was[3] if was else 0.0)
            if not owner.startswith("other:") and owner != "bench":
                self.threads[owner.rstrip("+")] = self.threads.get(owner.rstrip("+"), 0) + n

    def notes(self, prefix: str = "") -> dict[str, float]:
        """`cpu_s.<role>` (and `cpu_s.<role>+`), `cpu_s.bench`, `cpu_s.other:<command>` (the three
        largest, the rest summed as `cpu_s.other`), `cpu_s.machine` (/proc/stat's busy time, the
        kernel's included), `cores_busy` (machine / wall) and `threads.<role>` (at the end); every
        name after `prefix`."""
        others = sorted(((k, v) for k, v in self.cpu.items() if k.startswith("other:")), key=lambda kv: -kv[1])
        out = {f"cpu_s.{k}": round(v, 2) for k, v in self.cpu.items() if not k.startswith("other:")}
        out.update({f"cpu_s.{k}": round(v, 2) for k, v in others[:3]})
        out["cpu_s.other"] = round(sum(v for _, v in others[3:]), 2)
        out["cpu_s.machine"] = round(self.machine, 2)
        out["cores_busy"] = round(self.machine / self.wall, 2) if self.wall > 0 else 0.0
        out.update({f"threads.{k}": float(v) for k, v in self.threads.items()})
        return {prefix + k: v for k, v in out.items()}


def print_cpu(notes: dict[str, float], prefix: str = "", what: str = "over the run") -> None:
    got = {k.removeprefix(prefix): v for k, v in notes.items() if k.startswith(prefix)}
    cpu = {k.removeprefix("cpu_s."): v for k, v in got.items() if k.startswith("cpu_s.")}
    if cpu:
        print(f"  CPU s {what} ({got.get('cores_busy', 0):.2f} cores busy): " + ", ".join(f"{k} {v:.1f}" for k, v in cpu.items()))
        print("    threads at the end: " + ", ".join(f"{k.removeprefix('threads.')} {int(v)}" for k, v in got.items()
                                                 if k.startswith("threads.")))


def _first_timestamp_s(consumer: Consumer, topic: str, partitions: int) -> float | None:
    """Kafka timestamp (seconds) of the earliest record over the topic's partitions."""
    first = []
    for p in range(partitions):
        low, high = watermarks(consumer, topic, p)
        if high > low:
            consumer.assign([TopicPartition(topic, p, low)])
            msg = consumer.poll(10)
            if msg is not None and msg.error() is None:
                first.append(msg.timestamp()[1] / 1000)
    return min(first) if first else None


def _end_offsets(consumer: Consumer, topic: str, partitions: int) -> int:
    return sum(watermarks(consumer, topic, p)[1] for p in range(partitions))


def _timestamps_s(consumer: Consumer, topic: str, partitions: int, offsets: list[int] | None = None) -> list[float]:
    """Kafka timestamps (seconds) of every record of the topic, sorted. All partitions are read at
    once; a partition whose last offsets are transaction markers (never returned) ends the read
    when nothing more has come for a second. `offsets` gets the offsets the topic holds (records
    and transaction markers: their difference counts the transactions that wrote to it)."""
    bounds = {p: watermarks(consumer, topic, p) for p in range(partitions)}
    if offsets is not None:
        offsets.append(sum(high - low for low, high in bounds.values()))
    todo = {p for p, (low, high) in bounds.items() if high > low}
    consumer.assign([TopicPartition(topic, p, bounds[p][0]) for p in todo])
    out: list[float] = []
    wait = 10.0  # the first fetch
    while todo:
        msg = consumer.poll(wait)
        if msg is None:
            break
        wait = 1.0
        if msg.error() is None:
            out.append(msg.timestamp()[1] / 1000)
            if msg.offset() >= bounds[msg.partition()][1] - 1:
                todo.discard(msg.partition())
    return sorted(out)


def stage_timeline(consumer: Consumer, topics: Topics, partitions: int, t0: float, steps: int,
                   versions: dict[int, float], trained: dict[int, float]) -> dict[str, list[float | None]]:
    """Where each optimizer step's time went: for step k (1..steps), seconds from the first task
    until the curator had issued 8k tasks, the node had published 64k rollouts (and the first of
    each: task 8k - 7, rollout 64k - 63), reward 64k scored trajectories, curate 64k train
    samples, the trainer ended step k (its metrics' timestamp) and
    the weights of version k reached this process (`versions`). `run_pipeline` adds the trainer's
    own durations per step (`trainer_step_s`: forward, backward, optimizer; `trainer_checkpoint_s`;
    `trainer_publish_s`: finite check, checkpoint, sample log, weights transaction; and the parts of a
    step: `trainer_cycle_s` from one step's start to the next, `trainer_fetch_s`, `trainer_collate_s`,
    `trainer_commit_s`, `trainer_forward_s`, `trainer_backward_s`, `trainer_optimizer_s`; `trainer_send_s`: the
    last checkpoint write and publication the background thread finished)."""
    per, group = _rl.SLOTS, _rl.PROMPTS_PER_STEP

    def marks(times: list[float], every: int, first: bool = False) -> list[float | None]:
        at = [(k - 1) * every if first else k * every - 1 for k in range(1, steps + 1)]
        return [round(times[i] - t0, 3) if len(times) > i else None for i in at]

    tasks, rollouts = _timestamps_s(consumer, topics.tasks, partitions), _timestamps_s(consumer, topics.rollouts, partitions)
    held: list[int] = []
    scored, train = (_timestamps_s(consumer, topics.scored, partitions, held),
                     _timestamps_s(consumer, topics.train("policy"), partitions, held))
    return {
        "tasks_issued": marks(tasks, group),
        "rolled_out": marks(rollouts, per),
        "first_task": marks(tasks, group, first=True),  # the step's first task, and its first rollout (the node's tail)
        "first_rollout": marks(rollouts, per, first=True),
        "scored": marks(scored, per),
        "train_samples": marks(train, per),
        # transaction markers over the run (offsets - records), one per partition a commit wrote to:
        # how many transactions reward and curate committed (stage_timeline's one-value columns)
        "scored_markers": [held[0] - len(scored)],
        "train_markers": [held[1] - len(train)],
        "trainer_step_end": [round(trained[k] - t0, 3) if k in trained else None for k in range(1, steps + 1)],
        "weights_here": [round(versions[k] - t0, 3) if k in versions else None for k in range(1, steps + 1)],
    }


def print_timeline(timeline: dict[str, list[float | None]]) -> None:
    names = [n for n in timeline if len(timeline[n]) == len(timeline["tasks_issued"])]
    print("  step " + " ".join(f"{n:>16}" for n in names))
    for k in range(len(timeline[names[0]])):
        print(f"  {k + 1:>4} " + " ".join(f"{'-' if timeline[n][k] is None else f'{timeline[n][k]:.2f}':>16}"
                                           for n in names))
    if "scored_markers" in timeline:
        print(f"  transactions (markers) on scored: {timeline['scored_markers'][0]}, on train: {timeline['train_markers'][0]}")


def _trainer_metric_records(consumer: Consumer, topic: str) -> Iterator[Metric]:
    """The trainer's Metric records on the metrics topic (one partition), in order, up to its end now."""
    from astraflow.serde import AvroSerde

    serde = AvroSerde()
    low, high = watermarks(consumer, topic)
    consumer.assign([TopicPartition(topic, 0, low)])
    pos = low
    while pos < high:
        msg = consumer.poll(5)
        if msg is None:
            break
        pos = msg.offset() + 1
        if msg.error() is None:
            rec = serde.loads(msg.value())
            if isinstance(rec, Metric) and rec.component == "trainer":
                yield rec


def _trainer_step_times(consumer: Consumer, topic: str) -> dict[int, float]:
    """Kafka-independent end time (the metric's own timestamp, s) of each trainer step."""
    out: dict[int, float] = {}
    for rec in _trainer_metric_records(consumer, topic):
        if "step" in rec.labels:
            out.setdefault(int(rec.labels["step"]), rec.ts / 1000)
    return out


def _trainer_metrics(consumer: Consumer, topic: str) -> dict[str, list[float]]:
    """The trainer's per-step metrics on the metrics topic (one partition), by name, in step order."""
    out: dict[str, list[float]] = {}
    for rec in _trainer_metric_records(consumer, topic):
        if "bucket" not in rec.labels:
            out.setdefault(rec.name.removeprefix("trainer."), []).append(rec.value)
    return out


@contextlib.contextmanager
def interrupt_on_sigterm() -> Iterator[None]:
    """Within it (or the function it decorates), SIGTERM raises KeyboardInterrupt in the main
    thread, so the cleanup that runs on Ctrl-C (stopping the role processes, which run in sessions
    of their own and outlive the benchmark otherwise, and deleting the run's topics) also runs when
    `timeout` or `kill` ends the benchmark. Only the first SIGTERM interrupts; later ones are
    ignored until the block has exited, so they cannot cut the cleanup short. The previous handler
    is restored at the exit. Outside the main thread (where Python cannot set handlers) nothing
    changes."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return

    def interrupt(signum: int, frame: object) -> None:
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
        raise KeyboardInterrupt(f"signal {signum}")

    previous = signal.signal(signal.SIGTERM, interrupt)
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, previous)


@interrupt_on_sigterm()
def run_pipeline(mode: str, workload: str, sigma: float, *, steps: int, eval_every: int,
                 staleness: int, seed: int, median_s: float, model_dir: str, tasks: list[Task],
                 heldout: list[tuple[str, str]], cfg: AstraflowConfig | None = None,
                 work_dir: Path = Path(tempfile.gettempdir()) / "astraflow-bench", timeout_s: float = 1800.0,
                 product_filters: bool = False, trainer_threads: int = 1) -> _rl.Run:
    """One run of the multi-process pipeline (see the module doc); returns it scored.

    `cfg` defaults to the environment's config (the local broker); role logs stay under `work_dir`;
    `trainer_threads`: the trainer's torch threads (every other role runs 1)."""
    from astraflow.models.tiny import load_tiny

    cfg = cfg or load_config()
    exp = f"bench-{mode}-{uuid.uuid4().hex[:8]}"
    run_dir = work_dir / exp
    run_dir.mkdir(parents=True, exist_ok=True)
    specs, control = create_experiment(cfg, exp, filters_off=() if product_filters else ("filter.zero_variance", "filter.length"))
    topic_admin = TopicAdmin(cfg.kafka)
    topics = Topics(exp)
    sup = Supervisor(run_dir / "logs")
    tap = WeightTap(cfg.kafka, exp)
    probe = reader(cfg.kafka, f"{exp}-probe")
    run = _rl.Run(f"pipeline-{mode}", workload, sigma)
    base, tokenizer = load_tiny(model_dir)
    try:
        for role in _roles(exp, mode, workload, sigma, staleness=staleness, median_s=median_s, seed=seed,
                           model_dir=model_dir, dataset=write_dataset(tasks, run_dir / "train.jsonl"), run_dir=run_dir,
                           bootstrap=cfg.kafka.bootstrap_servers, trainer_threads=trainer_threads):
            sup.start(role)
        admin = AdminClient(cfg.kafka.client_config())
        wait_ready(admin, [topics.raas_group, topics.group("reward"), topics.group("curate")], probe, topics.weights("policy"),
                    sup, READY_TIMEOUT_S)
        tap.start()
        run.snapshots.append((0, 0.0, {k: v.detach().clone() for k, v in base.state_dict().items()}))
        idle = CpuAccount(sup)  # the roles ready, the curator paused: what they cost doing nothing
        time.sleep(IDLE_PROBE_S)
        idle.stop()
        cpu = CpuAccount(sup)
        control.set("curator", "pause", "off", issued_by="bench")
        deadline = time.monotonic() + timeout_s
        while True:
            tap.poll(timeout_s=0.2)  # collects only: the weights are decoded after the run
            version = tap.version or 0
            if version >= steps:
                cpu.stop()
                rolled_out = _end_offsets(probe, topics.rollouts, cfg.topics.partitions)  # first: the pipeline goes on
                break
            sup.check()
            if time.monotonic() > deadline:
                raise TimeoutError(f"version {steps} not published within {timeout_s:.0f}s (at {version}); logs in "
                                   f"{run_dir / 'logs'}")
        arrivals, seen = tap.replay(eval_every, steps)  # snapshots at the marks; version -> when it arrived here
        parts = cfg.topics.partitions
        t0 = _first_timestamp_s(probe, topics.tasks, parts)
        assert t0 is not None, "no task was issued"
        run.wall_s = arrivals[-1][1] - t0
        run.snapshots += [(v, t - t0, s) for v, t, s in arrivals]
        run.trained = steps * _rl.SLOTS
        run.trajectories = rolled_out
        run.notes["tasks_issued"] = float(_end_offsets(probe, topics.tasks, parts))
        metrics = _trainer_metrics(probe, topics.metrics)
        run.train_reward = metrics.get("reward", [])[:steps]
        stale = metrics.get("staleness_mean", [])[:steps]
        run.notes["staleness_mean"] = sum(stale) / len(stale) if stale else None
        run.stages = stage_timeline(probe, topics, parts, t0, steps, seen,
                                    _trainer_step_times(probe, topics.metrics))
        for name in ("step_s", "checkpoint_s", "publish_s", "cycle_s", "fetch_s", "collate_s", "commit_s", "forward_s",
                     "backward_s", "optimizer_s", "send_s"):  # the trainer's own durations per step
            run.stages[f"trainer_{name}"] = [round(v, 3) for v in metrics.get(name, [])[:steps]]
        print_timeline(run.stages)
        run.notes.update(cpu.notes())
        run.notes.update(idle.notes("idle."))
        print_cpu(run.notes)
        print_cpu(run.notes, "idle.", f"in {IDLE_PROBE_S:.0f} s before the run, idle")
    finally:
        sup.stop_all()
        tap.close()
        probe.close()
        topic_admin.delete([s.name for s in specs])
    _rl.score_snapshots(run, base, tokenizer, heldout)
    return run
