"""A secure local Kafka (SASL/SCRAM + ACLs): every role may do what its table row allows, and
every other attempt is refused by the broker with its authorization error (never a missing topic).
The real trainer (`run_training`) and its weight publisher run under the trainer's principal.

The test starts its own secure broker (ports `ASTRAFLOW_TEST_PORT_BASE`+20/+21, default 29120).
"""

from __future__ import annotations

import os
import time
import uuid
from collections.abc import Iterator
from typing import Any

import pytest
import torch
from confluent_kafka import Consumer, KafkaError, KafkaException, Producer, TopicPartition
from confluent_kafka.admin import AdminClient, NewTopic

from astraflow.config import KafkaSettings, LocalKafkaSettings, TopicSettings
from astraflow.control import ControlReader
from astraflow.errors import KafkaLayerError
from astraflow.kafka.acl import principal_of, principals, role_grants
from astraflow.kafka.clients import RecordProducer, consumer_config, producer_config
from astraflow.kafka.local import LocalKafka
from astraflow.kafka.secure import CredentialStore, upsert_users
from astraflow.kafka.topics import TopicAdmin, Topics, topic_specs
from astraflow.models.tiny import init_tiny, load_tiny
from astraflow.ops.status import collect_status
from astraflow.records import DeadLetter
from astraflow.serde import AvroSerde
from astraflow.weights.publish import PublishSettings, WeightPublisher
from astraflow.weights.versions import last_published_version, latest_policy_version
from trainers.config import TrainRunConfig
from trainers.run import run_training
from trainers.synthetic import make_samples

torch.optim.Adam([torch.zeros(1, requires_grad=True)])  # settles TORCHINDUCTOR_CACHE_DIR before the leak guard

pytestmark = pytest.mark.slow

BASE = int(os.environ.get("ASTRAFLOW_TEST_PORT_BASE", "29100")) + 20
EXP, POLICIES = "sec", ["solver", "verifier"]


class Cluster:
    def __init__(self, local: LocalKafka) -> None:
        self.local, self.store = local, CredentialStore(local.root)
        self.grants = role_grants(EXP, POLICIES)
        self.topics = [s.name for s in topic_specs(EXP, POLICIES, TopicSettings(partitions=1))]

    def as_(self, user: str) -> KafkaSettings:
        return self.store.settings(self.local.bootstrap, user)

    def allowed(self, user: str, resource: str, op: str) -> set[str]:
        """Names (literal) and prefixes (ending in '*') the table allows `user` for `op`."""
        return {g.name + ("*" if g.pattern == "PREFIXED" else "") for g in self.grants
                if g.principal == user and g.resource == resource and op in g.operations}

    def may(self, user: str, resource: str, op: str, name: str) -> bool:
        return any(name == a or (a.endswith("*") and name.startswith(a[:-1])) for a in self.allowed(user, resource, op))


@pytest.fixture(scope="module")
def cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Cluster]:
    local = LocalKafka(LocalKafkaSettings(data_dir=tmp_path_factory.mktemp("ksec"), port=BASE, controller_port=BASE + 1,
                                          secure=True, heap_mb=384))
    local.up(echo=lambda *_: None)
    try:
        c = Cluster(local)
        admin = AdminClient(local.admin_settings().client_config())
        upsert_users(admin, {u: c.store.password(u) for u in principals(c.grants)})
        from astraflow.kafka.acl import apply_grants

        apply_grants(admin, c.grants)
        # The operator (not the admin) creates the experiment's topics: its CREATE grant works.
        created = TopicAdmin(c.as_(principal_of("operator", EXP))).create(topic_specs(EXP, POLICIES, TopicSettings(partitions=1)))
        assert set(created.values()) == {"created"}
        assert set(_produce(local.admin_settings(), c.topics).values()) == {None}  # something to read everywhere
        yield c
    finally:
        local.down(echo=lambda *_: None)


def _produce(kafka: KafkaSettings, topics: list[str], **conf: Any) -> dict[str, str | None]:
    """Produces one record to each topic; topic -> error name (None: acknowledged)."""
    out: dict[str, str | None] = {}
    p = Producer(producer_config(kafka, 1 << 20, **conf))

    def report(topic: str):
        def cb(err: KafkaError | None, _msg: Any) -> None:
            out[topic] = err.name() if err is not None else None
        return cb

    for t in topics:
        p.produce(t, b"probe", key=b"probe", on_delivery=report(t))
    try:
        assert p.flush(60) == 0
    except KafkaException as exc:  # fatal: the producer could not even get a producer id
        return dict.fromkeys(topics, exc.args[0].name())
    return out


def _subscribe_errors(
    kafka: KafkaSettings, group: str, topics: list[str], want: int, timeout_s: float = 30, assign: bool = False
) -> dict[str, str]:
    """Subscribes (or assigns partition 0 of each topic) and collects the errors reported per
    topic (or 'GROUP' for the group)."""
    c = Consumer(consumer_config(kafka, group, 1 << 20))
    if assign:
        c.assign([TopicPartition(t, 0, 0) for t in topics])
    else:
        c.subscribe(topics)
    errors: dict[str, str] = {}
    deadline = time.monotonic() + timeout_s
    try:
        while len(errors) < want and time.monotonic() < deadline:
            for m in c.consume(50, 0.5):
                err = m.error()
                if err is not None and err.code() != KafkaError._PARTITION_EOF:
                    # Metadata-level denials name the topic in the text; fetch-level ones (a topic
                    # the role may describe, e.g. one it writes) carry it on the message.
                    named = [m.topic()] if m.topic() in topics else [t for t in topics if t in err.str()]
                    for t in named or ["GROUP"]:
                        errors.setdefault(t, err.name())
    finally:
        c.close()
    return errors


def _client_errors(conf: dict[str, Any], timeout_s: float = 15.0) -> tuple[bool, list[KafkaError]]:
    """(got metadata?, errors librdkafka reported) for a client with `conf`."""
    seen: list[KafkaError] = []
    p = Producer({**conf, "error_cb": seen.append})
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        try:
            p.list_topics(timeout=1)
            return True, seen
        except KafkaException:
            p.poll(0.2)  # serves error_cb
            if seen:
                break
    return False, seen


def test_unauthenticated_and_wrong_password_clients_are_refused(cluster: Cluster) -> None:
    bad = {**cluster.as_(principal_of("raas", EXP)).client_config(), "sasl.password": "not-the-password"}
    ok, errors = _client_errors(bad)
    assert not ok and any(e.code() == KafkaError._AUTHENTICATION and "Authentication failed" in e.str() for e in errors), errors
    ok, errors = _client_errors({**cluster.as_(principal_of("raas", EXP)).client_config(), "sasl.username": "nobody"})
    assert not ok and any(e.code() == KafkaError._AUTHENTICATION for e in errors), errors
    # A client without SASL never gets past the handshake: no metadata, no topics.
    ok, errors = _client_errors({"bootstrap.servers": cluster.local.bootstrap})
    assert not ok and errors and all(e.code() in (KafkaError._TRANSPORT, KafkaError._ALL_BROKERS_DOWN) for e in errors), errors
    assert _client_errors(cluster.as_(principal_of("raas", EXP)).client_config())[0]  # the right password gets in


def test_every_write_the_table_allows_succeeds_and_every_other_is_refused(cluster: Cluster) -> None:
    for user in principals(cluster.grants):
        result = _produce(cluster.as_(user), cluster.topics)
        if not cluster.allowed(user, "TOPIC", "WRITE"):
            # Read-only roles may not write anywhere, so they do not even get an idempotent
            # producer id: Kafka refuses it at the cluster level (KIP-679).
            assert set(result.values()) == {"CLUSTER_AUTHORIZATION_FAILED"}, (user, result)
            continue
        for topic, err in result.items():
            if cluster.may(user, "TOPIC", "WRITE", topic):
                assert err is None, (user, topic, err)
            else:
                assert err == "TOPIC_AUTHORIZATION_FAILED", (user, topic, err)
    # The security properties, spelled out: only a trainer writes its own policy's weights.
    assert _produce(cluster.as_(principal_of("raas", EXP)), [f"af.{EXP}.solver.weights"])[f"af.{EXP}.solver.weights"] == "TOPIC_AUTHORIZATION_FAILED"
    other = _produce(cluster.as_(principal_of("trainer", EXP, "verifier")), [f"af.{EXP}.solver.weights"])
    assert other[f"af.{EXP}.solver.weights"] == "TOPIC_AUTHORIZATION_FAILED"
    own = _produce(cluster.as_(principal_of("trainer", EXP, "solver")), [f"af.{EXP}.solver.weights"])
    assert own[f"af.{EXP}.solver.weights"] is None


def test_every_read_the_table_allows_succeeds_and_every_other_is_refused(cluster: Cluster) -> None:
    for user in principals(cluster.grants):
        readable = [t for t in cluster.topics if cluster.may(user, "TOPIC", "READ", t)]
        denied = [t for t in cluster.topics if t not in readable]
        groups = sorted(g for g in cluster.allowed(user, "GROUP", "READ"))
        # Roles without a group of their own read assign-only, under a reader group prefix.
        group = groups[0].replace("*", "x") if groups else f"af-reader-{uuid.uuid4().hex[:8]}"
        if denied:
            # Group members are refused at subscription (or fetch); group-less roles read by
            # assignment, and are refused at fetch.
            errors = _subscribe_errors(cluster.as_(user), group, denied, want=len(denied), assign=not groups)
            assert errors == dict.fromkeys(denied, "TOPIC_AUTHORIZATION_FAILED"), user
        if readable:
            c = Consumer(consumer_config(cluster.as_(user), group, 1 << 20))
            c.assign([TopicPartition(t, 0, 0) for t in readable])
            got: set[str] = set()
            deadline = time.monotonic() + 30
            while got != set(readable) and time.monotonic() < deadline:
                got |= {m.topic() for m in c.consume(100, 0.5) if m.error() is None}
            if groups:  # a consumer group member commits what it read
                c.commit(offsets=[TopicPartition(t, 0, 1) for t in readable], asynchronous=False)
            c.close()
            assert got == set(readable), user


def test_groups_are_refused_to_roles_they_do_not_belong_to(cluster: Cluster) -> None:
    rollouts = f"af.{EXP}.rollouts"
    # reward may read rollouts, but not as a member of the RaaS nodes' group.
    errs = _subscribe_errors(cluster.as_(principal_of("reward", EXP)), f"af.{EXP}.raas", [rollouts], want=1)
    assert errs.get("GROUP") == "GROUP_AUTHORIZATION_FAILED", errs
    # The curator may look at the trainer's offsets (DESCRIBE) but never move them (READ).
    c = Consumer(consumer_config(cluster.as_(principal_of("curator", EXP)), f"af.{EXP}.solver.trainer", 1 << 20))
    assert c.committed([TopicPartition(f"af.{EXP}.solver.train", 0)], timeout=10)[0].error is None
    c.close()
    errs = _subscribe_errors(cluster.as_(principal_of("curator", EXP)), f"af.{EXP}.solver.trainer", [f"af.{EXP}.feedback"], want=1)
    assert errs.get("GROUP") == "GROUP_AUTHORIZATION_FAILED", errs
    # Assign-only readers start (control reader) but cannot join or commit with their throwaway group.
    ControlReader(cluster.as_(principal_of("raas", EXP)), EXP, "raas").start().close()
    # The real readers of each role run under its principal (they raise on an authorization error).
    assert latest_policy_version(cluster.as_(principal_of("raas", EXP)), Topics(EXP), "solver") is None  # only probes there
    last_published_version(cluster.as_(principal_of("trainer", EXP, "solver")), Topics(EXP), "solver")
    report = collect_status(cluster.as_(principal_of("monitor", EXP)), EXP)
    assert {t.stream for t in report.topics} >= {"tasks", "rollouts", "control"}
    errs = _subscribe_errors(cluster.as_(principal_of("raas", EXP)), "af-reader-join", [f"af.{EXP}.control"], want=1)
    assert errs.get("GROUP") == "GROUP_AUTHORIZATION_FAILED", errs


def test_transactions_and_changelog_topics_only_under_the_apps_own_prefix(cluster: Cluster) -> None:
    for app, out in (("curate", f"af.{EXP}.solver.train"), ("reward", f"af.{EXP}.scored"), ("curator", f"af.{EXP}.tasks")):
        kafka = cluster.as_(principal_of(app, EXP))
        p = Producer(producer_config(kafka, 1 << 20, **{"transactional.id": f"af.{EXP}.{app}-af.{EXP}.{app}-0"}))
        p.init_transactions(30)
        p.begin_transaction()
        p.produce(out, b"in a transaction", key=b"k")
        p.commit_transaction(30)
        # Faust creates its changelog topics itself.
        admin = AdminClient(kafka.client_config())  # kept referenced until the future resolves
        for f in admin.create_topics([NewTopic(f"af.{EXP}.{app}-counts-changelog", 1, 1)]).values():
            f.result(30)
    stolen = Producer(producer_config(cluster.as_(principal_of("reward", EXP)), 1 << 20, **{"transactional.id": f"af.{EXP}.curate-x-0"}))
    with pytest.raises(KafkaException) as exc:
        stolen.init_transactions(30)
    assert exc.value.args[0].code() == KafkaError.TRANSACTIONAL_ID_AUTHORIZATION_FAILED
    nodes = Producer(producer_config(cluster.as_(principal_of("raas", EXP)), 1 << 20, **{"transactional.id": "anything"}))
    with pytest.raises(KafkaException) as exc:
        nodes.init_transactions(30)
    assert exc.value.args[0].code() == KafkaError.TRANSACTIONAL_ID_AUTHORIZATION_FAILED
    admin = AdminClient(cluster.as_(principal_of("raas", EXP)).client_config())
    fut = admin.create_topics([NewTopic(f"af.{EXP}.raas-x", 1, 1)])
    with pytest.raises(KafkaException) as exc:
        next(iter(fut.values())).result(30)
    assert exc.value.args[0].code() == KafkaError.TOPIC_AUTHORIZATION_FAILED


def test_a_trainer_publishes_versions_in_transactions_and_no_other_principal_may_use_its_id(cluster: Cluster) -> None:
    """The trainer's real publisher (one transaction per version, transactional id
    `af.<exp>.<policy>.publisher`) works under its principal; the same id is refused to a RaaS
    node and to the other policy's trainer, which therefore cannot fence it."""
    topics, tid = Topics(EXP), Topics(EXP).publisher_id("solver")
    owner = WeightPublisher(cluster.as_(principal_of("trainer", EXP, "solver")), EXP, "solver",
                            PublishSettings(dtype="float32"), transactional_id=tid)
    first = owner.start()
    v = owner.publish({"w": torch.ones(4)}).version
    assert v == (0 if first is None else first + 1)
    for user in (principal_of("raas", EXP), principal_of("trainer", EXP, "verifier")):
        intruder = WeightPublisher(cluster.as_(user), EXP, "solver", transactional_id=tid)
        with pytest.raises(KafkaLayerError, match="denies the publisher") as exc:
            intruder.start()
        cause = exc.value.__cause__
        assert isinstance(cause, KafkaException), user
        assert cause.args[0].code() == KafkaError.TRANSACTIONAL_ID_AUTHORIZATION_FAILED, (user, cause)
    # Not fenced by the refused attempts: the owner publishes the next version, and readers see it.
    assert owner.publish({"w": torch.full((4,), 2.0)}).version == v + 1
    owner.close()
    latest = latest_policy_version(cluster.as_(principal_of("raas", EXP)), topics, "solver", strict=True)
    assert latest is not None and latest.version == v + 1


def test_the_real_trainer_trains_and_publishes_under_its_principal(
    cluster: Cluster, tmp_path_factory: pytest.TempPathFactory
) -> None:
    """`run_training` as `trainer-solver`: it checks its topics exist (creating none), dead-letters
    the probe record of its train topic, trains on curate's samples and publishes under ACLs."""
    tmp = tmp_path_factory.mktemp("sectrain")
    model_dir = init_tiny(tmp / "tiny", vocab_size=512, hidden=32, layers=1, heads=2, kv_heads=1, intermediate=64)
    initial, _ = load_tiny(model_dir)
    curate = RecordProducer(cluster.as_(principal_of("curate", EXP)))
    for sample in make_samples(initial, prompts=1, group_size=8, policy="solver"):
        curate.send(Topics(EXP).train("solver"), sample, key=sample.group_id)
    curate.flush()
    cfg = TrainRunConfig.model_validate({
        "experiment": EXP, "run_dir": str(tmp / "runs"), "kafka": cluster.as_(principal_of("trainer", EXP, "solver")),
        "trainer": {"policy": "solver", "model_dir": str(model_dir), "batch_size": 8, "max_wait_s": 0.3,
                    "max_steps": 1, "stop_when_idle_s": 120, "logger": "none", "progress_bar": False},
    })
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        summary = run_training(cfg)
    finally:
        torch.set_num_threads(before)
    assert summary.steps == 1 and summary.trained_samples == 8
    latest = latest_policy_version(cluster.as_(principal_of("raas", EXP)), Topics(EXP), "solver", strict=True)
    assert latest is not None and latest.version == summary.version and latest.trainer_step == 1
    reader = Consumer(consumer_config(cluster.as_(principal_of("monitor", EXP)), f"af-status-{uuid.uuid4().hex[:8]}", 1 << 20))
    reader.assign([TopicPartition(Topics(EXP).dlq, 0, 0)])
    letters = []
    for m in reader.consume(500, 10.0):
        if m.error() is None and m.value() != b"probe":
            letters.append(AvroSerde().loads(m.value(), DeadLetter))
    reader.close()
    assert any(d.component == "trainer" and d.topic == Topics(EXP).train("solver") for d in letters), letters
