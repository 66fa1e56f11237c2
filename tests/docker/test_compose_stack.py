"""The docker-compose stack for real: built images, every role in its container, scaled, faulted, counted.

`scripts/compose.sh build` (BuildKit caches: seconds once the images were built on this machine),
then one compose project of its own (unique name, its own host ports) runs the whole pipeline:

1. Kafka and the one-shot topic creation come up first; the test switches curate's dropping
   filters off on the control topic, so every task must reach the trainer (a counted workload);
2. the rest comes up; the test waits until the trainer has published 3 versions and the node has
   applied one (Prometheus, which scrapes every role's own endpoint);
3. `--scale raas=3`: the two new nodes apply a version too;
4. one node container's process is killed (`kill -9` from the host, as a crash or the OOM killer
   does) mid-work and the container comes back by itself (restart policy; `docker kill` is an
   operator's stop, which no policy undoes), and `docker-compose restart curate` restarts a
   stream app;
5. the curator is paused and the test counts: every task group on the tasks topic reaches the train
   topic (or the DLQ, with its reason): nothing lost;
6. Prometheus answers a query for a metric of every role, each scraped from the role itself;
7. `down -v` leaves no container, network or volume of the project.

Needs a Docker engine: `scripts/test.sh` starts one (and stops it if it did). Elsewhere the test
skips without an engine, unless ASTRAFLOW_REQUIRE_DOCKER=1 (then it fails).
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
import urllib.parse
import urllib.request
import uuid
from collections.abc import Iterator
from dataclasses import dataclass, field

import pytest
from compose_env import (
    ROOT,
    ComposeProject,
    free_ports,
    project_is_gone,
    remove_stale_projects,
    require_engine,
)
from compose_env import client as _client

from astraflow.config import KafkaSettings
from astraflow.errors import SerdeError

# The timeout covers a first build on a fresh machine (about 20 min here) and the test (about 11).
pytestmark = [pytest.mark.docker, pytest.mark.slow, pytest.mark.timeout(3600)]

EXPERIMENT = "ci"
PROJECT_PREFIX = "afci"  # this test's compose projects; one left by a killed run is removed first
CURATE_FILTERS = ("filter.zero_variance", "filter.length", "filter.staleness")


class Stack(ComposeProject):
    """The whole stack as one compose project; `query(...)` asks its Prometheus."""

    def __init__(self) -> None:
        # Host ports (loopback only) the system has free now, not fixed ones another stack may hold.
        self.kafka_port, self.metrics_port, self.prometheus_port = free_ports(3)
        super().__init__(PROJECT_PREFIX, {
            "AF_EXPERIMENT": EXPERIMENT,
            "AF_KAFKA_HOST_PORT": str(self.kafka_port),
            "AF_METRICS_PORT": str(self.metrics_port),
            "AF_PROMETHEUS_PORT": str(self.prometheus_port),
            # A small counted workload: groups of 4, single-turn, short answers, a step per 16 samples.
            "AF_WORKFLOW": "rlvr",
            "AF_N_SAMPLES": "4",
            "AF_MAX_AHEAD": "12",
            "AF_MAX_TOKENS": "16",
            "AF_MAX_TURNS": "1",
            "AF_SFT_STEPS": "40",
            "AF_TRAINER_BATCH": "16",
            "AF_TRAINER_THREADS": "1",
        })
        self.kafka = KafkaSettings(bootstrap_servers=f"127.0.0.1:{self.kafka_port}")
        self.crashed: set[str] = set()  # containers the test crashed on purpose (full ids), until back

    def astraflow(self, *args: str) -> str:
        """The host's CLI against the stack's Kafka (published on the loopback)."""
        cmd = [sys.executable, "-m", "astraflow_cli.main", "--set", f"kafka.bootstrap_servers=127.0.0.1:{self.kafka_port}", *args]
        res = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=120)
        assert res.returncode == 0, f"astraflow {' '.join(args)}: {res.stdout}\n{res.stderr}"
        return res.stdout

    def operator(self, *args: str) -> str:
        """The operator's CLI inside the stack: a one-off container of the `topics` service, which
        mounts the experiment's keys volume, so its control records carry a signature the roles
        trust (the host's CLI signs with the host's own keys, which the containers refuse)."""
        return self.dc("run", "--rm", "--no-deps", "-T", "topics", "--config", "/etc/astraflow/astraflow.yaml",
                       *args, timeout=300)

    def query(self, promql: str) -> list[dict]:
        url = f"http://127.0.0.1:{self.prometheus_port}/api/v1/query?" + urllib.parse.urlencode({"query": promql})
        with urllib.request.urlopen(url, timeout=10) as resp:
            body = json.load(resp)
        assert body["status"] == "success", body
        return body["data"]["result"]

    def wait(self, what: str, check, timeout_s: float, poll_s: float = 5.0):
        deadline = time.monotonic() + timeout_s
        last: object = None
        while time.monotonic() < deadline:
            try:
                last = check()
            except (OSError, ValueError) as exc:  # Prometheus or Kafka not answering yet
                last = exc
            if last and not isinstance(last, Exception):
                return last
            self.check_no_role_failed()
            time.sleep(poll_s)
        raise AssertionError(f"timed out after {timeout_s:.0f} s waiting for {what} (last: {last!r})\n{self.logs()}")

    def check_no_role_failed(self) -> None:
        for cid in self.containers(all_=True):
            out = subprocess.run([_client(), "inspect", "--format",
                                  "{{.Id}} {{.Name}} {{.State.Status}} {{.State.ExitCode}}", cid],
                                 capture_output=True, text=True).stdout.split()
            if len(out) != 4:
                continue
            full_id, name, status, code = out
            if full_id not in self.crashed and status == "exited" and code != "0":
                raise AssertionError(f"container {name} exited with {code}\n{self.logs()}")

    def where_lost(self, groups: set[str]) -> str:
        """Every hop of a few lost groups (`astraflow trace`), and all the logs kept in a file."""
        out = []
        for group in sorted(groups)[:4]:
            try:
                out.append(self.astraflow("trace", group, "-e", EXPERIMENT))
            except AssertionError as exc:
                out.append(str(exc))
        logs = ROOT / "build" / f"{self.project}-logs.txt"
        logs.parent.mkdir(exist_ok=True)
        logs.write_text(self.dc("logs", "--no-color", "--timestamps", timeout=300))
        return "\n".join(out) + f"\nthe stack's whole logs: {logs}"

    def endpoint(self, service: str) -> str:
        """The astraflow_* lines of a service's own /metrics, read inside its container."""
        code = ("import urllib.request; print('\\n'.join(l for l in urllib.request.urlopen("
                "'http://127.0.0.1:9464/metrics', timeout=10).read().decode().splitlines() if l.startswith('astraflow')))")
        try:
            return self.dc("exec", "-T", service, "python", "-c", code, timeout=60)[-8000:]
        except AssertionError as exc:
            return str(exc)


@dataclass
class GroupLedger:
    """Task groups issued on the tasks topic, and where they went."""

    issued: set[str] = field(default_factory=set)
    trained: set[str] = field(default_factory=set)  # at least one sample on the train topic
    dead_lettered: dict[str, str] = field(default_factory=dict)  # group -> the dead letter's error
    samples_twice: int = 0  # sample ids seen more than once on the train topic

    @property
    def lost(self) -> set[str]:
        return self.issued - self.trained - set(self.dead_lettered)


def group_ledger(kafka: KafkaSettings, experiment: str, policy: str) -> GroupLedger:
    """Reads the tasks, train and DLQ topics from their start (read_committed) to their ends."""
    from astraflow.kafka.topics import Topics
    from astraflow.serde import AvroSerde

    topics, serde, ledger = Topics(experiment), AvroSerde(), GroupLedger()
    seen: set[str] = set()
    for rec in _read_all(kafka, topics.tasks, serde):
        ledger.issued.add(rec.group_id)
    for rec in _read_all(kafka, topics.train(policy), serde):
        ledger.trained.add(rec.group_id)
        ledger.samples_twice += rec.sample_id in seen
        seen.add(rec.sample_id)
    for rec in _read_all(kafka, topics.dlq, serde):
        try:
            original = serde.loads(rec.original) if rec.original else None
        except SerdeError:  # a dead letter of bytes that were never a record: no group to account
            continue
        group = getattr(original, "group_id", None)
        if group:
            ledger.dead_lettered[group] = f"{rec.component}: {rec.error_class}: {rec.error}"[:200]
    return ledger


def _read_all(kafka: KafkaSettings, topic: str, serde) -> list:
    from confluent_kafka import Consumer, KafkaError, TopicPartition

    consumer = Consumer({**kafka.client_config(), "group.id": f"docker-test-{uuid.uuid4().hex[:8]}",
                         "enable.auto.commit": False, "isolation.level": "read_committed",
                         "enable.partition.eof": True, "auto.offset.reset": "earliest"})
    try:
        parts = sorted(consumer.list_topics(topic, timeout=30).topics[topic].partitions)
        consumer.assign([TopicPartition(topic, p, 0) for p in parts])
        out, eof = [], set()
        deadline = time.monotonic() + 60
        while len(eof) < len(parts) and time.monotonic() < deadline:
            for msg in consumer.consume(500, 0.5):
                if msg.error() is not None:
                    if msg.error().code() == KafkaError._PARTITION_EOF:
                        eof.add(msg.partition())
                    continue
                eof.discard(msg.partition())
                out.append(serde.loads(msg.value()))
        assert len(eof) == len(parts), f"could not read {topic} to its end within 60 s"
        return out
    finally:
        consumer.close()


@pytest.fixture(scope="module")
def stack() -> Iterator[Stack]:
    require_engine()
    remove_stale_projects(PROJECT_PREFIX)
    s = Stack()
    t0 = time.monotonic()
    s.script("base")
    s.script("build")
    print(f"images built in {time.monotonic() - t0:.0f} s")
    try:
        yield s
    finally:
        s.dc("down", "-v", "--remove-orphans", "--timeout", "60", timeout=900)


def test_stack_scales_survives_kills_and_restarts_and_loses_nothing(stack: Stack) -> None:
    t0 = time.monotonic()
    # 1. Kafka and the topics first, then the counted workload's control records.
    stack.dc("up", "-d", "--no-build", "topics", timeout=600)
    stack.wait("the topics job", lambda: _exited_ok(stack, "topics"), 300)
    for slot in CURATE_FILTERS:
        stack.operator("control", "set", "-e", EXPERIMENT, "curate", slot, "none")

    # 2. The whole stack, one node.
    stack.dc("up", "-d", "--no-build", "--scale", "raas=1", timeout=600)
    stack.wait("3 versions published", lambda: _published(stack) >= 3, 900)
    stack.wait("the node applied a version", lambda: _applied_nodes(stack) >= 1, 300)
    print(f"stack up, 3 versions, node applied: {time.monotonic() - t0:.0f} s")

    # 3. Three nodes.
    stack.dc("up", "-d", "--no-build", "--no-recreate", "--scale", "raas=3", timeout=600)
    assert len(stack.containers("raas")) == 3
    stack.wait("3 nodes applied a version", lambda: _applied_nodes(stack) >= 3, 600)

    # 4. Faults: kill -9 of a node container's process (it comes back: restart policy), restart of
    #    a stream app, while tasks flow.
    victim = stack.containers("raas")[-1]
    pid = subprocess.run([_client(), "inspect", "--format", "{{.State.Pid}}", victim], check=True, capture_output=True,
                         text=True).stdout.strip()
    stack.crashed.add(subprocess.run([_client(), "inspect", "--format", "{{.Id}}", victim], check=True,
                                     capture_output=True, text=True).stdout.strip())
    os.kill(int(pid), signal.SIGKILL)  # the container's init (tini): the whole container dies
    stack.dc("restart", "curate", timeout=300)
    stack.wait("the killed node container back", lambda: _restarted(victim), 300)
    stack.crashed.clear()
    before = _published(stack)
    stack.wait("a version published after the faults", lambda: _published(stack) > before, 600)
    stack.wait("3 live nodes applied a version again", lambda: _applied_nodes(stack) >= 3, 600)

    # 5. Pause the curator, let everything issued drain, count.
    stack.operator("control", "set", "-e", EXPERIMENT, "curator", "pause", "on")
    time.sleep(5)  # the curator reads the control topic within a second; a task it was writing lands

    def drained():
        ledger = group_ledger(stack.kafka, EXPERIMENT, "policy")
        return ledger if not ledger.lost else None

    try:
        ledger = stack.wait("every issued group trained or dead-lettered", drained, 600, poll_s=10)
    except AssertionError:
        ledger = group_ledger(stack.kafka, EXPERIMENT, "policy")
        raise AssertionError(f"lost groups: {sorted(ledger.lost)[:20]} of {len(ledger.issued)} issued; "
                             f"dead-lettered: {ledger.dead_lettered}\n{stack.where_lost(ledger.lost)}"
                             f"\n{stack.logs()}") from None
    print(f"issued {len(ledger.issued)} groups, {len(ledger.trained)} reached the train topic, "
          f"{len(ledger.dead_lettered)} dead-lettered, samples twice on the train topic: {ledger.samples_twice}; "
          f"dead letters: {ledger.dead_lettered}")
    assert len(ledger.issued) >= 12 and not ledger.lost

    # 6. A metric of every role in Prometheus, scraped from the role itself (job = its service),
    #    and what only Kafka knows from the bridge.
    roles = ("curator", "reward", "curate", "archive", "trainer", "raas")
    up = {r["metric"]["job"] for r in stack.query(f'astraflow_role_up{{experiment="{EXPERIMENT}"}} == 1')
          if r["metric"].get("job") == r["metric"].get("component")}
    assert set(roles) <= up, up
    for role, metric in (("curator", "astraflow_tasks_issued_total"), ("reward", "astraflow_records_in_total"),
                         ("curate", "astraflow_records_out_total"), ("archive", "astraflow_records_out_total"),
                         ("trainer", "astraflow_trainer_loss"), ("raas", "astraflow_rollouts_total")):
        promql = f'{metric}{{job="{role}",component="{role}",experiment="{EXPERIMENT}"}}'
        try:  # a role restarted above reports its first metrics within one metrics interval (10 s)
            stack.wait(f"{role}'s {metric} in Prometheus", lambda q=promql: stack.query(q), 60, poll_s=5)
        except AssertionError:
            raise AssertionError(f"{role}: no {metric} in Prometheus; its endpoint serves:\n"
                                 f"{stack.endpoint(role)}\n{stack.logs(service=role, tail=80)}") from None
    assert stack.query('astraflow_consumer_lag{job="kafka",group=~".*archive.*"}'), "no lag series of the archive's group"
    assert stack.query('astraflow_topic_end_offset{job="kafka",stream="tasks"} > 0'), "no Kafka topic offsets"
    print(f"docker test body: {time.monotonic() - t0:.0f} s")


def test_down_leaves_nothing_behind(stack: Stack) -> None:
    stack.dc("down", "-v", "--remove-orphans", "--timeout", "60", timeout=900)
    project_is_gone(stack.project)


def _exited_ok(stack: Stack, service: str) -> bool:
    ids = stack.containers(service, all_=True)
    if not ids:
        return False
    state = subprocess.run([_client(), "inspect", "--format", "{{.State.Status}} {{.State.ExitCode}}", ids[0]],
                           capture_output=True, text=True).stdout.split()
    if state and state[0] == "exited" and state[1] != "0":
        raise AssertionError(f"{service} failed:\n{stack.logs()}")
    return state == ["exited", "0"]


def _max(result: list[dict]) -> float:
    return max((float(r["value"][1]) for r in result), default=0.0)


def _published(stack: Stack) -> float:
    return _max(stack.query(f'astraflow_published_version{{experiment="{EXPERIMENT}"}}'))


def _applied_nodes(stack: Stack) -> int:
    """Live nodes (their endpoint answered the last scrape) whose model is at version 1 or later."""
    return len(stack.query('astraflow_policy_version{job="raas"} >= 1 and on (instance) up{job="raas"} == 1'))


def _restarted(container: str) -> bool:
    """The container runs again after the restart policy brought it back."""
    out = subprocess.run([_client(), "inspect", "--format", "{{.State.Running}} {{.RestartCount}}", container],
                         capture_output=True, text=True).stdout.split()
    return out[:1] == ["true"] and len(out) == 2 and int(out[1]) >= 1
