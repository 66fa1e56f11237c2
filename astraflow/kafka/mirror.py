"""Apache Kafka's MirrorMaker 2 between region A's cluster and region B's, for one experiment.

`mirror_properties(plan)` writes the MM2 configuration (dedicated mode, both flows in one
process), `Mirror` runs `org.apache.kafka.connect.mirror.MirrorMaker` from the same Maven jars
as `astraflow kafka up` (docker/kafka/pom.xml: connect-mirror and Connect's runtime) as a child
process with a pid file and a log file under its data directory, like the local brokers.

What crosses, per experiment EXP and region R (docs/deploy.md, "Across regions and hardware"):

* A -> B: `af.EXP.tasks.R` (the tasks the curator gives region R; region A's nodes read
  `af.EXP.tasks` and never this one), every policy's weights topic `af.EXP.<policy>.weights`
  and `af.EXP.policies` (the latest version per policy, compacted);
* B -> A: `af.EXP.rollouts` (region B's trajectories, for the reward app in A), `af.EXP.metrics`
  (so `astraflow status` in A sees region B's nodes), `af.EXP.dlq` (tasks region B refused
  stay accounted for) and `af.EXP.snapshot_requests` (a weight follower in B that cannot catch
  up asks the trainer in A for a snapshot there).

Signed records cross with their `af-sig` header (MM2 copies headers), and signatures cover the
logical stream, not the topic name: region B's nodes verify them against the same
`trust.json` (astraflow.kafka.signing), which the operator ships to region B's hosts.

Topic names stay the same on both sides (`IdentityReplicationPolicy`), so region B's roles need
no other configuration than their bootstrap servers. Identity names cannot tell a mirrored
record from a local one, so no record may loop: the two flows' topic sets are disjoint (checked
here), and MM2 mirrors only the topics listed. By default MM2 runs with exactly-once source
support (KIP-618, dedicated mode since Kafka 3.5, with KIP-710's internal REST listener on a
free port): each batch it copies and its source offsets are committed in one transaction on the
target, so a restarted MM2 copies nothing twice (every reader here is read_committed). Without
it (`exactly_once=False`) MM2 is at-least-once (a restart replays from its last committed source
offset) and curate drops a trajectory id it has already seen in its group
(`superseded`).

Weights are published in transactions: MM2 reads them `read_committed`, so aborted chunks never
cross; but transaction markers take offsets in A and are not copied, so offsets differ between
the clusters. MM2 keeps record timestamps, so a follower in B finds a snapshot by the timestamp
of its manifest record (`latest_snapshot_ts_ms` in every manifest), not by A's offset.
"""

from __future__ import annotations

import re
import subprocess
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from astraflow.config import TopicSettings
from astraflow.errors import LocalKafkaError
from astraflow.kafka.nodes import LOG4J2, alive, require, stop_pid
from astraflow.kafka.topics import Topics, check_name

Echo = Callable[..., Any]
MAIN = "org.apache.kafka.connect.mirror.MirrorMaker"
IDENTITY = "org.apache.kafka.connect.mirror.IdentityReplicationPolicy"
MM2_LOG4J2 = LOG4J2 + """\
logger.mirror.name = org.apache.kafka.connect.mirror
logger.mirror.level = INFO
"""


@dataclass(frozen=True)
class MirrorPlan:
    """One experiment mirrored between region A's cluster (`source_bootstrap`) and region
    `region`'s (`target_bootstrap`)."""

    experiment: str
    region: str
    source_bootstrap: str
    target_bootstrap: str
    source_region: str = "a"
    replication_factor: int = 1  # of MM2's own topics and the topics it creates (1: a one-node cluster)
    max_message_bytes: int = 16 * 1024 * 1024  # weight chunks: what MM2's producer must be able to send
    exactly_once: bool = True  # KIP-618 exactly-once source support in dedicated mode

    def __post_init__(self) -> None:
        check_name("region", self.region)
        check_name("region", self.source_region)
        if self.region == self.source_region:
            raise LocalKafkaError(f"region {self.region!r} is the source region; name region B differently")

    @property
    def topics(self) -> Topics:
        return Topics(self.experiment)

    @property
    def aliases(self) -> tuple[str, str]:
        """MM2's cluster aliases: per experiment, so that two mirrors on the same clusters keep
        their Connect groups and internal topics (`mm2-configs.<alias>.internal`, ...) apart."""
        return f"{self.source_region}-{self.experiment}", f"{self.region}-{self.experiment}"

    def outbound(self) -> list[str]:
        """Regexes of the topics that go from A to the region."""
        t = self.topics
        return [re.escape(t.tasks_of(self.region)), re.escape(t.policies),
                re.escape(t.prefix) + r"[A-Za-z0-9_-]+" + re.escape(".weights")]

    def inbound(self) -> list[str]:
        """Regexes of the topics that come back from the region to A."""
        t = self.topics
        return [re.escape(t.rollouts), re.escape(t.metrics), re.escape(t.dlq), re.escape(t.snapshot_requests)]


def _matches(patterns: list[str], name: str) -> bool:
    return any(re.fullmatch(p, name) for p in patterns)


def loop_free(plan: MirrorPlan, names: list[str]) -> list[str]:
    """Names among `names` that both flows would mirror (a record there would loop forever)."""
    return [n for n in names if _matches(plan.outbound(), n) and _matches(plan.inbound(), n)]


def mirror_properties(plan: MirrorPlan) -> dict[str, str]:
    """MM2's configuration (dedicated mode) for `plan`, as key -> value (unescaped)."""
    a, b = plan.aliases
    t = plan.topics
    every = [t.tasks, t.tasks_of(plan.region), t.rollouts, t.scored, t.feedback, t.control, t.metrics, t.dlq,
             t.policies, t.lineage, t.snapshot_requests, t.weights("policy"), t.train("policy")]
    clash = loop_free(plan, every)
    if clash:  # cannot happen with the patterns above; a guard for whoever edits them
        raise LocalKafkaError(f"topics mirrored both ways would loop: {', '.join(clash)}")
    rf = str(plan.replication_factor)
    big = str(plan.max_message_bytes)
    props = {
        "clusters": f"{a}, {b}",
        f"{a}.bootstrap.servers": plan.source_bootstrap,
        f"{b}.bootstrap.servers": plan.target_bootstrap,
        f"{a}->{b}.enabled": "true",
        f"{a}->{b}.topics": ", ".join(plan.outbound()),
        f"{b}->{a}.enabled": "true",
        f"{b}->{a}.topics": ", ".join(plan.inbound()),
        # Same names on both sides; the disjoint topic sets above are what keeps records from looping.
        "replication.policy.class": IDENTITY,
        "groups": re.escape(t.prefix) + ".*",
        "tasks.max": "1",
        "replication.factor": rf,
        "offset-syncs.topic.replication.factor": rf,
        "checkpoints.topic.replication.factor": rf,
        "heartbeats.topic.replication.factor": rf,
        "config.storage.replication.factor": rf,
        "offset.storage.replication.factor": rf,
        "status.storage.replication.factor": rf,
        "emit.checkpoints.interval.seconds": "5",
        "emit.heartbeats.interval.seconds": "5",
        "sync.group.offsets.enabled": "false",
        "sync.topic.acls.enabled": "false",
        # New topics (a policy's weights created later) are picked up within seconds, not 10 minutes.
        "refresh.topics.interval.seconds": "5",
        "refresh.groups.interval.seconds": "30",
        # Source offsets committed every 2 s: a restart replays at most that much (at-least-once).
        "offset.flush.interval.ms": "2000",
        # Aborted weight chunks never cross; whole weight chunks fit MM2's requests.
        **{f"{c}.consumer.isolation.level": "read_committed" for c in (a, b)},
        **{f"{c}.producer.max.request.size": big for c in (a, b)},
        **{f"{c}.consumer.max.partition.fetch.bytes": big for c in (a, b)},
        **{f"{c}.producer.linger.ms": "5" for c in (a, b)},
    }
    if plan.exactly_once:
        # KIP-618 in dedicated mode (Kafka >= 3.5): transactional writes to each target cluster;
        # the workers of a flow talk over Connect's internal REST API (KIP-710).
        props.update({f"{c}.exactly.once.source.support": "enabled" for c in (a, b)})
        props.update({"dedicated.mode.enable.internal.rest": "true", "listeners": "http://127.0.0.1:0"})
    return props


def prepare_topics(plan: MirrorPlan, policies: list[str], settings: TopicSettings) -> dict[str, dict[str, str]]:
    """Creates the region's tasks topic on A and every topic of the experiment (and that one) on
    the region's cluster, so its roles start before MM2 has copied anything; returns, per side,
    topic -> 'created' | 'exists'."""
    from astraflow.config import KafkaSettings
    from astraflow.kafka.topics import TopicAdmin, TopicSpec, topic_specs

    specs = topic_specs(plan.experiment, policies, settings)
    tasks = next(s for s in specs if s.name == plan.topics.tasks)
    regional = TopicSpec(plan.topics.tasks_of(plan.region), tasks.partitions, tasks.config)
    # Region B's cluster may have fewer brokers than A's min.insync.replicas asks for.
    there = [TopicSpec(s.name, s.partitions, {k: v for k, v in s.config.items()
                                              if k != "min.insync.replicas" or int(v) <= plan.replication_factor})
             for s in [*specs, regional]]
    return {plan.source_region: TopicAdmin(KafkaSettings(bootstrap_servers=plan.source_bootstrap)).create([regional]),
            plan.region: TopicAdmin(KafkaSettings(bootstrap_servers=plan.target_bootstrap)).create(
                there, plan.replication_factor)}


def _escape(value: str) -> str:
    """A value for a Java .properties file (a backslash escapes the next character there)."""
    return value.replace("\\", "\\\\")


def render(props: dict[str, str]) -> str:
    return "".join(f"{k} = {_escape(v)}\n" for k, v in props.items())


class Mirror:
    """The MM2 process of one plan, its files under `root` (mm2.properties, mm2.pid, logs/)."""

    def __init__(self, plan: MirrorPlan, root: Path, libs: Path | None = None, heap_mb: int = 384) -> None:
        self.plan, self.root, self.libs, self.heap_mb = plan, root.expanduser().resolve(), libs, heap_mb
        self.properties = self.root / "mm2.properties"
        self.pid_file = self.root / "mm2.pid"
        self.log = self.root / "logs" / "mirror.log"

    def pid(self) -> int | None:
        """The pid of our MirrorMaker process, when its pid file names one that runs."""
        try:
            pid = int(self.pid_file.read_text().strip())
            cmdline = Path(f"/proc/{pid}/cmdline").read_bytes()
        except (OSError, ValueError):
            return None
        return pid if MAIN.encode() in cmdline and alive(pid) else None

    def up(self, echo: Echo = print, timeout_s: float = 120.0) -> int:
        """Writes the configuration, starts MirrorMaker unless it runs, and waits until both flows'
        source connectors have started; returns its pid."""
        pid = self.pid()
        if pid is not None:
            echo(f"MirrorMaker already running (pid {pid}); nothing to do")
            return pid
        if self.libs is None:
            raise LocalKafkaError("Mirror.up needs the jars folder (LocalKafka(...).libs after resolve_jars)")
        java = require("java", "install a Java 17+ runtime, e.g. `apt-get install openjdk-17-jre-headless`")
        (self.root / "logs").mkdir(parents=True, exist_ok=True)
        self.properties.write_text(render(mirror_properties(self.plan)))
        log4j = self.root / "log4j2.properties"
        log4j.write_text(MM2_LOG4J2.format(log=self.log))
        offset = self.log.stat().st_size if self.log.exists() else 0
        cmd = [java, f"-Xms{min(128, self.heap_mb)}m", f"-Xmx{self.heap_mb}m", "-XX:+UseG1GC", "-Djava.awt.headless=true",
               f"-Dlog4j2.configurationFile={log4j}", "-cp", f"{self.libs}/*", MAIN, str(self.properties)]
        with open(self.root / "logs" / "mirror.out", "ab") as out:
            proc = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, start_new_session=True)
        self.pid_file.write_text(str(proc.pid))
        a, b = self.plan.aliases
        echo(f"Starting MirrorMaker 2 (pid {proc.pid}): {a} -> {b} and back; log {self.log}")
        deadline = time.monotonic() + timeout_s
        want = {f"{a}->{b}", f"{b}->{a}"}
        while time.monotonic() < deadline:
            if proc.poll() is not None:
                self.pid_file.unlink(missing_ok=True)
                raise LocalKafkaError(f"MirrorMaker exited during start-up (code {proc.returncode}):\n{self.log_tail(40)}")
            if want <= self._started_flows(offset):
                return proc.pid
            time.sleep(0.5)
        self.down(echo=lambda *_: None)
        raise LocalKafkaError(f"MirrorMaker's flows did not start within {timeout_s:.0f}s:\n{self.log_tail(40)}")

    def _started_flows(self, offset: int) -> set[str]:
        """Flows whose MirrorSourceConnector task has started, from the log written since `offset`."""
        try:
            with open(self.log, "rb") as f:
                f.seek(offset)
                text = f.read().decode(errors="replace")
        except OSError:
            return set()
        return set(re.findall(r"MirrorSourceConnector-\d+ replicating \d+ topic-partitions ([\w-]+->[\w-]+):", text))

    def down(self, echo: Echo = print, timeout_s: float = 30.0) -> bool:
        """Stops only the process our pid file names; False when none ran."""
        pid = self.pid()
        self.pid_file.unlink(missing_ok=True)
        if pid is None:
            echo("No MirrorMaker is running from this data directory")
            return False
        stop_pid(pid, timeout_s)
        echo(f"MirrorMaker (pid {pid}) stopped")
        return True

    def log_tail(self, lines: int = 50) -> str:
        if not self.log.exists():
            return f"no log yet at {self.log}"
        return "\n".join(self.log.read_text(errors="replace").splitlines()[-lines:])
