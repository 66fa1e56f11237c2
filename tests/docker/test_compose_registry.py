"""The compose stack's schema registry for real: its image built, a role in the stack pointed at it.

`AF_REGISTRY=1 scripts/compose.sh build` builds the images, the registry's among them (Apicurio's
application and a Java runtime jlinked from this host's JDK, staged by `astraflow registry
bundle`), then a small compose project of its own (unique name, free host ports) runs only
Kafka, the registry (`--profile registry`) and the one-shot topic creation:

1. the registry's Confluent-compatible API answers on its published host port;
2. the operator's CLI in a one-off container of the stack (the `topics` service, whose
   `kafka.schema_registry_url` is the in-network http://registry:8080/apis/ccompat/v7 that
   AF_REGISTRY=1 sets) writes a control record: like every role on start, it registers every
   shipped schema version with its record's rule, then writes in Confluent framing;
3. from the host, confluent-kafka's own `SchemaRegistryClient` finds every subject with its rule
   and every version, and its `AvroDeserializer` decodes that control record off the topic;
4. the registry restarts and still serves that record's schema id and every subject (its
   database is in a volume);
5. `down -v` leaves no container, network or volume of the project.

Needs a Docker engine and a Java 21+ JDK on the host (the registry image's runtime); skips
without an engine unless ASTRAFLOW_REQUIRE_DOCKER=1 (then it fails).
"""

from __future__ import annotations

import re
import subprocess
import sys
import time
import urllib.request
import uuid
from collections.abc import Iterator

import pytest
from compose_env import (
    ROOT,
    ComposeProject,
    client,
    free_ports,
    project_is_gone,
    remove_stale_projects,
    require_engine,
)

from astraflow.config import KafkaSettings

# The timeout covers a first build of every image on a fresh machine (about 20 min here).
pytestmark = [pytest.mark.docker, pytest.mark.slow, pytest.mark.timeout(3600)]

EXPERIMENT = "reg"
PROJECT_PREFIX = "afreg"  # this test's compose projects; one left by a killed run is removed first


class RegistryStack(ComposeProject):
    """Kafka, the registry and the topics job of the compose file, on free host ports."""

    def __init__(self) -> None:
        self.kafka_port, self.registry_port = free_ports(2)
        super().__init__(PROJECT_PREFIX, {
            "AF_REGISTRY": "1",
            "AF_PYTHON": sys.executable,  # stages the registry image with this checkout's astraflow
            "AF_EXPERIMENT": EXPERIMENT,
            "AF_KAFKA_HOST_PORT": str(self.kafka_port),
            "AF_REGISTRY_HOST_PORT": str(self.registry_port),
            "AF_KAFKA_HEAP_MB": "512",
        })
        self.kafka = KafkaSettings(bootstrap_servers=f"127.0.0.1:{self.kafka_port}")
        self.registry_url = f"http://127.0.0.1:{self.registry_port}/apis/ccompat/v7"

    def answers(self) -> bool:
        try:
            with urllib.request.urlopen(f"{self.registry_url}/subjects", timeout=2) as resp:
                return resp.status == 200
        except OSError:
            return False

    def wait(self, what: str, check, timeout_s: float, poll_s: float = 0.5) -> None:
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if check():
                return
            time.sleep(poll_s)
        raise AssertionError(f"timed out after {timeout_s:.0f} s waiting for {what}\n{self.logs()}")

    def state(self, service: str) -> list[str]:
        """`[status, exit code, health]` of the service's first container ([] before it exists)."""
        ids = self.containers(service, all_=True)
        if not ids:
            return []
        return subprocess.run([client(), "inspect", "--format",
                               "{{.State.Status}} {{.State.ExitCode}} {{if .State.Health}}{{.State.Health.Status}}{{end}}",
                               ids[0]], capture_output=True, text=True).stdout.split()


@pytest.fixture(scope="module")
def stack() -> Iterator[RegistryStack]:
    require_engine()
    remove_stale_projects(PROJECT_PREFIX)
    s = RegistryStack()
    t0 = time.monotonic()
    s.script("base")
    s.script("build")
    print(f"images built in {time.monotonic() - t0:.0f} s")
    version = re.search(r"<apicurio\.version>([^<]+)<", (ROOT / "docker" / "registry" / "pom.xml").read_text()).group(1)
    size = subprocess.run([client(), "image", "inspect", "--format", "{{.Size}}", f"astraflow/registry:{version}"],
                          capture_output=True, text=True, check=True).stdout.strip()
    print(f"registry image astraflow/registry:{version}: {int(size) / 1e6:.0f} MB")
    try:
        yield s
    finally:
        s.dc("down", "-v", "--remove-orphans", "--timeout", "60", timeout=900)


def test_registry_service_takes_a_roles_schemas_with_their_rules(stack: RegistryStack) -> None:
    from confluent_kafka import TopicPartition
    from confluent_kafka.schema_registry import SchemaRegistryClient
    from confluent_kafka.schema_registry.avro import AvroDeserializer
    from confluent_kafka.serialization import MessageField, SerializationContext

    from astraflow.kafka.clients import consume_ready, data_messages, reader
    from astraflow.kafka.topics import Topics
    from astraflow.schema_catalog import SchemaCatalog
    from astraflow.schema_compat import load_rules

    # 1. Kafka and the registry; the API answers on the host's loopback.
    t0 = time.monotonic()
    stack.dc("up", "-d", "--no-build", "kafka", "registry", timeout=600)
    stack.wait("the registry's API on the host", stack.answers, 300)
    print(f"registry answering {time.monotonic() - t0:.1f} s after `up` "
          f"({' '.join(re.findall(r'started in [0-9.]+s', stack.logs(200, 'registry')))})")
    stack.wait("the registry container healthy", lambda: stack.state("registry")[-1:] == ["healthy"], 120, poll_s=2)

    # 2. The topics, then a role in the stack writes through the registry service.
    stack.dc("up", "-d", "--no-build", "topics", timeout=600)
    stack.wait("the topics job", lambda: stack.state("topics")[:2] == ["exited", "0"], 300, poll_s=2)
    stack.dc("run", "--rm", "--no-deps", "-T", "topics", "control", "set", "-e", EXPERIMENT,
             "curate", "filter.length", "none", timeout=300)

    # 3. Confluent's own client, from the host: every subject with its rule and every version.
    registry = SchemaRegistryClient({"url": stack.registry_url})
    catalog, rules = SchemaCatalog.load(), load_rules()
    subjects = set(registry.get_subjects())
    assert set(catalog.names()) <= subjects, set(catalog.names()) - subjects
    for name in catalog.names():
        assert registry.get_compatibility(name) == rules[name], name
        assert len(registry.get_versions(name)) >= len(catalog.versions(name)), name

    topic = Topics(EXPERIMENT).control
    consumer = reader(stack.kafka, f"registry-test-{uuid.uuid4().hex[:6]}")
    try:
        parts = consumer.list_topics(topic, timeout=30).topics[topic].partitions
        consumer.assign([TopicPartition(topic, p, 0) for p in parts])
        msgs: list = []
        deadline = time.monotonic() + 60
        while not msgs and time.monotonic() < deadline:
            msgs = list(data_messages(consume_ready(consumer, 10, 0.5), topic))
    finally:
        consumer.close()
    assert len(msgs) == 1, msgs
    assert msgs[0].value()[0] == 0, "Confluent framing: magic byte 0, then the registry's schema id"
    control = AvroDeserializer(registry)(msgs[0].value(), SerializationContext(topic, MessageField.VALUE))
    assert (control["app"], control["slot"], control["strategy"]) == ("curate", "filter.length", "none")

    # 4. A restarted registry serves the same ids (a fresh client: nothing cached).
    schema_id = int.from_bytes(msgs[0].value()[1:5], "big")
    stack.dc("restart", "registry", timeout=300)
    stack.wait("the restarted registry's API", stack.answers, 300)
    again = SchemaRegistryClient({"url": stack.registry_url})
    assert '"Control"' in again.get_schema(schema_id).schema_str
    assert set(catalog.names()) <= set(again.get_subjects())
    stats = subprocess.run([client(), "stats", "--no-stream", "--format", "{{.MemUsage}}", *stack.containers("registry")],
                           capture_output=True, text=True).stdout.strip()
    print(f"registry container memory: {stats}")


def test_registry_down_leaves_nothing_behind(stack: RegistryStack) -> None:
    stack.dc("down", "-v", "--remove-orphans", "--timeout", "60", timeout=900)
    project_is_gone(stack.project)
