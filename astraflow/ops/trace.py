"""Follow one task, group, trajectory or sample through every hop of the dataflow (`astraflow trace`).

The hops come from the records themselves, read from the experiment's topics (or an archive of
them), never from logs or counters:

1. **curated**: the `Task` on `tasks`, or on a region's own `tasks.<region>` (`--region-share`,
   carried to that region's cluster by MirrorMaker 2), the topic naming which (curator strategy
   from its lineage, prompt, dataset);
2. **rolled_out**: each `Trajectory` on `rollouts` (node, region, policy versions per turn, tool
   calls and their latencies, timings);
3. **scored**: the same trajectory on `scored` (reward, components, reward strategy);
4. **sample**: each `TrainSample` on `<policy>.train` (policy, advantage, curate's strategies), or
   **dropped**: a `GroupDropped` on `lineage` (the filter slot, its strategy and its reason);
5. **trained**: the `TrainedSamples` on `lineage` that the trainer committed with the version
   that first carries the sample (its trainer step, the version);
6. **processed**: a record of the group on any other stream of the experiment (a user processor's
   sink, `@astraflow.processor`): the processor its lineage names, and that stream;
7. **dead_lettered**: any `DeadLetter` on `dlq` whose original record belongs to the group (who,
   why, from which topic).

Hops are ordered by the time Kafka stored each record. Records of a group share its key on the
data topics, so those are matched by key without decoding; an id that is not a group id is
first resolved to its group by decoding.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator
from dataclasses import asdict, dataclass, field
from typing import Any

from astraflow.archive.format import ArchivedRecord
from astraflow.errors import AstraflowError, SerdeError
from astraflow.kafka.topics import SHARED_STREAMS, Topics
from astraflow.records import DeadLetter, GroupDropped, Task, TrainedSamples, TrainSample, Trajectory
from astraflow.serde import AvroSerde

REASON = "reward.reason"  # metadata key of a reward's reason (RewardResult.notes, astraflow.dataflow.rewards)

# Returns the records of one full topic name (every partition), in any order.
RecordSource = Callable[[str], Iterable[ArchivedRecord]]


class TraceNotFoundError(AstraflowError):
    """No record of the experiment carries the id asked for."""


@dataclass
class Hop:
    """One step of the path: what happened, when Kafka stored it, where, and its details."""

    at_ms: int
    stage: str  # curated | rolled_out | scored | sample | dropped | trained | dead_lettered
    component: str
    topic: str
    partition: int
    offset: int
    ids: dict[str, str] = field(default_factory=dict)  # task_id, group_id, trajectory_id, sample_id
    detail: dict[str, Any] = field(default_factory=dict)


@dataclass
class Trace:
    """Every hop of one id, in time order."""

    query: str
    kind: str  # task | group | trajectory | sample
    group_id: str
    hops: list[Hop]

    def to_json(self) -> dict[str, Any]:
        return asdict(self)


def _ids(rec: Any) -> dict[str, str]:
    return {k: str(getattr(rec, k)) for k in ("task_id", "group_id", "trajectory_id", "sample_id") if getattr(rec, k, None)}


def _refs(lineage: Iterable[Any], app: str | None = None) -> list[str]:
    return [f"{r.app}.{r.slot}={r.name}@v{r.version}" for r in lineage if app is None or r.app == app]


def _turns(t: Trajectory) -> list[dict[str, Any]]:
    out = []
    for seg in t.segments:
        if seg.role != "assistant":
            continue
        versions = sorted({int(v) for v in seg.versions.tolist() if v >= 0})
        out.append({"policy": seg.policy, "versions": versions, "tokens": len(seg.token_ids)})
    return out


def _rollout(t: Trajectory) -> dict[str, Any]:
    tm = t.timings
    return {
        "node": t.node.node_id, "region": t.node.region, "hardware": t.node.hardware, "backend": t.node.backend,
        "status": str(t.status), "error": t.error, "sample_index": t.sample_index, "turns": _turns(t),
        "tool_calls": [{"turn": c.turn, "name": c.name, "latency_s": round(c.latency_s, 4), "error": c.error}
                       for c in t.tool_calls],
        "queued_at": tm.queued_at, "started_at": tm.started_at, "finished_at": tm.finished_at,
        "generate_s": round(tm.generate_s, 4), "tool_s": round(tm.tool_s, 4),
    }


class _Tracer:
    def __init__(self, experiment: str, source: RecordSource, topics: list[str]) -> None:
        self.t = Topics(experiment)
        self.source = source
        self.serde = AvroSerde()
        self.train_topics = sorted(x for x in topics if self.t.of_experiment(x) and x.endswith(".train"))
        # the tasks of every region: region A's topic, then each region's own (Topics.tasks_of)
        self.task_topics = [self.t.tasks, *sorted(x for x in topics if x.startswith(f"{self.t.tasks}."))]
        self.topics = set(topics)
        # Other streams (processors' sinks): not a built-in stream, a region's tasks, or Faust's own topics.
        pre = self.t.prefix
        self.other_topics = sorted(
            x for x in topics if x.startswith(pre) and (s := x.removeprefix(pre)) not in SHARED_STREAMS
            and not s.endswith((".train", ".weights", "-changelog")) and not s.startswith("tasks.") and "__" not in s)

    def records(self, topic: str) -> Iterator[ArchivedRecord]:
        if topic in self.topics:
            yield from self.source(topic)

    def task_records(self) -> Iterator[ArchivedRecord]:
        for topic in self.task_topics:
            yield from self.records(topic)

    def decode(self, r: ArchivedRecord, expect: type | None = None) -> Any:
        if r.value is None:
            return None
        try:
            return self.serde.loads(r.value, expect) if expect else self.serde.loads(r.value)
        except SerdeError:  # not ours to judge here: the DLQ has it if a component refused it
            return None

    def resolve(self, ident: str) -> tuple[str, str]:
        """(kind, group id) of `ident`."""
        key = ident.encode()
        for r in self.task_records():
            if r.key == key:
                return "group", ident
            task = self.decode(r, Task)
            if task is not None and task.task_id == ident:
                return "task", task.group_id
        for topic, kinds in ((self.t.rollouts, ("trajectory_id", "task_id")), (self.t.scored, ("trajectory_id",)),
                             *((tr, ("sample_id", "trajectory_id")) for tr in self.train_topics)):
            for r in self.records(topic):
                rec = self.decode(r)
                for k in kinds:
                    if rec is not None and getattr(rec, k, None) == ident:
                        return k.removesuffix("_id"), rec.group_id
        exp = self.t.experiment
        policy = self.train_topics[0].removeprefix(self.t.prefix).removesuffix(".train") if self.train_topics else "POLICY"
        raise TraceNotFoundError(
            f"no task, group, trajectory or sample {ident!r} on the topics of experiment {exp}: sample ids are "
            f"printed by `astraflow logs show -e {exp} -t {policy}.train`, trajectory ids by `... -t rollouts`, "
            f"group ids by `... -t tasks`")

    def hop(self, r: ArchivedRecord, stage: str, component: str, rec: Any, detail: dict[str, Any]) -> Hop:
        return Hop(r.timestamp_ms, stage, component, r.topic, r.partition, r.offset, _ids(rec), detail)

    def group_hops(self, group: str) -> list[Hop]:
        key, hops = group.encode(), []
        for r in self.task_records():
            if r.key == key and (task := self.decode(r, Task)) is not None and task.group_id == group:
                hops.append(self.hop(r, "curated", "curator", task, {
                    "prompt_id": task.prompt_id, "dataset": task.dataset, "workflow": task.workflow,
                    "policies": task.policies, "n_samples": task.n_samples, "strategy": _refs(task.lineage)}))
        for topic, stage, component in ((self.t.rollouts, "rolled_out", "raas"), (self.t.scored, "scored", "reward")):
            for r in self.records(topic):
                if r.key != key or (t := self.decode(r, Trajectory)) is None or t.group_id != group:
                    continue
                if stage == "rolled_out":
                    detail = _rollout(t)
                else:
                    detail = {"reward": t.reward, "components": dict(t.reward_components),
                              "strategy": _refs(t.lineage, "reward"),
                              **({"reason": t.metadata[REASON]} if REASON in t.metadata else {})}
                hops.append(self.hop(r, stage, component, t, detail))
        samples: set[str] = set()
        for topic in self.train_topics:
            for r in self.records(topic):
                if r.key == key and (s := self.decode(r, TrainSample)) is not None and s.group_id == group:
                    samples.add(s.sample_id)
                    hops.append(self.hop(r, "sample", "curate", s, {
                        "policy": s.policy, "advantage": s.advantage, "reward": s.reward, "min_version": s.min_version,
                        "strategy": _refs(s.lineage, "curate")}))
        for r in self.records(self.t.lineage):
            rec = self.decode(r)
            if isinstance(rec, GroupDropped) and rec.group_id == group:
                hops.append(self.hop(r, "dropped", rec.component, rec, {
                    "filter": rec.filter, "strategy": rec.strategy, "reason": rec.reason, "policy": rec.policy,
                    "trajectory_ids": list(rec.trajectory_ids)}))
            elif isinstance(rec, TrainedSamples) and samples.intersection(rec.sample_ids):
                for sid, step in zip(rec.sample_ids, rec.steps, strict=True):
                    if sid in samples:
                        hops.append(Hop(r.timestamp_ms, "trained", "trainer", r.topic, r.partition, r.offset,
                                        {"group_id": group, "sample_id": sid}, {
                                            "policy": rec.policy, "step": step, "version": rec.version,
                                            "published_at_step": rec.trainer_step, "trainer": rec.instance}))
        for topic in self.other_topics:
            for r in self.records(topic):
                rec = self.decode(r) if r.key == key else None
                if rec is None or getattr(rec, "group_id", None) != group:
                    continue
                ref = next((x for x in reversed(getattr(rec, "lineage", None) or []) if x.slot == "process"), None)
                hops.append(self.hop(r, "processed", ref.app if ref else "?", rec, {
                    "processor": ref.app if ref else "?", "function": ref.name if ref else "?",
                    "version": ref.version if ref else 0, "stream": topic.removeprefix(self.t.prefix)}))
        for r in self.records(self.t.dlq):
            dl = self.decode(r, DeadLetter)
            if dl is None:
                continue
            original = self.serde_or_none(dl.original)
            if getattr(original, "group_id", None) == group or (original is None and dl.original_key == key):
                hops.append(self.hop(r, "dead_lettered", dl.component, original, {
                    "error_class": dl.error_class, "error": dl.error, "strategy": dl.strategy,
                    "from": f"{dl.topic}[{dl.partition}]@{dl.offset}"}))
        hops.sort(key=lambda h: (h.at_ms, _ORDER[h.stage]))
        return hops

    def serde_or_none(self, value: bytes | None) -> Any:
        if not value:
            return None
        try:
            return self.serde.loads(value)
        except SerdeError:
            return None


_ORDER = {s: i for i, s in enumerate(("curated", "rolled_out", "scored", "processed", "sample", "dropped", "trained",
                                       "dead_lettered"))}


def _keep(h: Hop, kind: str, ident: str, trajectories: set[str], samples: set[str]) -> bool:
    """Within the group, the hops of one trajectory (and its samples) or one sample."""
    if kind in ("group", "task") or h.stage == "curated":
        return True
    if h.stage == "dropped":
        return bool(trajectories.intersection(h.detail["trajectory_ids"]))
    if "sample_id" in h.ids:
        return h.ids["sample_id"] in samples
    return h.ids.get("trajectory_id") in trajectories or not h.ids.get("trajectory_id")


def trace(experiment: str, ident: str, source: RecordSource, topics: list[str]) -> Trace:
    """Every hop of `ident` (a task, group, trajectory or sample id) in the records `source` reads."""
    tracer = _Tracer(experiment, source, topics)
    kind, group = tracer.resolve(ident)
    hops = tracer.group_hops(group)
    if kind in ("trajectory", "sample"):
        by_sample = {h.ids.get("sample_id"): h.ids.get("trajectory_id") for h in hops if h.stage == "sample"}
        trajectories = {ident} if kind == "trajectory" else {by_sample.get(ident) or ""}
        samples = {s for s, t in by_sample.items() if s and t in trajectories} if kind == "trajectory" else {ident}
        hops = [h for h in hops if _keep(h, kind, ident, trajectories, samples)]
    return Trace(ident, kind, group, hops)
