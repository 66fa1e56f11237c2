"""Typed, frozen configuration for every AstraFlow process.

Resolution order (later wins): defaults -> a YAML or TOML file -> environment variables
`ASTRAFLOW__SECTION__FIELD` (double underscores separate levels) -> command-line overrides
`section.field=value`. `write_resolved` stores the result as JSON in the run directory, with
secrets masked, so every run records exactly what it ran with.
"""

from __future__ import annotations

import json
import os
import tomllib
from pathlib import Path
from typing import Any, Literal

import yaml
from pydantic import BaseModel, ConfigDict, Field, SecretStr, ValidationError, model_validator

from astraflow.errors import ConfigError
from astraflow.secrets import install_log_redaction, redact_tree, register_secret

ENV_PREFIX = "ASTRAFLOW__"


class FrozenSettings(BaseModel):
    """Base of every settings section: immutable, and an unknown field is an error (a typo in a
    config file fails loudly instead of being ignored)."""

    model_config = ConfigDict(frozen=True, extra="forbid")


def default_home() -> Path:
    """Where AstraFlow keeps local state (Kafka data, caches): `$ASTRAFLOW_HOME` or ~/.cache/astraflow."""
    return Path(os.environ.get("ASTRAFLOW_HOME", Path.home() / ".cache" / "astraflow"))


class KafkaSettings(FrozenSettings):
    """How to reach a Kafka cluster: the local one by default, or any external cluster."""

    bootstrap_servers: str = "127.0.0.1:19092"
    """Comma-separated host:port list."""
    security_protocol: Literal["PLAINTEXT", "SSL", "SASL_PLAINTEXT", "SASL_SSL"] = "PLAINTEXT"
    """librdkafka `security.protocol`; managed clusters usually need SASL_SSL."""
    sasl_mechanism: Literal["PLAIN", "SCRAM-SHA-256", "SCRAM-SHA-512", "OAUTHBEARER"] | None = None
    """SASL mechanism when the protocol is SASL_*."""
    sasl_username: str | None = None
    """SASL user name."""
    sasl_password: SecretStr | None = None
    """SASL password (masked in the resolved config)."""
    ssl_ca_location: str | None = None
    """CA bundle to verify the brokers, for SSL / SASL_SSL."""
    ssl_certificate_location: str | None = None
    """Client certificate for mutual TLS."""
    ssl_key_location: str | None = None
    """Client key for mutual TLS."""
    schema_registry_url: str | None = None
    """A Confluent-API schema registry (`astraflow registry up` runs Apicurio's at
    http://127.0.0.1:18081/apis/ccompat/v7). When set, every role registers its schema versions
    there on start and reads writers' schemas it does not ship from it (docs/schemas.md)."""
    schema_registry_config: dict[str, str] = Field(default_factory=dict)
    """Extra SchemaRegistryClient settings (`basic.auth.user.info`, `ssl.ca.location`, ...)."""
    schema_registry_wait_s: float = Field(default=120.0, ge=0.0)
    """How long a role's start-up waits for the registry to answer before it fails."""
    record_framing: Literal["single_object", "confluent"] | None = None
    """How records are framed on this experiment's topics: `single_object` (`C3 01` + the
    schema's fingerprint; no registry needed) or `confluent` (`00` + the registry's schema id,
    which registry-aware tools read). Unset: confluent when a registry is set, else
    single_object. Every role reads both, whatever this says."""
    client_extra: dict[str, str] = Field(default_factory=dict)
    """Extra librdkafka properties passed verbatim to every client."""
    group_session_timeout_s: float = Field(default=6.0, ge=1.0, le=1800.0)
    """How long a consumer group waits for a member that stopped heartbeating (kill -9, a frozen
    host, a cut link) before it gives that member's partitions to the others: about the longest
    a task waits after its node dies. Members heartbeat every `min(1 s, this / 3)` from a
    background thread, so a busy event loop does not count against it. Shorter moves work sooner
    but expels a member that is silent that long; the broker's `group.min.session.timeout.ms`
    (6 s by default) bounds it from below (RaaS nodes and stream apps; the trainer assigns its
    partitions and has no group session)."""

    @property
    def heartbeat_interval_s(self) -> float:
        """Group heartbeat period: a third of the session, at most 1 s."""
        return min(1.0, self.group_session_timeout_s / 3)

    @model_validator(mode="after")
    def _check_sasl(self) -> KafkaSettings:
        if self.record_framing == "confluent" and not self.schema_registry_url:
            raise ValueError("kafka.record_framing=confluent needs kafka.schema_registry_url (e.g. `astraflow registry up`)")
        if self.security_protocol.startswith("SASL") and not self.sasl_mechanism:
            raise ValueError(f"security_protocol={self.security_protocol} needs kafka.sasl_mechanism (e.g. PLAIN)")
        if self.sasl_mechanism and not self.security_protocol.startswith("SASL"):
            raise ValueError("kafka.sasl_mechanism is set but security_protocol is not SASL_PLAINTEXT/SASL_SSL")
        return self

    def client_config(self) -> dict[str, str]:
        """librdkafka properties common to producers, consumers and admin clients."""
        conf: dict[str, str] = {"bootstrap.servers": self.bootstrap_servers, "security.protocol": self.security_protocol}
        if self.sasl_mechanism:
            conf["sasl.mechanism"] = self.sasl_mechanism
            conf["sasl.username"] = self.sasl_username or ""
            conf["sasl.password"] = self.sasl_password.get_secret_value() if self.sasl_password else ""
            register_secret(conf["sasl.password"])  # masked in every log line from here on
        for key, value in (
            ("ssl.ca.location", self.ssl_ca_location),
            ("ssl.certificate.location", self.ssl_certificate_location),
            ("ssl.key.location", self.ssl_key_location),
        ):
            if value:
                conf[key] = value
        conf.update(self.client_extra)
        for key, value in self.client_extra.items():
            if "password" in key or "secret" in key:
                register_secret(value)
        return conf


class LocalKafkaSettings(FrozenSettings):
    """The Apache Kafka (KRaft) that `astraflow kafka up` runs on this machine: one node or several."""

    data_dir: Path = Field(default_factory=lambda: default_home() / "kafka")
    """KRaft storage, logs, pid files (and, when secure, credentials) live here."""
    jars_dir: Path = Field(default_factory=lambda: default_home() / "kafka-jars")
    """Kafka's jars, resolved once per pom and shared by every data directory."""
    port: int = 19092
    """Client listener of node 1 on 127.0.0.1 (uncommon default, so it does not clash with another
    Kafka); node i listens on `port + 2*(i-1)`."""
    controller_port: int = 19093
    """KRaft controller listener of node 1 on 127.0.0.1; node i uses `controller_port + 2*(i-1)`."""
    brokers: int = Field(1, ge=1, le=5)
    """Nodes, each broker and controller at once. 3 gives replication factor 3 with
    min.insync.replicas 2 (topics and the offsets / transaction-state topics): one node may die."""
    secure: bool = False
    """SASL/SCRAM-SHA-512 on the client listener and ACLs (StandardAuthorizer): see docs/deploy-secure.md."""
    wan_proxy_port: int | None = None
    """Region B (docs/deploy-regions.md): node i also advertises a second listener at
    `wan_proxy_port + 2*(i-1)` on 127.0.0.1, where `astraflow wan up` runs a proxy with the WAN's
    latency and bandwidth; the broker itself listens for it on `wan_port` (+2*(i-1)). Clients
    bootstrapped at the proxy get only proxy addresses back, so they never bypass it. Unset: no
    second listener."""
    wan_port: int | None = None
    """The broker's own port behind the WAN proxy (default: `wan_proxy_port + 1`)."""
    heap_mb: int = 512
    """JVM heap per node; small machines are fine with 512 (three nodes: 1.5 GiB in all)."""
    start_timeout_s: float = 90.0
    """How long `up` waits for the broker to answer metadata requests."""


class LocalRegistrySettings(FrozenSettings):
    """The Apicurio schema registry that `astraflow registry up` runs on this machine."""

    data_dir: Path = Field(default_factory=lambda: default_home() / "registry")
    """Its log, pid file and database (`registry.mv.db`, Apicurio's H2 file: the schemas and
    their ids, kept across restarts) live here."""
    dist_dir: Path = Field(default_factory=lambda: default_home() / "registry-dist")
    """Apicurio's unpacked application, resolved once per pom and shared."""
    port: int = 18081
    """HTTP port on 127.0.0.1; the Confluent-compatible API is at /apis/ccompat/v7."""
    heap_mb: int = Field(default=256, ge=64)
    """JVM heap; the registry holds a few dozen schemas, 256 MiB is plenty."""
    java: str | None = None
    """A Java 21+ executable; unset: $ASTRAFLOW_REGISTRY_JAVA, then the first Java 21+ found
    under $JAVA_HOME, /usr/lib/jvm and on PATH."""
    start_timeout_s: float = 120.0
    """How long `up` waits for the registry to answer."""

    @property
    def url(self) -> str:
        """The URL to put in `kafka.schema_registry_url`."""
        return f"http://127.0.0.1:{self.port}/apis/ccompat/v7"


class WanSettings(FrozenSettings):
    """The simulated WAN link of `astraflow wan up` (Toxiproxy) between region B and the local Kafka."""

    data_dir: Path = Field(default_factory=lambda: default_home() / "wan")
    """The proxy's pid file and log."""
    bin_dir: Path = Field(default_factory=lambda: default_home() / "toxiproxy")
    """Where the Toxiproxy server binary is built (`go install`, once) and kept."""
    version: str = "2.5.0"
    """Toxiproxy release built from the Go module proxy."""
    api_port: int = 18474
    """Toxiproxy's HTTP API on 127.0.0.1."""
    latency_ms: int = Field(150, ge=0)
    """Added each way: the round trip gets twice this (150: the 300 ms RTT between continents)."""
    jitter_ms: int = Field(0, ge=0)
    """Random +- on each way's latency."""
    rate_kb_s: int = Field(256, ge=1)
    """Bandwidth cap per connection and direction, KB/s. Scale it to the model: 256 KB/s moves the
    tiny model's 0.8 MB bf16 snapshot in about 3 s, as 4 Gbit/s moves a 7B model's in about 30 s."""


class TopicSettings(FrozenSettings):
    """Partitions and retention of an experiment's topics."""

    partitions: int = 4
    """Partitions of the work topics (tasks, rollouts, scored, train): the parallelism ceiling."""
    tasks_partitions: int | None = Field(None, ge=1)
    """Partitions of `tasks` (None: `partitions`). The curator places each task in the partition
    where it would wait least, so nodes of different speeds get shares that follow their speed;
    that needs a few partitions per RaaS node (2-4x the nodes)."""
    replication_factor: int | None = None
    """Replicas per partition; None uses the cluster's `default.replication.factor` (1 on the single
    local broker, 3 on `kafka up --brokers 3`; set 3 explicitly on a production cluster)."""
    min_insync_replicas: int | None = None
    """`min.insync.replicas` of every topic (None: the broker's default). With replication factor 3,
    2 means an acks=all write survives the loss of any one broker."""
    rollouts_retention_ms: int = 30 * 24 * 3600 * 1000
    """Rollout logs are kept long, for replay."""
    work_retention_ms: int = 7 * 24 * 3600 * 1000
    """Retention of the other delete-policy topics."""
    weights_retention_bytes: int = 2 * 1024**3
    """Weights topics are bounded by size per partition."""
    max_message_bytes: int = 16 * 1024 * 1024
    """`max.message.bytes` of the weights topics (chunks); keep managed-cluster limits in mind."""

    @model_validator(mode="after")
    def _check_isr(self) -> TopicSettings:
        rf = self.replication_factor
        if rf is not None and rf < 1:
            raise ValueError(f"topics.replication_factor={rf} must be at least 1 (or unset: the cluster's default)")
        if self.min_insync_replicas is not None and not 1 <= self.min_insync_replicas <= (rf or self.min_insync_replicas):
            raise ValueError(
                f"topics.min_insync_replicas={self.min_insync_replicas} must be between 1 and "
                f"topics.replication_factor={self.replication_factor} (or a write could never succeed)"
            )
        return self


class RaasSettings(FrozenSettings):
    """What a RaaS node accepts from the tasks topic, and how long one rollout may run.

    Every Task is checked against these limits before any work; a task outside them goes to
    the DLQ with the field and the limit.
    """

    workflow_modules: list[str] = Field(default_factory=list)
    """Modules whose workflows tasks may name as `module:function` (a listed module or any of its
    submodules). Empty: only registered workflows (the built-ins rlvr, tool_use, solver_verifier,
    db_agent, os_agent, code_agent)."""
    rollout_timeout_s: float = Field(600.0, gt=0)
    """Deadline of one rollout (one sample of a task); past it the sample becomes an ERROR trajectory."""
    engine_restarts: int = Field(3, ge=0)
    """torch backend: times the engine process is started again after it died (crash, OOM kill)
    within one node's life. Its newest weights are restored before it takes requests; the
    requests it was running fail (ERROR trajectories: one of them may be what killed it), the
    ones that arrive meanwhile wait. 0: a dead engine fails every later request."""
    catch_up_timeout_s: float = Field(300.0, ge=0)
    """A node that follows weights joins the tasks group only once it serves the newest version
    published on the `policies` topic when it started (a restarted node must not answer tasks
    with the weights it booted with); past this many seconds it serves anyway, every token
    still tagged with the version that produced it. 0: no wait."""
    max_n_samples: int = Field(256, ge=1)
    """Largest `Task.n_samples` served."""
    max_tokens: int = Field(8192, ge=1)
    """Largest `sampling.max_tokens` (new tokens per model call)."""
    max_turns: int = Field(32, ge=1)
    """Largest `sampling.max_turns` of multi-turn workflows."""
    max_prompt_chars: int = Field(200_000, ge=1)
    """Longest `Task.prompt`, in characters."""
    max_stop_strings: int = Field(16, ge=0)
    """Most `sampling.stop` strings, each at most `max_stop_chars` long."""
    max_stop_chars: int = Field(256, ge=1)
    """Longest stop string."""
    group_session_timeout_s: float | None = Field(None, ge=1.0, le=1800.0)
    """The nodes' own session in the tasks group (unset: `kafka.group_session_timeout_s`): after
    a `kill -9` or a lost host, the node's prefetched and running tasks wait this long (plus a
    rebalance) before another node redoes them. Heartbeats every third of it, at most 1 s. Below
    6 s the brokers' `group.min.session.timeout.ms` must allow it (`astraflow kafka up` and the
    compose broker set 1 s; a managed cluster may not let you), or the node cannot join."""


class WeightFollowSettings(FrozenSettings):
    """What a weight follower (a RaaS node, the evaluator) accepts from a weights topic."""

    allowed_uri_prefixes: list[str] = Field(default_factory=list)
    """Locations claim-checked payloads may be read from (e.g. `s3://bucket/weights/`,
    `file:///data/store/`). Empty: only in-band payloads are applied; a manifest naming any URI
    is refused."""
    max_payload_bytes: int = Field(16 * 1024**3, ge=1024)
    """Largest payload (delta or snapshot, as sent) a follower buffers or reads from the store."""
    max_state_bytes: int = Field(64 * 1024**3, ge=1024)
    """Most bytes of tensors one payload may decode to (a follower that knows its model's layout
    also refuses any tensor the model does not have)."""


class SandboxSettings(FrozenSettings):
    """How sandbox runs are isolated on this machine (`astraflow.sandbox.settings` says why these
    are operator settings and how a process gets them)."""

    allow_weak_isolation: bool = False
    """Run untrusted code with resource limits only (no namespaces, seccomp or cgroups) where
    bubblewrap, user namespaces, seccomp or the cgroup controllers are missing. Off by default:
    without it such a machine refuses to run the code at all."""
    bwrap: str = "bwrap"
    """The bubblewrap binary (a name looked up on PATH, or a path)."""
    python: str | None = None
    """Interpreter for the untrusted code (its installation is shown read-only inside the
    sandbox); None: the base interpreter of the running one (not a virtualenv)."""
    total_memory_mb: int = Field(default=8192, ge=64)
    """Memory of all sandbox runs on this machine together (a cgroup above every run's own)."""
    cgroup_parent: str = Field(default="astraflow-sandbox", pattern=r"^[A-Za-z0-9_.-]+$")
    """Name of that cgroup (in the memory and pids hierarchies); runs sharing it share the total."""


class AstraflowConfig(FrozenSettings):
    """Root configuration shared by every role."""

    experiment: str = "default"
    """Experiment name: topics are af.<experiment>.<stream>."""
    run_dir: Path = Path("runs")
    """Where each process writes its resolved config, logs and checkpoints."""
    kafka: KafkaSettings = Field(default_factory=KafkaSettings)
    local_kafka: LocalKafkaSettings = Field(default_factory=LocalKafkaSettings)
    local_registry: LocalRegistrySettings = Field(default_factory=LocalRegistrySettings)
    wan: WanSettings = Field(default_factory=WanSettings)
    topics: TopicSettings = Field(default_factory=TopicSettings)
    raas: RaasSettings = Field(default_factory=RaasSettings)
    weights: WeightFollowSettings = Field(default_factory=WeightFollowSettings)
    sandbox: SandboxSettings = Field(default_factory=SandboxSettings)


def _read_file(path: Path) -> dict[str, Any]:
    if not path.is_file():
        raise ConfigError(f"config file {path} not found")
    text = path.read_text()
    try:
        if path.suffix in (".yaml", ".yml"):
            data = yaml.safe_load(text) or {}
        elif path.suffix == ".toml":
            data = tomllib.loads(text)
        else:
            raise ConfigError(f"config file {path} must end in .yaml, .yml or .toml")
    except (yaml.YAMLError, tomllib.TOMLDecodeError) as exc:
        raise ConfigError(f"config file {path} is not valid {path.suffix[1:].upper()}: {exc}") from exc
    if not isinstance(data, dict):
        raise ConfigError(f"config file {path} must hold a mapping at the top level")
    return data


def _set_path(tree: dict[str, Any], dotted: list[str], value: Any) -> None:
    node = tree
    for part in dotted[:-1]:
        node = node.setdefault(part, {})
        if not isinstance(node, dict):
            raise ConfigError(f"cannot set {'.'.join(dotted)}: {part} is not a section")
    node[dotted[-1]] = value


def _parse_scalar(text: str) -> Any:
    """Override values are YAML scalars: `3`, `true`, `[a, b]`, `{k: v}` or plain strings."""
    try:
        return yaml.safe_load(text)
    except yaml.YAMLError:
        return text


def load_config(
    path: str | Path | None = None,
    overrides: list[str] | None = None,
    env: dict[str, str] | None = None,
    model: type[BaseModel] = AstraflowConfig,
) -> Any:
    """Builds a frozen config from a file, the environment and `key.path=value` overrides."""
    install_log_redaction()
    tree: dict[str, Any] = _read_file(Path(path)) if path else {}
    env = os.environ if env is None else env
    for key, value in sorted(env.items()):
        if key.startswith(ENV_PREFIX):
            _set_path(tree, key[len(ENV_PREFIX) :].lower().split("__"), _parse_scalar(value))
    for item in overrides or []:
        if "=" not in item:
            raise ConfigError(f"override {item!r} must look like section.field=value (e.g. kafka.bootstrap_servers=h:9092)")
        key, value = item.split("=", 1)
        _set_path(tree, key.strip().split("."), _parse_scalar(value))
    try:
        return model.model_validate(tree)
    except ValidationError as exc:
        problems = "; ".join(f"{'.'.join(str(p) for p in e['loc']) or '<root>'}: {e['msg']}" for e in exc.errors())
        raise ConfigError(f"invalid configuration: {problems}") from exc


def redacted(config: BaseModel) -> dict[str, Any]:
    """The config as JSON-ready data with every secret masked: secret fields (SASL password,
    `client_extra` passwords, any `*password*` / `*token*` / `*secret*` key) and passwords inside
    URLs (`s3://user:pass@...`, a schema registry URL with credentials)."""
    return redact_tree(json.loads(config.model_dump_json()))


def write_resolved(config: BaseModel, run_dir: Path, name: str = "config.json") -> Path:
    """Writes the resolved config as JSON (secrets masked) into `run_dir`, returning the path."""
    run_dir.mkdir(parents=True, exist_ok=True)
    out = run_dir / name
    out.write_text(json.dumps(redacted(config), indent=2, sort_keys=True) + "\n")
    return out
