"""What a running experiment is doing, measured from its topics: `collect_status` -> `StatusReport`.

Sources, all read without joining a consumer group:
- topics: committed records (`astraflow.kafka.counts`: what a consumer reads, transaction markers
  left out) and rates (records written in the last `window_s`, divided by it: a rate from one
  sample, no waiting);
- consumer lag of every group named `af.<experiment>.*` (RaaS, reward, curate, trainer, archive,
  user processors), in records;
- the `metrics` topic: the latest value of every series; RaaS nodes, trainers, stream apps and
  user processors (records in, out, dead-lettered) are built from it;
- the `policies` topic: the latest PolicyVersion per policy;
- the last `recent` trajectories of `scored`: reward, and staleness (latest published version of
  the policy minus the oldest version among the tokens the policy generated);
- the `dlq`: how many records, and the last few reasons.
"""

from __future__ import annotations

import math
from collections import Counter
from contextlib import closing
from dataclasses import asdict, dataclass, field
from typing import Any

from astraflow.config import KafkaSettings
from astraflow.errors import SerdeError, TopicError
from astraflow.kafka.counts import RecordCounter
from astraflow.kafka.offsets import TP
from astraflow.kafka.topics import Topics, missing_experiment
from astraflow.ops.cluster_offsets import GroupLag, OffsetReader, PartitionOffsets, group_lags, read_ranges
from astraflow.ops.provenance import Provenance
from astraflow.ops.scaling import AutoscaleSignal, RegionStatus, autoscale_of, regions_of
from astraflow.processor import COMPONENT_PREFIX
from astraflow.records import DeadLetter, Metric, PolicyVersion, Trajectory, now_ms
from astraflow.serde import AvroSerde

# Labels that change with every record; a series is identified without them.
VOLATILE_LABELS = frozenset({"step"})
STREAM_APPS = ("curator", "reward", "curate")  # built-in apps; user processors report as `proc.<name>`
RUNNING_WITHIN_S = 60.0  # an experiment none of whose roles reported for this long is not running


@dataclass
class TopicStatus:
    """One topic of the experiment."""

    name: str
    stream: str  # the name without the af.<experiment>. prefix
    partitions: int
    records: int  # committed records stored now: what a consumer reads (transaction markers left out)
    offsets: int  # offsets they span (high - low, summed): records + markers + aborted records
    rate_per_s: float  # records written in the last window, per second
    exact: bool = True  # False: part of the topic could not be read in time; `records` is then an upper bound
    end_offset: int = 0  # high watermarks summed (offsets, markers included: for rate() in Prometheus, not a count)


@dataclass
class NodeStatus:
    """A RaaS node, as its latest metrics describe it."""

    node_id: str
    hardware: str
    region: str
    backend: str
    versions: dict[str, int]  # policy -> version the node serves
    rollouts_per_s: float
    tokens_per_s: float
    inflight: float
    rollouts_total: float
    last_seen_s: float  # seconds since its last metric


@dataclass
class PolicyStatus:
    """One policy: the latest published version and its trainer's latest figures."""

    policy: str
    version: int | None  # from the policies topic
    kind: str | None  # SNAPSHOT | DELTA
    trainer_step: int | None  # step of the newest trainer metric, else of the published version
    trained_samples: int | None
    published_s_ago: float | None
    trainer: dict[str, float] = field(default_factory=dict)  # trainer.<name> -> latest value
    trainer_instance: str | None = None


@dataclass
class StalenessStatus:
    """Versions behind the latest published one, over the recent scored trajectories."""

    samples: int
    mean: float | None
    p50: float | None
    p90: float | None
    max: int | None
    histogram: dict[int, int] = field(default_factory=dict)  # versions behind -> trajectories


@dataclass
class RewardStatus:
    """Reward of the recent scored trajectories."""

    samples: int
    mean: float | None
    positive_fraction: float | None  # share with reward > 0


@dataclass
class DlqStatus:
    """The dead-letter topic."""

    records: int
    rate_per_s: float
    recent: list[dict[str, Any]] = field(default_factory=list)  # newest first: component, error_class, error, topic


@dataclass
class AppStatus:
    """A stream app (reward, curate, curator) or a user processor (`proc.<name>`), from its workers' metrics."""

    component: str
    workers: int  # instances that reported within the metrics lookback
    records_in: int
    records_out: int
    dead_lettered: int
    dropped: int
    in_per_s: float  # over the last report of each worker
    last_seen_s: float
    source: str = ""  # a processor's source and sink streams (its metrics' labels); "" for the built-in apps
    sink: str = ""


@dataclass
class MetricSeries:
    """The latest value of one metric series (component, instance, name, labels)."""

    component: str
    instance: str
    name: str
    value: float
    labels: dict[str, str]
    ts: int


@dataclass
class StatusReport:
    """Everything `astraflow status` shows."""

    experiment: str
    bootstrap_servers: str
    taken_at: int  # ms since the epoch
    window_s: float
    topics: list[TopicStatus]
    lags: list[GroupLag]
    nodes: list[NodeStatus]
    policies: list[PolicyStatus]
    staleness: StalenessStatus
    reward: RewardStatus
    dlq: DlqStatus
    metrics: list[MetricSeries]
    undecodable: int  # records status could not decode (they are the DLQ's business, not ours)
    regions: list[RegionStatus] = field(default_factory=list)  # RaaS nodes per region (astraflow.ops.scaling)
    autoscale: AutoscaleSignal | None = None  # the RaaS autoscaling signal and its rule's answer (None: not running)
    apps: list[AppStatus] = field(default_factory=list)  # stream apps and user processors
    running: bool = True  # some role reported a metric within `RUNNING_WITHIN_S`
    # Metric series whose newest record no key of their component's role signed (a node claiming
    # another's identity, a host without the role's key): shown apart, in no figure above.
    unverified: list[MetricSeries] = field(default_factory=list)
    refused_versions: int = 0  # `policies` records no trainer key signed (not believed)

    def to_json(self) -> dict[str, Any]:
        return asdict(self)


def _quantile(sorted_values: list[int], q: float) -> float | None:
    if not sorted_values:
        return None
    return float(sorted_values[min(len(sorted_values) - 1, max(0, math.ceil(q * len(sorted_values)) - 1))])


def staleness_of(trajectories: list[Trajectory], latest: dict[str, int]) -> StalenessStatus:
    """Versions behind per trajectory (its stalest policy); trajectories of unpublished policies are left out."""
    lags: list[int] = []
    for traj in trajectories:
        behind = [max(0, latest[p] - v) for p, (v, _) in traj.trained_versions().items() if p in latest and v >= 0]
        if behind:
            lags.append(max(behind))
    lags.sort()
    return StalenessStatus(
        samples=len(lags),
        mean=sum(lags) / len(lags) if lags else None,
        p50=_quantile(lags, 0.5),
        p90=_quantile(lags, 0.9),
        max=lags[-1] if lags else None,
        histogram=dict(sorted(Counter(lags).items())),
    )


def reward_of(trajectories: list[Trajectory]) -> RewardStatus:
    rewards = [t.reward for t in trajectories if t.reward is not None]
    if not rewards:
        return RewardStatus(0, None, None)
    return RewardStatus(len(rewards), sum(rewards) / len(rewards), sum(r > 0 for r in rewards) / len(rewards))


def series_key(m: Metric | MetricSeries) -> tuple:
    """What identifies a series: volatile labels (the step) are kept in values but do not split series."""
    return (m.component, m.instance, m.name, tuple(sorted((k, v) for k, v in m.labels.items() if k not in VOLATILE_LABELS)))


def latest_series(metrics: list[Metric]) -> list[MetricSeries]:
    """The newest record of each series."""
    latest: dict[tuple, Metric] = {}
    for m in metrics:
        key = series_key(m)
        if key not in latest or m.ts >= latest[key].ts:
            latest[key] = m
    return [MetricSeries(m.component, m.instance, m.name, m.value, dict(m.labels), m.ts) for m in latest.values()]


def nodes_of(series: list[MetricSeries], now: int) -> list[NodeStatus]:
    by_node: dict[str, list[MetricSeries]] = {}
    for s in series:
        if s.component == "raas":
            by_node.setdefault(s.instance, []).append(s)
    out = []
    for node_id, items in sorted(by_node.items()):
        labels: dict[str, str] = {}
        for s in sorted(items, key=lambda s: s.ts):
            labels.update(s.labels)
        value = {s.name: s.value for s in items if s.name != "policy_version"}
        versions = {s.labels.get("policy", "?"): int(s.value) for s in items if s.name == "policy_version"}
        out.append(NodeStatus(
            node_id=node_id, hardware=labels.get("hardware", "?"), region=labels.get("region", "?"),
            backend=labels.get("backend", "?"), versions=dict(sorted(versions.items())),
            rollouts_per_s=value.get("rollouts_per_s", 0.0), tokens_per_s=value.get("tokens_per_s", 0.0),
            inflight=value.get("inflight", 0.0), rollouts_total=value.get("rollouts_total", 0.0),
            last_seen_s=max(0.0, (now - max(s.ts for s in items)) / 1000),
        ))
    return out


def policies_of(series: list[MetricSeries], versions: list[PolicyVersion], now: int) -> list[PolicyStatus]:
    latest: dict[str, PolicyVersion] = {}
    for pv in versions:
        if pv.policy not in latest or pv.version >= latest[pv.policy].version:
            latest[pv.policy] = pv
    trainer: dict[str, list[MetricSeries]] = {}
    for s in series:
        if s.component == "trainer" and "policy" in s.labels:
            trainer.setdefault(s.labels["policy"], []).append(s)
    out = []
    for policy in sorted(set(latest) | set(trainer)):
        pv = latest.get(policy)
        items = trainer.get(policy, [])
        newest = max(items, key=lambda s: s.ts) if items else None
        # Only the instance that reported last: a restarted trainer's predecessor is history.
        current = [s for s in items if newest is not None and s.instance == newest.instance and "bucket" not in s.labels]
        step = newest.labels.get("step") if newest else None
        out.append(PolicyStatus(
            policy=policy,
            version=pv.version if pv else None,
            kind=str(pv.kind) if pv else None,
            trainer_step=int(step) if step and step.isdigit() else (pv.trainer_step if pv else None),
            trained_samples=pv.trained_samples if pv else None,
            published_s_ago=max(0.0, (now - pv.created_at) / 1000) if pv else None,
            trainer={s.name.removeprefix("trainer."): s.value for s in sorted(current, key=lambda s: s.name)},
            trainer_instance=newest.instance if newest else None,
        ))
    return out


def apps_of(series: list[MetricSeries], now: int) -> list[AppStatus]:
    """Per stream app and user processor: their workers' counters, summed (each worker counts the
    records of its own partitions)."""
    by: dict[str, dict[str, list[MetricSeries]]] = {}
    for s in series:
        if (s.component in STREAM_APPS or s.component.startswith(COMPONENT_PREFIX)) and "reason" not in s.labels:
            by.setdefault(s.component, {}).setdefault(s.instance, []).append(s)
    out = []
    for comp, workers in sorted(by.items()):
        total = Counter[str]()
        for items in workers.values():
            for s in items:
                total[s.name] += s.value
        latest = max((s for items in workers.values() for s in items), key=lambda s: s.ts)
        out.append(AppStatus(comp, len(workers), int(total["records_in_total"]), int(total["records_out_total"]),
                             int(total["dead_lettered_total"]), int(total["dropped_total"]),
                             round(total["records_in_per_s"], 3), max(0.0, (now - latest.ts) / 1000),
                             latest.labels.get("source", ""), latest.labels.get("sink", "")))
    return out


def _tail(offsets: dict[TP, PartitionOffsets], topic: str, partitions: int, n: int,
          counter: RecordCounter) -> dict[TP, tuple[int, int]]:
    """The last `n` records of a topic, spread over its partitions (records: the counter knows
    their offsets, so transaction markers do not eat into `n`)."""
    per = max(1, math.ceil(n / max(partitions, 1)))
    out = {}
    for p in range(partitions):
        po = offsets.get((topic, p))
        if po is not None:
            out[(topic, p)] = (max(po.low, counter.start_of_last((topic, p), per, po.high)), po.high)
    return out


def collect_status(
    kafka: KafkaSettings,
    experiment: str,
    *,
    window_s: float = 60.0,
    recent: int = 256,
    metrics_lookback_s: float = 600.0,
    max_metric_records: int = 20_000,
    timeout_s: float = 10.0,
    reader: OffsetReader | None = None,
) -> StatusReport:
    """Measures the experiment now. `recent` scored trajectories feed reward and staleness; metric
    series older than `metrics_lookback_s` are left out (nodes that left)."""
    t = Topics(experiment)
    prefix = t.prefix
    if reader is None:  # one of our own for this call: its record counter's consumer is closed after it
        with closing(OffsetReader(kafka, timeout_s)) as own:
            return collect_status(kafka, experiment, window_s=window_s, recent=recent,
                                  metrics_lookback_s=metrics_lookback_s, max_metric_records=max_metric_records,
                                  timeout_s=timeout_s, reader=own)
    topics = reader.topics(prefix)
    if not topics:
        raise TopicError(missing_experiment(experiment, kafka.bootstrap_servers))
    offsets = reader.partition_offsets(topics, window_s)
    counter = reader.counter
    counter.update({tp: (po.low, po.high) for tp, po in offsets.items()})
    groups = reader.groups(prefix)
    committed = {g: reader.committed(g) for g in groups}
    lags = group_lags(groups, committed, offsets, topics, counter)

    now = now_ms()
    ranges: dict[TP, tuple[int, int]] = {}
    if t.metrics in topics:
        since = reader.offsets_at([(t.metrics, p) for p in range(topics[t.metrics])], now - int(metrics_lookback_s * 1000))
        for p in range(topics[t.metrics]):
            po = offsets[(t.metrics, p)]
            start = since.get((t.metrics, p), -1)
            start = po.high if start < 0 else start
            ranges[(t.metrics, p)] = (max(start, po.high - max_metric_records, po.low), po.high)
    for topic, n in ((t.policies, 1000), (t.scored, recent), (t.dlq, 5)):
        if topic in topics:
            ranges.update(_tail(offsets, topic, topics[topic], n, counter))
    serde = AvroSerde()
    provenance = Provenance(experiment)
    metrics: list[Metric] = []
    unverified: list[Metric] = []  # no valid signature of their component's role: shown apart, never counted
    refused_versions = 0
    versions: list[PolicyVersion] = []
    scored: list[tuple[int, Trajectory]] = []
    dead: list[tuple[int, DeadLetter]] = []
    undecodable = 0
    for (topic, _p), _off, value, key, headers in read_ranges(kafka, ranges, timeout_s):
        try:
            rec = serde.loads(value)
        except SerdeError:
            undecodable += 1
            continue
        if isinstance(rec, Metric) and topic == t.metrics:
            (metrics if provenance.metric(rec, key, value, headers) else unverified).append(rec)
        elif isinstance(rec, PolicyVersion) and topic == t.policies:
            if provenance.policy_version(key, value, headers):
                versions.append(rec)
            else:
                refused_versions += 1
        elif isinstance(rec, Trajectory) and topic == t.scored:
            scored.append((rec.created_at, rec))
        elif isinstance(rec, DeadLetter) and topic == t.dlq:
            dead.append((rec.ts, rec))

    series = latest_series(metrics)
    policies = policies_of(series, versions, now)
    latest_versions = {p.policy: p.version for p in policies if p.version is not None}
    trajectories = [tr for _ts, tr in sorted(scored, key=lambda x: x[0])][-recent:]
    topic_rows = []
    since_ms = now - int(window_s * 1000)
    for name, parts in topics.items():
        tps = [(name, p) for p in range(parts) if (name, p) in offsets]
        behind = sum(counter.behind(tp, offsets[tp].high) for tp in tps)
        topic_rows.append(TopicStatus(
            name, name.removeprefix(prefix), parts, sum(counter.records(tp) for tp in tps) + behind,
            sum(offsets[tp].records for tp in tps), sum(counter.since(tp, since_ms) for tp in tps) / window_s,
            exact=behind == 0, end_offset=sum(offsets[tp].high for tp in tps)))
    dlq_row = next((r for r in topic_rows if r.name == t.dlq), None)
    recent_dead = [
        {"component": d.component, "error_class": d.error_class, "error": d.error[:200], "topic": d.topic,
         "offset": d.offset, "ts": d.ts}
        for _ts, d in sorted(dead, key=lambda x: x[0], reverse=True)
    ]
    node_rows = nodes_of(series, now)
    running = any(now - s.ts <= RUNNING_WITHIN_S * 1000 for s in series)
    raas_lag = next((g.lag for g in lags if g.group == f"{prefix}raas" and g.topic == t.tasks), 0)
    tasks_row = next((r for r in topic_rows if r.name == t.tasks), None)
    return StatusReport(
        experiment=experiment,
        bootstrap_servers=kafka.bootstrap_servers,
        taken_at=now,
        window_s=window_s,
        topics=topic_rows,
        lags=lags,
        nodes=node_rows,
        policies=policies,
        staleness=staleness_of(trajectories, latest_versions),
        reward=reward_of(trajectories),
        dlq=DlqStatus(dlq_row.records if dlq_row else 0, dlq_row.rate_per_s if dlq_row else 0.0, recent_dead),
        metrics=sorted(series, key=lambda s: (s.component, s.instance, s.name)),
        undecodable=undecodable,
        regions=regions_of(node_rows, latest_versions),
        autoscale=autoscale_of(raas_lag, tasks_row.rate_per_s if tasks_row else 0.0, node_rows) if running else None,
        apps=apps_of(series, now),
        running=running,
        unverified=sorted(latest_series(unverified), key=lambda s: (s.component, s.instance, s.name)),
        refused_versions=refused_versions,
    )
