"""Topic names and specs per experiment and policy (DESIGN.md, "Topics"), and their admin.

Names are `af.<experiment>.<stream>` and `af.<experiment>.<policy>.<stream>`. Specs say how many
partitions each topic gets and its configs (compaction, retention, message size).
"""

from __future__ import annotations

import logging
import re
import time
import uuid
from dataclasses import dataclass, field

from confluent_kafka import KafkaError, KafkaException
from confluent_kafka.admin import AdminClient, ConfigResource, NewTopic

from astraflow.config import KafkaSettings, TopicSettings
from astraflow.errors import ConfigError, TopicError

log = logging.getLogger("astraflow.kafka")

_NAME = re.compile(r"^[A-Za-z0-9_-]{1,100}$")

PREFIX = "af."  # of every AstraFlow topic and group; then the experiment, then the stream
SHARED_STREAMS = ("tasks", "rollouts", "scored", "feedback", "control", "metrics", "dlq", "policies", "lineage",
                  "snapshot_requests")
POLICY_STREAMS = ("train", "weights")

# Group ids of the readers that never commit (assign-only readers, watermark and lag probes): one
# per purpose, so that an ACL can grant exactly it (`astraflow.kafka.acl`). A name ending in '-' is
# a prefix that `reader_group` completes with a fresh suffix, so two readers never share a group.
READER_GROUPS = {
    "control": "af-reader-",  # control and compacted-topic readers (astraflow/control.py)
    "weights": "astraflow-weights-reader",  # weight readers (astraflow/kafka/read.py)
    "status": "af-status-",  # `astraflow status` (astraflow/ops/cluster_offsets.py)
    "archive_source": "af-read-",  # replay of a topic range (astraflow/archive/kafka_source.py)
    "curator_lag": "af-curator-",  # the curator's offset reader (stream_apps/curator.py)
    "trainer_control": "astraflow-trainer-control",  # snapshot requests (trainers/callbacks.py)
    "changelog_ends": "astraflow-changelog-ends",  # ends of a stream app's changelogs (stream_apps/transactions.py)
    "lag_probe": "af-lag-probe",  # the demo's lag probe (astraflow/demo/monitor.py)
    "test": "af-test-read-",  # astraflow.testing's readers
}


def check_name(kind: str, name: str) -> str:
    """Experiment and policy names become parts of topic names: letters, digits, '_' and '-' only."""
    if not _NAME.match(name):
        raise ConfigError(f"{kind} name {name!r} may only use letters, digits, '_' and '-' (1-100 characters)")
    return name


def reader_group(purpose: str, suffix: str | None = None) -> str:
    """The group id of a reader that never commits, for one of `READER_GROUPS`' purposes; a
    prefix gets `suffix`, or a fresh random one."""
    name = READER_GROUPS[purpose]
    return name + (suffix or uuid.uuid4().hex[:12]) if name.endswith("-") else name


@dataclass(frozen=True)
class Topics:
    """The topic names of one experiment."""

    experiment: str

    def __post_init__(self) -> None:
        check_name("experiment", self.experiment)

    def _t(self, stream: str) -> str:
        return f"{PREFIX}{self.experiment}.{stream}"

    @property
    def tasks(self) -> str:
        return self._t("tasks")

    def tasks_of(self, region: str) -> str:
        """The tasks the curator gives one region of its own (`--region-share`), which that
        region's nodes read (`raas serve --tasks-region`) and no other node does: a cluster of
        that region receives them through MirrorMaker 2 (`astraflow.kafka.mirror`)."""
        return self._t(f"tasks.{check_name('region', region)}")

    @property
    def region_tasks_prefix(self) -> str:
        """What every `tasks_of(region)` starts with (ACLs grant the regions' tasks by it)."""
        return self._t("tasks.")

    @property
    def rollouts(self) -> str:
        return self._t("rollouts")

    @property
    def scored(self) -> str:
        return self._t("scored")

    @property
    def feedback(self) -> str:
        return self._t("feedback")

    @property
    def control(self) -> str:
        return self._t("control")

    @property
    def metrics(self) -> str:
        return self._t("metrics")

    @property
    def dlq(self) -> str:
        return self._t("dlq")

    @property
    def policies(self) -> str:
        return self._t("policies")

    @property
    def snapshot_requests(self) -> str:
        """Followers asking trainers for a full snapshot (RaaS nodes write it; `control`, the
        operator's alone, is not theirs to write)."""
        return self._t("snapshot_requests")

    @property
    def lineage(self) -> str:
        """What `astraflow trace` needs beyond the data topics: groups dropped, samples trained."""
        return self._t("lineage")

    def train(self, policy: str) -> str:
        return self._t(f"{check_name('policy', policy)}.train")

    def weights(self, policy: str) -> str:
        return self._t(f"{check_name('policy', policy)}.weights")

    def publisher_id(self, policy: str) -> str:
        """The transactional id (not a topic) of the policy's trainer when it publishes weights:
        one per policy, so a restarted trainer fences its predecessor (ACLs grant it by name)."""
        return self._t(f"{check_name('policy', policy)}.publisher")

    @property
    def prefix(self) -> str:
        """What every topic and consumer group of this experiment starts with: `af.<experiment>.`."""
        return self._t("")

    def group(self, role: str) -> str:
        """The consumer-group id of a role of this experiment: `af.<experiment>.<role>`. Stream
        apps use it as their Faust app id too (`reward`, `curate`, `curator`, a processor's name),
        so their tables' changelogs are `changelog(role, table)`."""
        return self._t(role)

    @property
    def raas_group(self) -> str:
        """The group the RaaS nodes share the tasks in."""
        return self.group("raas")

    def trainer_group(self, policy: str) -> str:
        """The group whose committed offsets say how far the policy's trainer has read its train
        topic (the curator throttles on it, `astraflow status` shows its lag)."""
        return self.group(f"{check_name('policy', policy)}.trainer")

    def archive_group(self, digest: str) -> str:
        """One archive group per destination (`digest` of where it writes)."""
        return self.group(f"archive.{digest}")

    def changelog(self, role: str, table: str) -> str:
        """The changelog topic of a stream app's table (Faust: `<app id>-<table>-changelog`)."""
        return f"{self.group(role)}-{table}-changelog"

    def of_experiment(self, name: str) -> bool:
        """Whether a topic or group name belongs to this experiment."""
        return name.startswith(self.prefix)

    def stream(self, name: str) -> str:
        """Resolves a stream name (`rollouts`, `solver.train`) or passes a full topic name through."""
        if name.startswith(PREFIX):
            return name
        return self._t(name)


@dataclass(frozen=True)
class TopicSpec:
    """How one topic should be created."""

    name: str
    partitions: int
    config: dict[str, str] = field(default_factory=dict)


def topic_specs(experiment: str, policies: list[str], settings: TopicSettings) -> list[TopicSpec]:
    """Every topic an experiment with these policies needs."""
    t = Topics(experiment)
    p = settings.partitions
    work = {"cleanup.policy": "delete", "retention.ms": str(settings.work_retention_ms)}
    compact = {"cleanup.policy": "compact", "min.cleanable.dirty.ratio": "0.1", "segment.ms": "600000"}
    big = str(settings.max_message_bytes)
    specs = [
        TopicSpec(t.tasks, settings.tasks_partitions or p, work),
        TopicSpec(t.rollouts, p, {"cleanup.policy": "delete", "retention.ms": str(settings.rollouts_retention_ms)}),
        TopicSpec(t.scored, p, work),
        TopicSpec(t.feedback, p, compact),
        TopicSpec(t.control, 1, compact),  # one partition: one total order of commands
        TopicSpec(t.metrics, 1, work),
        TopicSpec(t.dlq, 1, {**work, "max.message.bytes": big}),
        TopicSpec(t.policies, 1, {**compact, "max.message.bytes": big}),
        TopicSpec(t.lineage, 1, {**work, "max.message.bytes": big}),
        TopicSpec(t.snapshot_requests, 1, work),
    ]
    for policy in policies:
        specs.append(TopicSpec(t.train(policy), p, work))
        # Partition 0, the stream every follower reads: every version, in order, each manifest
        # before its chunks; partition 1: full snapshots, for joining and recovering followers
        # (astraflow.weights.versions.SNAPSHOT_PARTITION).
        specs.append(
            TopicSpec(
                t.weights(policy),
                2,
                {"cleanup.policy": "delete", "retention.bytes": str(settings.weights_retention_bytes), "max.message.bytes": big},
            )
        )
    if settings.min_insync_replicas is not None:
        isr = {"min.insync.replicas": str(settings.min_insync_replicas)}
        specs = [TopicSpec(s.name, s.partitions, {**s.config, **isr}) for s in specs]
    return specs


_STREAM = re.compile(r"^[A-Za-z0-9_-]{1,100}(\.[A-Za-z0-9_-]{1,100}){0,3}$")


def stream_spec(experiment: str, stream: str, settings: TopicSettings, partitions: int | None = None) -> TopicSpec:
    """The spec of one stream of an experiment: a built-in one as `topic_specs` makes it, any other
    (a processor's sink, a replay's target) a work topic (delete, the work retention) with
    `partitions` (default: the experiment's)."""
    if not _STREAM.match(stream):
        raise ConfigError(f"stream name {stream!r} may only use letters, digits, '_', '-' and '.' "
                          "(e.g. tool-errors, or solver.train)")
    t = Topics(experiment)
    policy, _, kind = stream.rpartition(".")
    builtin = topic_specs(experiment, [policy] if kind in POLICY_STREAMS and policy else [], settings)
    for spec in builtin:
        if spec.name == t.stream(stream):
            return spec if partitions is None else TopicSpec(spec.name, partitions, spec.config)
    config = {"cleanup.policy": "delete", "retention.ms": str(settings.work_retention_ms)}
    if settings.min_insync_replicas is not None:
        config["min.insync.replicas"] = str(settings.min_insync_replicas)
    return TopicSpec(t.stream(stream), partitions or settings.partitions, config)


def create_command(experiment: str, policies: list[str]) -> str:
    """The command line that creates an experiment's topics (for error messages)."""
    return " ".join(["astraflow topics create -e", experiment, *(f"-p {p}" for p in policies)])


def missing_experiment(experiment: str, where: str) -> str:
    """The one line every command prints for an experiment that has no topics on a cluster."""
    return (f"no experiment {experiment!r} on {where} (it has no topics): `astraflow experiments list` lists "
            f"the experiments there; `astraflow topics create -e {experiment} -p POLICY` makes this one")


def experiment_of(topic: str) -> str | None:
    """`af.<experiment>.<stream>` -> the experiment; None for a topic AstraFlow did not name."""
    parts = topic.split(".")
    if len(parts) < 3 or f"{parts[0]}." != PREFIX or not _NAME.match(parts[1]):
        return None
    return parts[1]


class TopicAdmin:
    """Creates, lists and describes topics on any cluster."""

    def __init__(self, kafka: KafkaSettings) -> None:
        self.kafka = kafka
        self.admin = AdminClient(kafka.client_config())

    def experiment(self, experiment: str) -> dict[str, int]:
        """The experiment's topics (name -> partitions); TopicError naming it when it has none."""
        topics = self.list(Topics(experiment).prefix)
        if not topics:
            raise TopicError(missing_experiment(experiment, self.kafka.bootstrap_servers))
        return topics

    def create(self, specs: list[TopicSpec], replication_factor: int | None = None, timeout_s: float = 30.0) -> dict[str, str]:
        """Creates the missing topics; returns name -> 'created' | 'exists'.

        `replication_factor` None leaves it to the cluster's `default.replication.factor`."""
        existing = set(self.list(timeout_s=timeout_s))
        todo = [s for s in specs if s.name not in existing]
        result = {s.name: "exists" for s in specs if s.name in existing}
        if not todo:
            return result
        futures = self.admin.create_topics(
            [NewTopic(s.name, num_partitions=s.partitions, replication_factor=replication_factor or -1, config=s.config)
             for s in todo],
            operation_timeout=timeout_s,
        )
        for name, fut in futures.items():
            try:
                fut.result(timeout=timeout_s)
                result[name] = "created"
            except KafkaException as exc:
                err = exc.args[0]
                if getattr(err, "name", lambda: "")() == "TOPIC_ALREADY_EXISTS":
                    result[name] = "exists"
                elif getattr(err, "name", lambda: "")() == "TOPIC_AUTHORIZATION_FAILED":
                    raise TopicError(
                        f"not allowed to create topic {name} (or to see that it exists): on a cluster with ACLs "
                        "the operator creates an experiment's topics (`astraflow topics create`, see docs/deploy-secure.md)"
                    ) from exc
                else:
                    raise TopicError(f"cannot create topic {name}: {err}") from exc
        return result

    def require(self, names: list[str], create_cmd: str, wait_s: float = 10.0) -> None:
        """Raises TopicError naming each of `names` that does not exist (or that this principal
        may not see), with the command that creates them. Roles never create the experiment's
        topics: the operator does, once (docs/deploy.md). A topic just created may take a moment
        to reach every broker's metadata, so missing ones are looked for again for `wait_s`. An
        unreachable cluster is waited for (a role started during an outage starts after it)."""
        deadline, away = time.monotonic() + wait_s, 0.0
        while True:
            try:
                existing = self.list()
            except TopicError as exc:
                away += 10.0
                log.warning("waiting for Kafka to check topics %s (%.0f s): %s", ", ".join(names), away, exc)
                deadline = time.monotonic() + wait_s
                continue
            missing = [n for n in names if n not in existing]
            if not missing:
                return
            if time.monotonic() >= deadline:
                raise TopicError(
                    f"topic{'s' if len(missing) > 1 else ''} {', '.join(missing)} not found: the operator creates the "
                    f"experiment's topics before the roles start: `{create_cmd}` (on a cluster with ACLs, with the "
                    "operator's credentials; see docs/deploy-secure.md)"
                )
            time.sleep(0.5)

    def list(self, prefix: str = "", timeout_s: float = 10.0) -> dict[str, int]:
        """Topic name -> partition count, for names starting with `prefix`."""
        try:
            md = self.admin.list_topics(timeout=timeout_s)
        except KafkaException as exc:
            raise TopicError(f"cannot list topics (is Kafka reachable?): {exc}") from exc
        return {n: len(t.partitions) for n, t in sorted(md.topics.items()) if n.startswith(prefix)}

    def describe(self, names: list[str], timeout_s: float = 10.0) -> dict[str, dict[str, str]]:
        """Non-default configs of each topic.

        On a cluster of several brokers a topic just created reaches each broker's metadata a
        moment later: UNKNOWN_TOPIC_OR_PART is retried until `timeout_s`.
        """
        out: dict[str, dict[str, str]] = {}
        deadline = time.monotonic() + timeout_s
        todo = list(names)
        while todo:
            futures = self.admin.describe_configs([ConfigResource(ConfigResource.Type.TOPIC, n) for n in todo])
            todo = []
            for res, fut in futures.items():
                try:
                    entries = fut.result(timeout=timeout_s)
                except KafkaException as exc:
                    if exc.args[0].code() == KafkaError.UNKNOWN_TOPIC_OR_PART and time.monotonic() < deadline:
                        todo.append(res.name)
                        continue
                    raise TopicError(f"cannot describe topic {res.name}: {exc}") from exc
                out[res.name] = {k: v.value for k, v in entries.items() if not v.is_default and v.value is not None}
            if todo:
                time.sleep(0.2)
        return out

    def groups(self, prefix: str, timeout_s: float = 10.0) -> list[str]:
        """Consumer group ids starting with `prefix`."""
        try:
            listed = self.admin.list_consumer_groups(request_timeout=timeout_s).result(timeout=timeout_s)
        except KafkaException as exc:
            raise TopicError(f"cannot list consumer groups (is Kafka reachable?): {exc}") from exc
        return sorted(g.group_id for g in listed.valid if g.group_id.startswith(prefix))

    def delete_groups(self, ids: list[str], timeout_s: float = 30.0) -> list[str]:
        """Deletes consumer groups; returns those that could not be (a member is still connected)."""
        if not ids:
            return []
        kept = []
        for gid, fut in self.admin.delete_consumer_groups(ids, request_timeout=timeout_s).items():
            try:
                fut.result(timeout=timeout_s)
            except KafkaException as exc:
                err = exc.args[0]
                if getattr(err, "name", lambda: "")() != "GROUP_ID_NOT_FOUND":
                    kept.append(f"{gid} ({err})")
        return kept

    def delete(self, names: list[str], timeout_s: float = 30.0) -> None:
        for name, fut in self.admin.delete_topics(names, operation_timeout=timeout_s).items():
            try:
                fut.result(timeout=timeout_s)
            except KafkaException as exc:
                raise TopicError(f"cannot delete topic {name}: {exc}") from exc
