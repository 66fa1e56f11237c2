"""Attacks across experiments and across roles, on the real secure cluster (SASL/SCRAM + ACLs).

Two experiments, `a` and `b`, share one secure broker started here (ports
`ASTRAFLOW_TEST_PORT_BASE`+24/+25, default 29124). Each is granted by the real command
(`astraflow kafka grant -e EXP -p solver`) and each process gets its credentials from `astraflow
kafka credentials ROLE -e EXP`, as an operator would. The attackers hold one principal of
experiment `a` and use it from plain confluent-kafka clients: every attempt on experiment `b`,
on `control`, or on a stream the role only reads must be refused by the broker with its
authorization error, and the honest work of both experiments (a task read, a trajectory written
and scored) must go on around it.
"""

from __future__ import annotations

import os
import shlex
import time
import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest
from confluent_kafka import Consumer, KafkaError, Producer, TopicPartition
from typer.testing import CliRunner

from astraflow.config import KafkaSettings, LocalKafkaSettings, TopicSettings
from astraflow.kafka.clients import consumer_config, producer_config
from astraflow.kafka.local import LocalKafka
from astraflow.kafka.topics import TopicAdmin, Topics, topic_specs
from astraflow_cli.main import app

pytestmark = [pytest.mark.security, pytest.mark.slow, pytest.mark.timeout(600)]

BASE = int(os.environ.get("ASTRAFLOW_TEST_PORT_BASE", "29100")) + 24
A, B, POLICY = "a", "b", "solver"
DENIED = {"TOPIC_AUTHORIZATION_FAILED", "GROUP_AUTHORIZATION_FAILED"}


class TwoExperiments:
    def __init__(self, local: LocalKafka, data_dir: Path) -> None:
        self.local, self.data_dir = local, data_dir
        self._creds: dict[tuple[str, str], KafkaSettings] = {}

    def cli(self, *args: str) -> str:
        res = CliRunner().invoke(app, [*args, "--data-dir", str(self.data_dir), "--port", str(BASE)])
        assert res.exit_code == 0, res.output
        return res.output

    def as_(self, role: str, experiment: str) -> KafkaSettings:
        """The credentials `astraflow kafka credentials` gives one role of one experiment."""
        if (role, experiment) not in self._creds:
            extra = ["-p", POLICY] if role == "trainer" else []
            env = {}
            for line in self.cli("kafka", "credentials", role, "-e", experiment, *extra).splitlines():
                k, _, v = line.removeprefix("export ").partition("=")
                env[k] = shlex.split(v)[0]
            self._creds[(role, experiment)] = KafkaSettings(
                bootstrap_servers=env["ASTRAFLOW__KAFKA__BOOTSTRAP_SERVERS"],
                security_protocol=env["ASTRAFLOW__KAFKA__SECURITY_PROTOCOL"],
                sasl_mechanism=env["ASTRAFLOW__KAFKA__SASL_MECHANISM"],
                sasl_username=env["ASTRAFLOW__KAFKA__SASL_USERNAME"],
                sasl_password=env["ASTRAFLOW__KAFKA__SASL_PASSWORD"],
            )
        return self._creds[(role, experiment)]


@pytest.fixture(scope="module")
def two(tmp_path_factory: pytest.TempPathFactory) -> Iterator[TwoExperiments]:
    data_dir = tmp_path_factory.mktemp("ksec2")
    local = LocalKafka(LocalKafkaSettings(data_dir=data_dir, port=BASE, controller_port=BASE + 1, secure=True, heap_mb=384))
    local.up(echo=lambda *_: None)
    try:
        c = TwoExperiments(local, data_dir)
        for exp in (A, B):
            out = c.cli("kafka", "grant", "-e", exp, "-p", POLICY)
            assert f"{exp}.raas" in out and f"{exp}.operator" in out, out
            # Each experiment's operator creates its topics; neither may create the other's.
            created = TopicAdmin(c.as_("operator", exp)).create(topic_specs(exp, [POLICY], TopicSettings(partitions=1)))
            assert set(created.values()) == {"created"}, created
        yield c
    finally:
        local.down(echo=lambda *_: None)


def _produce(kafka: KafkaSettings, records: list[tuple[str, bytes]]) -> list[str | None]:
    """Sends each (topic, value) with one producer; the error name of each (None: acknowledged)."""
    out: list[str | None] = [None] * len(records)
    p = Producer(producer_config(kafka, 1 << 20))

    def report(i: int):
        def cb(err: KafkaError | None, _msg: object) -> None:
            out[i] = err.name() if err is not None else None
        return cb

    for i, (topic, value) in enumerate(records):
        p.produce(topic, value, key=b"k", on_delivery=report(i))
    assert p.flush(60) == 0
    return out


def _read(kafka: KafkaSettings, topic: str, group: str, want: int, subscribe: bool = False,
          timeout_s: float = 30.0) -> tuple[list[bytes], set[str]]:
    """(values read, error names reported) for one reader of partition 0 of `topic`: in `group`
    (subscribed, committing) or assign-only."""
    c = Consumer(consumer_config(kafka, group, 1 << 20))
    if subscribe:
        c.subscribe([topic])
    else:
        c.assign([TopicPartition(topic, 0, 0)])
    values: list[bytes] = []
    errors: set[str] = set()
    # A topic the principal may not even describe is hidden from its metadata: the broker
    # answers TOPIC_AUTHORIZATION_FAILED there, and an assign-only reader then waits for nothing.
    err = c.list_topics(topic, timeout=10).topics[topic].error
    if err is not None:
        errors.add(err.name())
    deadline = time.monotonic() + timeout_s
    try:
        while len(values) < want and not errors and time.monotonic() < deadline:
            for m in c.consume(50, 0.5):
                if m.error() is None:
                    values.append(m.value())
                elif m.error().code() != KafkaError._PARTITION_EOF:
                    errors.add(m.error().name())
        if subscribe and values and not errors:
            c.commit(asynchronous=False)
    finally:
        c.close()
    return values, errors


def test_a_node_of_one_experiment_cannot_touch_another_and_honest_work_goes_on(two: TwoExperiments) -> None:
    ta, tb = Topics(A), Topics(B)
    task_a, task_b = f"task-a-{uuid.uuid4().hex[:6]}".encode(), f"task-b-{uuid.uuid4().hex[:6]}".encode()
    assert _produce(two.as_("curator", A), [(ta.tasks, task_a)]) == [None]
    assert _produce(two.as_("curator", B), [(tb.tasks, task_b)]) == [None]
    raas_a = two.as_("raas", A)

    # Reading b's tasks: assign-only, as a member of b's node group, and under a's own group.
    for group, subscribe in ((f"af-reader-{uuid.uuid4().hex[:6]}", False), (tb.raas_group, True), (ta.raas_group, True)):
        values, errors = _read(raas_a, tb.tasks, group, want=1, subscribe=subscribe, timeout_s=20)
        assert not values and errors and errors <= DENIED, (group, values, errors)
    # Writing b's rollouts, control, snapshot requests and weights, and a's own control: each
    # refused, in one batch with an honest trajectory of a's, which is acknowledged.
    attacks = [(tb.rollouts, b"forged trajectory"), (tb.control, b"forged command"), (ta.control, b"forged command"),
               (tb.snapshot_requests, b"forged request"), (tb.weights(POLICY), b"forged weights")]
    honest = (ta.rollouts, b"trajectory-a:" + task_a)
    result = _produce(raas_a, [*attacks, honest])
    assert result == ["TOPIC_AUTHORIZATION_FAILED"] * len(attacks) + [None], result
    # a's other principals are as shut out of b: its operator may not command b, its trainer
    # may not publish b's weights, its monitor may not read b's streams.
    assert _produce(two.as_("operator", A), [(tb.control, b"x"), (ta.control, b"a's own command")]) == [
        "TOPIC_AUTHORIZATION_FAILED", None]
    assert _produce(two.as_("trainer", A), [(tb.weights(POLICY), b"x")]) == ["TOPIC_AUTHORIZATION_FAILED"]
    values, errors = _read(two.as_("monitor", A), tb.tasks, f"af-status-{uuid.uuid4().hex[:6]}", want=1, timeout_s=20)
    assert not values and errors <= DENIED and errors, errors

    # Honest work of both experiments goes on: a's node reads a's task in a's group, its
    # trajectory reaches a's reward; b's node reads exactly b's task, b's reward sees nothing of a's.
    assert _read(raas_a, ta.tasks, ta.raas_group, want=1, subscribe=True) == ([task_a], set())
    assert _read(two.as_("reward", A), ta.rollouts, ta.group("reward"), want=1, subscribe=True) == ([honest[1]], set())
    assert _read(two.as_("raas", B), tb.tasks, tb.raas_group, want=1, subscribe=True) == ([task_b], set())
    assert _produce(two.as_("raas", B), [(tb.rollouts, b"trajectory-b:" + task_b)]) == [None]
    values, errors = _read(two.as_("reward", B), tb.rollouts, tb.group("reward"), want=2, subscribe=True, timeout_s=10)
    assert values == [b"trajectory-b:" + task_b] and not errors, (values, errors)


def test_a_processor_cannot_write_where_it_only_reads(two: TwoExperiments) -> None:
    """Reward reads rollouts and writes scored; curate reads scored and writes train: neither
    may write its source (a forged or duplicated input for itself or its siblings), and both
    still write their sinks."""
    t = Topics(A)
    reward, curate = two.as_("reward", A), two.as_("curate", A)
    assert _produce(reward, [(t.rollouts, b"self-fed trajectory"), (t.tasks, b"x"), (t.scored, b"scored")]) == [
        "TOPIC_AUTHORIZATION_FAILED", "TOPIC_AUTHORIZATION_FAILED", None]
    assert _produce(curate, [(t.scored, b"self-fed"), (t.rollouts, b"x"), (t.train(POLICY), b"sample")]) == [
        "TOPIC_AUTHORIZATION_FAILED", "TOPIC_AUTHORIZATION_FAILED", None]
    values, errors = _read(curate, t.scored, t.group("curate"), want=1, subscribe=True)
    assert values == [b"scored"] and not errors


def test_a_regions_tasks_are_its_experiments_alone(two: TwoExperiments) -> None:
    """Region tasks topics (`af.<exp>.tasks.<region>`, `--region-share`) are granted by prefix:
    a's curator writes a's and not b's, a's node reads a's and not b's."""
    from astraflow.kafka.topics import TopicSpec

    ta, tb = Topics(A), Topics(B)
    for exp, t in ((A, ta), (B, tb)):
        TopicAdmin(two.as_("operator", exp)).create([TopicSpec(t.tasks_of("east"), 1)])
    task = f"east-{uuid.uuid4().hex[:6]}".encode()
    assert _produce(two.as_("curator", A), [(tb.tasks_of("east"), b"x"), (ta.tasks_of("east"), task)]) == [
        "TOPIC_AUTHORIZATION_FAILED", None]
    values, errors = _read(two.as_("raas", A), tb.tasks_of("east"), ta.raas_group, want=1, subscribe=True, timeout_s=20)
    assert not values and errors and errors <= DENIED, (values, errors)
    assert _read(two.as_("raas", A), ta.tasks_of("east"), ta.raas_group, want=1, subscribe=True) == ([task], set())
    values, errors = _read(two.as_("curate", A), ta.tasks_of("east"), f"af-reader-{uuid.uuid4().hex[:6]}", want=1)
    assert values == [task] and not errors
