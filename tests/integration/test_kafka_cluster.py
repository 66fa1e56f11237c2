"""A local three-node KRaft cluster: replication factor 3, min.insync.replicas 2, and a kill -9.

The test starts its own cluster (ports from `ASTRAFLOW_TEST_PORT_BASE`, default 29100..29105)
because it kills a broker; the session's shared broker is never touched.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
from confluent_kafka import Consumer, KafkaError, Producer, TopicPartition

from astraflow.config import LocalKafkaSettings, TopicSettings
from astraflow.kafka.clients import commit_offsets, consumer_config, producer_config
from astraflow.kafka.local import LocalKafka
from astraflow.kafka.topics import TopicAdmin, TopicSpec, topic_specs

pytestmark = pytest.mark.slow

BASE = int(os.environ.get("ASTRAFLOW_TEST_PORT_BASE", "29100"))


@pytest.fixture(scope="module")
def cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[LocalKafka]:
    local = LocalKafka(
        LocalKafkaSettings(
            data_dir=tmp_path_factory.mktemp("kafka3"), port=BASE, controller_port=BASE + 1, brokers=3, heap_mb=384
        )
    )
    local.up(echo=lambda *_: None)
    try:
        yield local
    finally:
        local.down(echo=lambda *_: None)


def test_three_nodes_report_and_experiment_topics_get_rf3_isr2(cluster: LocalKafka, unique) -> None:
    st = cluster.status()
    assert st.answering and [n.node_id for n in st.nodes if n.answering] == [1, 2, 3]
    assert len({n.pid for n in st.nodes}) == 3
    # The CLI finds the cluster from its data directory alone (layout.json: nodes and ports).
    res = subprocess.run([sys.executable, "-m", "astraflow_cli.main", "kafka", "status", "--data-dir", str(cluster.root),
                          "--json"], capture_output=True, text=True, timeout=120)
    assert res.returncode == 0, res.stderr
    shown = json.loads(res.stdout)
    assert [(n["node_id"], n["answering"]) for n in shown["nodes"]] == [(1, True), (2, True), (3, True)]
    assert shown["bootstrap"] == cluster.bootstrap
    kafka = cluster.admin_settings()
    admin = TopicAdmin(kafka)
    settings = TopicSettings(partitions=2, replication_factor=3, min_insync_replicas=2)
    specs = topic_specs(unique("exp"), ["solver"], settings)
    admin.create(specs, settings.replication_factor)
    md = metadata_with(admin, [s.name for s in specs])
    for spec in specs:
        assert all(len(p.replicas) == 3 for p in md.topics[spec.name].partitions.values()), spec.name
    described = admin.describe([s.name for s in specs])
    assert {conf["min.insync.replicas"] for conf in described.values()} == {"2"}
    # Unset, the replication factor is the cluster's default: 3 on this cluster, and so is min ISR.
    defaults = topic_specs(unique("exp"), [], TopicSettings(partitions=1))
    admin.create(defaults, TopicSettings().replication_factor)
    md = metadata_with(admin, [s.name for s in defaults])
    assert {len(md.topics[s.name].partitions[0].replicas) for s in defaults} == {3}
    # Kafka's own state is as durable as the data: group offsets and transaction state.
    commit_group(kafka, specs[0].name)
    md = admin.admin.list_topics(timeout=10)
    assert all(len(p.replicas) == 3 for p in md.topics["__consumer_offsets"].partitions.values())


def test_stream_app_changelogs_are_as_durable_as_the_experiments_topics(cluster: LocalKafka, unique) -> None:
    """Curate's changelog topics follow `topics.*` like the experiment's own: unset replication
    factor = the cluster's default (3 here, where Faust alone would create them with 1)."""
    import asyncio

    from stream_apps.engine import EngineSettings
    from stream_apps.faust_app import build_app
    from stream_apps.launch import AppOptions, build_worker

    kafka = cluster.admin_settings()
    admin = TopicAdmin(kafka)
    exp, settings = unique("exp"), TopicSettings(partitions=2, min_insync_replicas=2)
    admin.create(topic_specs(exp, ["solver"], settings), settings.replication_factor)
    metadata_with(admin, [f"af.{exp}.scored"])
    engine = build_worker("curate", EngineSettings(exp, kafka, topics=settings), AppOptions(policies=["solver"]))

    async def build() -> None:
        build_app(engine)  # declares the changelogs, as a starting worker does

    asyncio.run(build())
    names = [f"af.{exp}.curate-{table}-changelog" for table in ("groups", "emitted")]
    md = metadata_with(admin, names)
    for name in names:
        assert len(md.topics[name].partitions) == 2, name
        assert all(len(p.replicas) == 3 for p in md.topics[name].partitions.values()), name
    described = admin.describe(names)
    assert {(c["min.insync.replicas"], c["cleanup.policy"]) for c in described.values()} == {("2", "compact")}


def metadata_with(admin: TopicAdmin, names: list[str]):
    """Cluster metadata once every broker we ask knows the new topics (creation propagates)."""
    deadline = time.monotonic() + 30
    while True:
        md = admin.admin.list_topics(timeout=10)
        if all(n in md.topics and md.topics[n].partitions for n in names) or time.monotonic() > deadline:
            return md
        time.sleep(0.2)


def commit_group(kafka, topic: str) -> None:
    c = Consumer(consumer_config(kafka, f"g-{topic}", 1 << 20))
    try:
        commit_offsets(c, [TopicPartition(topic, 0, 0)])
    finally:
        c.close()


def test_kill_9_of_a_broker_mid_run_loses_nothing_and_duplicates_nothing(
    cluster: LocalKafka, tmp_path: Path, unique
) -> None:
    kafka = cluster.admin_settings()
    topic = unique("counted")
    TopicAdmin(kafka).create([TopicSpec(topic, 3, {"min.insync.replicas": "2"})], replication_factor=3)
    n = 6000
    failures: list[str] = []
    acked = 0

    def on_delivery(err: KafkaError | None, _msg) -> None:
        nonlocal acked
        if err is not None:
            failures.append(err.str())
        else:
            acked += 1

    producer = Producer(producer_config(kafka, 1 << 20, **{"linger.ms": 20}))
    md = metadata_with(TopicAdmin(kafka), [topic])
    victim = md.topics[topic].partitions[0].leader  # the leader of a partition we are writing to
    killed_at = None
    for i in range(n):
        while True:
            try:
                producer.produce(topic, value=str(i).encode(), key=str(i % 97).encode(), on_delivery=on_delivery)
                break
            except BufferError:
                producer.poll(0.1)
        producer.poll(0)
        if i == n // 3:
            producer.flush(60)  # some records are in before the kill, more are in flight after it
        if i == n // 3 + 200:
            killed_at = cluster.kill(victim)  # kill -9, mid-run
            time.sleep(0.5)
    assert killed_at is not None
    assert producer.flush(120) == 0
    assert failures == [] and acked == n
    assert not cluster.status().nodes[victim - 1].running

    # Read everything back with the two surviving brokers: every number exactly once.
    seen: dict[int, int] = {}
    c = Consumer(consumer_config(kafka, unique("reader"), 1 << 20))
    c.subscribe([topic])
    deadline = time.monotonic() + 120
    try:
        while len(seen) < n and time.monotonic() < deadline:
            for msg in c.consume(500, 1.0):
                if msg.error() is None:
                    k = int(msg.value())
                    seen[k] = seen.get(k, 0) + 1
    finally:
        c.close()
    assert sorted(seen) == list(range(n)), f"lost {n - len(seen)} records"
    assert [k for k, v in seen.items() if v > 1] == []

    # The killed node rejoins and catches up.
    assert cluster.start(victim, echo=lambda *_: None).answering
