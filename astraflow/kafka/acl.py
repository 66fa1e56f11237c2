"""Per-experiment, per-role principals and ACLs: each role of each experiment may touch exactly
the topics and groups it needs, of that experiment only.

A principal is one role of one experiment (`principal_of`: `<experiment>.<role>`, a trainer
`<experiment>.trainer-<policy>`), so a node of experiment A holds no grant on anything of
experiment B: every topic, group and transactional-id row names A's own `af.<A>.` names, and the
only rows outside them are the assign-only readers' throwaway group prefixes (DESCRIBE only, no
data). `role_grants(experiment, policies)` is the table (docs/deploy-secure.md prints it with
`astraflow kafka acls --experiment E --policy P`); `apply_grants` writes it to a cluster through
the Admin API (SCRAM users and ACL bindings), and `kafka_acls_commands` spells the same table as
`kafka-acls.sh` commands for clusters managed by other tools. Read from the code of each role:

- stream apps (curator, reward, curate) run as Faust apps with exactly-once: the app id
  `af.<exp>.<app>` is their consumer group, and Faust names their changelog / repartition topics
  `<app id>-<table>-changelog` and their transactional ids `<app id>-<group>-<partition>`,
  hence a prefix grant on `<app id>-` for topics and transactional ids;
- a trainer publishes each version in one transaction under the literal transactional id
  `af.<exp>.<policy>.publisher` (`Topics.publisher_id`): no other principal may use it;
- assign-only readers (control and compacted readers, weight readers, status) carry a throwaway
  group id that librdkafka looks up but never commits to: DESCRIBE on those group prefixes lets
  them start and does not let them commit (OffsetCommit needs READ);
- WRITE implies DESCRIBE, READ implies DESCRIBE; idempotent producers need no cluster
  IdempotentWrite since Kafka 3.0 (KIP-679): WRITE on a topic or transactional id is enough.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

from astraflow.errors import ConfigError
from astraflow.kafka.topics import SHARED_STREAMS, Topics, check_name

if TYPE_CHECKING:
    from confluent_kafka.admin import AdminClient

READ, WRITE, DESCRIBE, CREATE, DESCRIBE_CONFIGS = "READ", "WRITE", "DESCRIBE", "CREATE", "DESCRIBE_CONFIGS"

ROLES = ("curator", "reward", "curate", "raas", "trainer", "archive", "monitor", "operator")
STREAM_APPS = ("curator", "reward", "curate")

# Group-id prefixes of the assign-only readers (see the modules that name them).
READER_GROUPS = {
    "control": "af-reader-",  # astraflow/control.py: control and compacted readers
    "weights": "astraflow-weights-reader",  # astraflow/kafka/read.py (literal)
    "status": "af-status-",  # astraflow/ops/cluster_offsets.py
    "archive_source": "af-read-",  # astraflow/archive/kafka_source.py
    "curator_lag": "af-curator-",  # stream_apps/curator.py, when it follows no trainer group
    "trainer_control": "astraflow-trainer-control",  # trainers/callbacks.py: snapshot requests (literal)
}


@dataclass(frozen=True)
class Grant:
    """Allow `principal` the `operations` on one resource pattern."""

    principal: str  # SCRAM user name (the ACL principal is User:<name>)
    resource: str  # TOPIC | GROUP | TRANSACTIONAL_ID
    pattern: str  # LITERAL | PREFIXED
    name: str
    operations: tuple[str, ...]
    why: str


def principal_of(role: str, experiment: str, policy: str | None = None) -> str:
    """The SCRAM user of one role of one experiment: `<experiment>.<role>`; trainers have one per
    policy (`<experiment>.trainer-<policy>`)."""
    if role not in ROLES:
        raise ValueError(f"unknown role {role!r}; roles are {', '.join(ROLES)}")
    check_name("experiment", experiment)
    if role == "trainer":
        if not policy:
            raise ValueError("a trainer's principal needs its policy: --policy POLICY")
        return f"{experiment}.trainer-{check_name('policy', policy)}"
    return f"{experiment}.{role}"


def _check_policies(experiment: str, policies: list[str]) -> None:
    """A policy named like a stream app's prefix (`curate-x`) would put its train and weights
    topics under that app's prefix grant (`af.<exp>.curate-`), one named `tasks` under the
    regions' tasks prefix (`af.<exp>.tasks.`): refused."""
    for p in policies:
        check_name("policy", p)
        if p in SHARED_STREAMS:
            raise ConfigError(f"policy name {p!r} is the name of a stream of every experiment "
                              f"(af.{experiment}.{p}); choose another name")
        for app in STREAM_APPS:
            if p.startswith(f"{app}-"):
                raise ConfigError(f"policy name {p!r} starts with {app}-, the prefix of the {app} app's own topics "
                                  f"(af.{experiment}.{app}-...): its topics would be the {app} app's to write; "
                                  "choose another name")


def role_grants(experiment: str, policies: list[str]) -> list[Grant]:
    """The whole table for one experiment and its policies."""
    t = Topics(experiment)
    _check_policies(experiment, policies)
    pre = t.prefix
    out: list[Grant] = []

    def g(role: str, resource: str, name: str, ops: tuple[str, ...], why: str, pattern: str = "LITERAL") -> None:
        who = role if role.startswith(f"{experiment}.") else principal_of(role, experiment)
        out.append(Grant(who, resource, pattern, name, ops, why))

    def worker(who: str) -> None:
        g(who, "TOPIC", t.control, (READ,), "reads commands (strategies, pause)")
        g(who, "GROUP", READER_GROUPS["control"], (DESCRIBE,), "control reader's throwaway group", "PREFIXED")
        g(who, "TOPIC", t.dlq, (WRITE,), "dead letters")
        g(who, "TOPIC", t.metrics, (WRITE,), "metrics")

    for app in STREAM_APPS:
        app_id = t.group(app)
        worker(app)
        g(app, "GROUP", app_id, (READ,), "its consumer group (the Faust app id)")
        g(app, "TOPIC", f"{app_id}-", (READ, WRITE, CREATE, DESCRIBE_CONFIGS), "Faust changelog / repartition / leader topics", "PREFIXED")
        g(app, "TRANSACTIONAL_ID", f"{app_id}-", (WRITE,), "Faust exactly-once transactions", "PREFIXED")
    g("curator", "TOPIC", t.feedback, (READ,), "per-prompt statistics")
    g("curator", "TOPIC", t.tasks, (WRITE,), "tasks (and their end offsets: tasks issued)")
    g("curator", "TOPIC", t.region_tasks_prefix, (WRITE,), "each region's own tasks (--region-share)", "PREFIXED")
    g("curator", "GROUP", READER_GROUPS["curator_lag"], (DESCRIBE,), "its offset reader's group (assign only)", "PREFIXED")
    g("curator", "TOPIC", t.metrics, (READ,), "nodes' metrics: live nodes and speed per region (--region-share)")
    g("curator", "TOPIC", t.rollouts, (READ,), "trajectories' keys: tasks outstanding per region (--region-share)")
    g("reward", "TOPIC", t.rollouts, (READ,), "trajectories to score")
    g("reward", "TOPIC", t.scored, (WRITE,), "scored trajectories")
    g("curate", "TOPIC", t.scored, (READ,), "scored trajectories")
    g("curate", "TOPIC", t.feedback, (READ, WRITE), "per-prompt statistics")
    g("curate", "TOPIC", t.policies, (READ,), "latest version per policy (staleness)")
    g("curate", "TOPIC", t.tasks, (READ,), "the curator's signed tasks: each group's size and members")
    g("curate", "TOPIC", t.region_tasks_prefix, (READ,), "the signed tasks given to each region", "PREFIXED")
    g("curate", "TOPIC", t.lineage, (WRITE,), "groups it dropped, with the filter and the reason (trace)")
    for p in policies:
        g("curate", "TOPIC", t.train(p), (WRITE,), "training samples")
        g("curator", "TOPIC", t.train(p), (DESCRIBE,), "end offsets of the trainer's input (tasks ahead)")
        g("curator", "GROUP", t.trainer_group(p), (DESCRIBE,), "the trainer's committed offsets (tasks ahead)")

    worker("raas")
    g("raas", "TOPIC", t.tasks, (READ,), "tasks")
    g("raas", "TOPIC", t.region_tasks_prefix, (READ,), "a region's own tasks (raas serve --tasks-region)", "PREFIXED")
    g("raas", "GROUP", t.raas_group, (READ,), "nodes share the tasks in one group")
    g("raas", "TOPIC", t.rollouts, (WRITE,), "trajectories")
    g("raas", "TOPIC", t.policies, (READ,), "where to start following each policy")
    g("raas", "TOPIC", t.snapshot_requests, (WRITE,), "snapshot requests to the trainers (weights follower)")
    g("raas", "GROUP", READER_GROUPS["weights"], (DESCRIBE,), "weight reader's group (assign only)")
    for p in policies:
        g("raas", "TOPIC", t.weights(p), (READ,), "follows the policy's weights")

    for p in policies:
        who = principal_of("trainer", experiment, p)
        worker(who)
        g(who, "TOPIC", t.train(p), (READ,), "its policy's training samples")
        g(who, "GROUP", t.trainer_group(p), (READ,), "its input offsets (informational; the checkpoint is the truth)")
        g(who, "TOPIC", t.weights(p), (READ, WRITE), "publishes its policy's weights (reads the last one on restart)")
        g(who, "TOPIC", t.policies, (READ, WRITE), "latest version of its policy")
        g(who, "TOPIC", t.lineage, (WRITE,), "samples each version first carries, with their steps (trace)")
        g(who, "GROUP", READER_GROUPS["weights"], (DESCRIBE,), "weight reader's group (assign only)")
        g(who, "TOPIC", t.snapshot_requests, (READ,), "snapshot requests from the followers")
        g(who, "GROUP", READER_GROUPS["trainer_control"], (DESCRIBE,), "snapshot-request reader's group (assign only)")
        g(who, "TRANSACTIONAL_ID", t.publisher_id(p), (WRITE,), "publishes each version in one transaction (fences a predecessor)")

    g("archive", "TOPIC", pre, (READ,), "archives any stream of the experiment", "PREFIXED")
    g("archive", "GROUP", t.group("archive."), (READ,), "one group per archive destination", "PREFIXED")
    g("archive", "GROUP", READER_GROUPS["archive_source"], (DESCRIBE,), "replay reader's group (assign only)", "PREFIXED")

    g("monitor", "TOPIC", pre, (READ, DESCRIBE_CONFIGS), "status reads every stream (read only)", "PREFIXED")
    g("monitor", "GROUP", pre, (DESCRIBE,), "lag of every consumer group", "PREFIXED")
    g("monitor", "GROUP", READER_GROUPS["status"], (DESCRIBE,), "status reader's group (assign only)", "PREFIXED")
    g("monitor", "GROUP", READER_GROUPS["control"], (DESCRIBE,), "control reader's group", "PREFIXED")

    g("operator", "TOPIC", pre, (CREATE, DESCRIBE, DESCRIBE_CONFIGS), "creates and inspects the topics", "PREFIXED")
    g("operator", "TOPIC", t.control, (READ, WRITE), "sends and reads commands")
    g("operator", "GROUP", READER_GROUPS["control"], (DESCRIBE,), "control reader's group", "PREFIXED")
    return out


def role_topics(role: str, experiment: str, policies: list[str]) -> list[str]:
    """The experiment's topics a role reads or writes (its literal topic rows): what it checks
    exists at start (`TopicAdmin.require`). A trainer's are those of its one policy."""
    who = principal_of(role, experiment, policies[0] if role == "trainer" else None)
    rows = role_grants(experiment, policies)
    return list(dict.fromkeys(g.name for g in rows if g.principal == who and g.resource == "TOPIC" and g.pattern == "LITERAL"))


def principals(grants: list[Grant]) -> list[str]:
    return sorted({gr.principal for gr in grants})


def acl_bindings(grants: list[Grant]) -> list:
    """confluent-kafka AclBinding objects, one per (grant, operation)."""
    from confluent_kafka.admin import (
        AclBinding,
        AclOperation,
        AclPermissionType,
        ResourcePatternType,
        ResourceType,
    )

    return [
        AclBinding(
            ResourceType[gr.resource], gr.name, ResourcePatternType[gr.pattern], f"User:{gr.principal}", "*",
            AclOperation[op], AclPermissionType.ALLOW,
        )
        for gr in grants
        for op in gr.operations
    ]


def apply_grants(admin: AdminClient, grants: list[Grant], timeout_s: float = 30.0) -> int:
    """Creates every ACL binding of the table (idempotent); returns how many were requested."""
    from confluent_kafka import KafkaException

    from astraflow.errors import KafkaLayerError

    bindings = acl_bindings(grants)
    for binding, fut in admin.create_acls(bindings, request_timeout=timeout_s).items():
        try:
            fut.result(timeout=timeout_s)
        except KafkaException as exc:
            raise KafkaLayerError(f"cannot create ACL {binding}: {exc}") from exc
    return len(bindings)


_CLI_RESOURCE = {"TOPIC": "--topic", "GROUP": "--group", "TRANSACTIONAL_ID": "--transactional-id"}
_CLI_OP = {READ: "Read", WRITE: "Write", DESCRIBE: "Describe", CREATE: "Create", DESCRIBE_CONFIGS: "DescribeConfigs"}


def kafka_acls_commands(grants: list[Grant], bootstrap: str = "$BOOTSTRAP", config: str = "admin.properties") -> list[str]:
    """The table as `kafka-acls.sh` commands (for clusters not managed through AstraFlow)."""
    lines = []
    for gr in grants:
        ops = " ".join(f"--operation {_CLI_OP[op]}" for op in gr.operations)
        pattern = " --resource-pattern-type prefixed" if gr.pattern == "PREFIXED" else ""
        lines.append(
            f"kafka-acls.sh --bootstrap-server {bootstrap} --command-config {config} --add "
            f"--allow-principal User:{gr.principal} {ops} {_CLI_RESOURCE[gr.resource]} '{gr.name}'{pattern}"
        )
    return lines
