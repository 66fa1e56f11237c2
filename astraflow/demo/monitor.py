"""Watches a running experiment from the outside, through its topics only.

Reads `scored` (reward, versions, node of each trajectory), `metrics` (evaluation success,
versions per node, trainer figures), the `dlq`, and consumer-group lag per topic. The live view,
the CSV, the plot and `summary.json` are all built from what this sees.
"""

from __future__ import annotations

import threading
import time
import uuid
from collections import defaultdict, deque
from dataclasses import dataclass, field

from confluent_kafka import Consumer, ConsumerGroupTopicPartitions, TopicPartition
from confluent_kafka.admin import AdminClient

from astraflow.config import KafkaSettings
from astraflow.kafka.clients import reader
from astraflow.kafka.counts import RecordCounter
from astraflow.kafka.topics import Topics, reader_group
from astraflow.ops.provenance import Provenance
from astraflow.processor import COMPONENT_PREFIX
from astraflow.records import DeadLetter, Metric, Trajectory
from astraflow.serde import AvroSerde


@dataclass
class Snapshot:
    """What the experiment looks like now."""

    elapsed_s: float
    trajectories: int
    traj_per_s: float
    reward_recent: float | None  # mean reward of the last 64 scored trajectories
    eval_success: float | None  # latest held-out success
    eval_version: int | None
    versions_by_node: dict[str, int]
    trainer_version: int | None
    staleness_recent: float | None  # mean (trainer version - trajectory version), last 64
    lags: dict[str, int]  # topic -> total consumer lag of its reading group
    dlq: int
    train_samples: int  # samples trained on so far

    @property
    def newest_version(self) -> int:
        """The newest version seen live: the trainer's (reported at its next step) or a node's."""
        return max([self.trainer_version or 0, *self.versions_by_node.values()])


@dataclass
class Monitor:
    """Background reader of an experiment's topics."""

    kafka: KafkaSettings
    experiment: str
    policy: str
    groups: dict[str, str] = field(default_factory=dict)  # topic -> consumer group whose lag to show
    t0: float = field(default_factory=time.monotonic)

    def __post_init__(self) -> None:
        self.topics = Topics(self.experiment)
        self.serde = AvroSerde()
        self._provenance = Provenance(self.experiment)
        self.rows: list[dict] = []  # one per scored trajectory
        self.evals: list[dict] = []  # one per evaluation
        self.versions_by_node: dict[str, int] = {}
        self.trainer_version: int | None = None
        self.trainer_metrics: dict[str, float] = {}
        self._greedy: dict[int, float] = {}  # version -> greedy held-out success (arrives just before the sampled one)
        self.trained_samples = 0  # samples the trainer reports having trained on
        self.dlq: list[DeadLetter] = []  # dead letters of the run's own roles
        self.processor_dlq: dict[str, int] = {}  # component proc.<name> -> dead letters of that user processor
        self._recent = deque(maxlen=64)
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="demo-monitor", daemon=True)
        self._admin = AdminClient(self.kafka.client_config())
        self.lags: dict[str, int] = {}
        self._probe: Consumer | None = None
        self._counter = RecordCounter(self.kafka)

    def start(self) -> None:
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(timeout=10)

    def _run(self) -> None:
        c = reader(self.kafka, self.topics.group(f"monitor-{uuid.uuid4().hex[:6]}"))
        c.subscribe([self.topics.scored, self.topics.metrics, self.topics.dlq])
        last_lag = 0.0
        try:
            while not self._stop.is_set():
                for msg in c.consume(500, 0.5):
                    if msg.error() is None:
                        self._handle(msg.topic(), msg.value(), msg.key(), list(msg.headers() or []))
                if time.monotonic() - last_lag > 2.0:
                    self.lags = self._lags()
                    last_lag = time.monotonic()
        finally:
            c.close()
            if self._probe is not None:
                self._probe.close()
            self._counter.close()

    def _handle(self, topic: str, value: bytes, key: bytes | None = None, headers: list | None = None) -> None:
        try:
            rec = self.serde.loads(value)
        except Exception:  # the monitor only watches; bad records are the DLQ's business
            return
        if isinstance(rec, Metric) and not self._provenance.metric(rec, key, value, headers or []):
            return  # no key of the role it names signed it (astraflow.ops.provenance): not believed
        now = time.monotonic() - self.t0
        with self._lock:
            self._apply(rec, now)

    def _apply(self, rec: object, now: float) -> None:
        """Folds one decoded record into the figures (called under the lock; subclasses add theirs)."""
        if isinstance(rec, Trajectory):
            version = min((oldest for oldest, _ in rec.trained_versions().values()), default=-1)
            newest = max([self.trainer_version or 0, version, *self.versions_by_node.values()])
            row = {"t": now, "reward": rec.reward if rec.reward is not None else 0.0, "version": version,
                   "node": rec.node.node_id, "tool_calls": len(rec.tool_calls), "status": str(rec.status),
                   "trainer_version": newest}
            self.rows.append(row)
            self._recent.append(row)
        elif isinstance(rec, Metric):
            name = rec.name.removeprefix("trainer.")
            if rec.component == "eval" and rec.name == "eval_success_greedy":
                self._greedy[int(rec.labels.get("version", -1))] = rec.value
            elif rec.component == "eval" and rec.name == "eval_success":
                v = int(rec.labels.get("version", -1))
                self.evals.append({"t": now, "success": rec.value, "version": v, "greedy": self._greedy.get(v)})
            elif rec.name == "policy_version" and rec.component == "raas":
                self.versions_by_node[rec.instance] = int(rec.value)
            elif rec.component == "trainer" and "bucket" not in rec.labels:
                self.trainer_metrics[name] = rec.value
                if name == "policy_version":
                    self.trainer_version = int(rec.value)
                elif name == "samples":
                    self.trained_samples += int(rec.value)
        elif isinstance(rec, DeadLetter):  # a user processor's dead letters are its own, not the run's
            if rec.component.startswith(COMPONENT_PREFIX):
                self.processor_dlq[rec.component] = self.processor_dlq.get(rec.component, 0) + 1
            else:
                self.dlq.append(rec)

    def _lags(self) -> dict[str, int]:
        """Per watched topic, the records its group has not committed yet (records, not offsets:
        every hop writes in transactions, whose markers take offsets)."""
        if self._probe is None:  # one watermark reader for the whole run; it never joins a group
            self._probe = reader(self.kafka, reader_group("lag_probe"))
        ends: dict[tuple[str, int], tuple[int, int]] = {}
        committed: dict[str, dict[int, int]] = {}
        for topic, group in self.groups.items():
            try:
                md = self._admin.list_topics(topic, timeout=5)
                parts = [TopicPartition(topic, p) for p in md.topics[topic].partitions]
                fut = self._admin.list_consumer_group_offsets([ConsumerGroupTopicPartitions(group, parts)])
                committed[topic] = {tp.partition: tp.offset
                                    for tp in next(iter(fut.values())).result(timeout=5).topic_partitions}
                for tp in parts:
                    ends[(topic, tp.partition)] = self._probe.get_watermark_offsets(tp, timeout=5)
            except Exception:  # lag display is best effort while topics and groups appear
                committed.pop(topic, None)
        self._counter.update(ends)
        out = {}
        for topic, offsets in committed.items():
            total = sum(self._counter.after(tp, max(offsets.get(tp[1], 0), lo), hi)
                        for tp, (lo, hi) in ends.items() if tp[0] == topic)
            out[topic.rsplit(".", 1)[-1] if topic.count(".") == 2 else ".".join(topic.split(".")[2:])] = total
        return out

    def snapshot(self) -> Snapshot:
        with self._lock:
            now = time.monotonic() - self.t0
            recent = list(self._recent)
            window = [r for r in self.rows if r["t"] > now - 30]
            ev = self.evals[-1] if self.evals else None
            return Snapshot(
                elapsed_s=now,
                trajectories=len(self.rows),
                traj_per_s=len(window) / min(30.0, max(now, 1e-6)),
                reward_recent=sum(r["reward"] for r in recent) / len(recent) if recent else None,
                eval_success=ev["success"] if ev else None,
                eval_version=ev["version"] if ev else None,
                versions_by_node=dict(self.versions_by_node),
                trainer_version=self.trainer_version,
                staleness_recent=(sum(r["trainer_version"] - r["version"] for r in recent) / len(recent)) if recent else None,
                lags=dict(self.lags),
                dlq=len(self.dlq),
                train_samples=self.trained_samples,
            )

    def by_version(self) -> dict[int, float]:
        """Mean reward of the trajectories generated by each policy version."""
        acc: dict[int, list[float]] = defaultdict(list)
        with self._lock:
            for r in self.rows:
                acc[r["version"]].append(r["reward"])
        return {v: sum(x) / len(x) for v, x in sorted(acc.items())}
