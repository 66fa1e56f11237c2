"""`astraflow status` and the Prometheus bridge against a running experiment on a real Kafka.

The experiment is built the way its components would leave it: tasks, rollouts and scored
trajectories on their topics, Metric records from two RaaS nodes (one CPU, one GPU in another
region) and a trainer, a PolicyVersion on `policies`, dead letters, a RaaS group that committed
part of `tasks` and a reward group that committed all of `rollouts`. Status must report exactly
those nodes, lags and versions.
"""

from __future__ import annotations

import json
import subprocess
import sys
import urllib.request
import uuid
from collections.abc import Iterator
from dataclasses import dataclass

import pytest
from prometheus_client import CollectorRegistry
from typer.testing import CliRunner

from astraflow.config import KafkaSettings, TopicSettings
from astraflow.kafka.clients import RecordConsumer, RecordProducer
from astraflow.kafka.signing import Signer
from astraflow.kafka.topics import TopicAdmin, Topics, topic_specs
from astraflow.records import DeadLetter, Metric, PolicyVersion, WeightKind
from astraflow.testing import make_task, make_trajectory

TASKS, TASKS_CONSUMED, ROLLOUTS = 10, 4, 6
SCORED_VERSIONS = [4, 4, 4, 3, 3, 2, 1, 4]  # latest published is 4: behind 0,0,0,1,1,2,3,0
SCORED_REWARDS = [1.0, 0.0, 1.0, 1.0, 0.0, 0.0, 1.0, 1.0]
NODES = {
    "node-cpu": {"hardware": "cpu:2", "region": "us-east", "backend": "torch", "version": 4, "tokens_per_s": 120.0},
    "node-gpu": {"hardware": "gpu:H200", "region": "eu-west", "backend": "vllm", "version": 3, "tokens_per_s": 9000.0},
}


@dataclass
class Running:
    kafka: KafkaSettings
    experiment: str

    @property
    def topics(self) -> Topics:
        return Topics(self.experiment)


def _populate(kafka: KafkaSettings, exp: str) -> None:
    t = Topics(exp)
    producer = RecordProducer(kafka)
    for i in range(TASKS):
        task = make_task(i)
        producer.send(t.tasks, task, key=task.group_id)
    for i in range(ROLLOUTS):
        producer.send(t.rollouts, make_trajectory(96, task_id=f"task-{i}", seed=i), key=f"g-{i}")
    for i, (v, r) in enumerate(zip(SCORED_VERSIONS, SCORED_REWARDS, strict=True)):
        producer.send(t.scored, make_trajectory(96, task_id=f"task-{i}", seed=i, version=v, reward=r), key=f"g-{i}")
    for node_id, n in NODES.items():  # what RaasNode._publish_metrics writes
        labels = {"node_id": node_id, "hardware": n["hardware"], "region": n["region"], "backend": n["backend"]}
        for name, value in (("rollouts_per_s", 1.5), ("tokens_per_s", n["tokens_per_s"]), ("inflight", 3.0),
                            ("rollouts_total", 42.0)):
            producer.send(t.metrics, Metric(name, value, "raas", node_id, labels), key=node_id)
        producer.send(t.metrics, Metric("policy_version", float(n["version"]), "raas", node_id, {**labels, "policy": "policy"}),
                      key=node_id)
    for step, loss in ((41, 0.9), (42, 0.5)):  # what the trainer's KafkaMetrics callback writes
        labels = {"policy": "policy", "step": str(step)}
        producer.send(t.metrics, Metric("trainer.loss", loss, "trainer", "trainer-host-1", labels), key="policy")
        producer.send(t.metrics, Metric("trainer.staleness", 2.0, "trainer", "trainer-host-1", {**labels, "bucket": "0"}),
                      key="policy")
    pv = producer.serde.dumps(PolicyVersion(policy="policy", version=4, kind=WeightKind.DELTA, dtype="bfloat16", num_chunks=1,
                                            payload_bytes=10, sha256="0" * 64, state_checksum="c", trainer_step=40,
                                            trained_samples=1280, base_version=3))
    # Signed by the trainer's key, as its publisher does: status believes only those.
    producer.send_raw(t.policies, pv, "policy", Signer(exp, "trainer").headers("policies", "policy", pv))
    for i in range(2):
        producer.send(t.dlq, DeadLetter(original=b"\x00garbage", topic=t.rollouts, partition=0, offset=i,
                                        error_class="CorruptRecordError", error="bad magic", component="reward"))
    producer.flush()

    # The RaaS group has committed the first TASKS_CONSUMED tasks it received; reward has committed every rollout.
    raas = RecordConsumer(kafka, f"af.{exp}.raas", [t.tasks], component="raas", dlq=None)
    got = []
    while len(got) < TASKS_CONSUMED:
        got += raas.poll_batch(TASKS_CONSUMED - len(got), 1.0)
    raas.commit(got)
    raas.close()
    reward = RecordConsumer(kafka, f"af.{exp}.reward", [t.rollouts], component="reward", dlq=None)
    seen = 0
    while seen < ROLLOUTS:
        seen += len(reward.poll_batch(100, 1.0))
    reward.commit()
    reward.close()


@pytest.fixture(scope="module")
def running(kafka: KafkaSettings) -> Iterator[Running]:
    exp = f"status-{uuid.uuid4().hex[:10]}"
    admin = TopicAdmin(kafka)
    specs = topic_specs(exp, ["policy"], TopicSettings(partitions=2))
    admin.create(specs)
    try:
        _populate(kafka, exp)
        yield Running(kafka, exp)
    finally:
        admin.delete([s.name for s in specs])
        groups = [f"af.{exp}.raas", f"af.{exp}.reward"]
        for fut in admin.admin.delete_consumer_groups(groups).values():
            fut.exception(timeout=10)  # best effort: an already-gone group is fine


def test_status_reports_the_nodes_lags_and_versions_the_experiment_has(running: Running) -> None:
    from astraflow.ops.status import collect_status

    r = collect_status(running.kafka, running.experiment)
    t = running.topics

    topics = {x.stream: x for x in r.topics}
    assert topics["tasks"].records == TASKS and topics["tasks"].partitions == 2
    assert topics["scored"].records == len(SCORED_VERSIONS)
    assert topics["tasks"].rate_per_s == pytest.approx(TASKS / 60.0)  # all written within the 60 s window

    lags = {(g.group, g.topic): g for g in r.lags}
    raas = lags[(f"af.{running.experiment}.raas", t.tasks)]
    assert raas.lag == TASKS - TASKS_CONSUMED and raas.members == 0
    assert lags[(f"af.{running.experiment}.reward", t.rollouts)].lag == 0

    nodes = {n.node_id: n for n in r.nodes}
    assert set(nodes) == set(NODES)
    for node_id, want in NODES.items():
        n = nodes[node_id]
        assert (n.hardware, n.region, n.backend) == (want["hardware"], want["region"], want["backend"])
        assert n.versions == {"policy": want["version"]}
        assert n.tokens_per_s == want["tokens_per_s"] and n.rollouts_per_s == 1.5 and n.rollouts_total == 42.0
        assert n.last_seen_s < 60

    regions = {g.region: g for g in r.regions}  # per region: throughput, and versions behind the published v4
    assert (regions["us-east"].nodes, regions["us-east"].rollouts_per_s, regions["us-east"].version_lag) == (1, 1.5, 0)
    assert (regions["eu-west"].nodes, regions["eu-west"].rollouts_per_s, regions["eu-west"].version_lag) == (1, 1.5, 1)
    assert r.autoscale is not None and r.autoscale.task_lag == TASKS - TASKS_CONSUMED and r.autoscale.nodes == 2

    (policy,) = r.policies
    assert policy.policy == "policy" and policy.version == 4 and policy.kind == "DELTA"
    assert policy.trainer_step == 42 and policy.trainer == {"loss": 0.5}  # the newest step; the bucket series apart
    assert policy.trained_samples == 1280 and policy.trainer_instance == "trainer-host-1"

    assert r.staleness.samples == len(SCORED_VERSIONS)
    assert r.staleness.histogram == {0: 4, 1: 2, 2: 1, 3: 1}
    assert r.staleness.mean == pytest.approx(7 / 8) and r.staleness.max == 3
    assert r.reward.samples == len(SCORED_REWARDS) and r.reward.mean == pytest.approx(5 / 8)

    assert r.dlq.records == 2
    assert r.dlq.recent[0]["component"] == "reward" and r.dlq.recent[0]["error_class"] == "CorruptRecordError"
    assert r.undecodable == 0


def test_status_command_prints_json_and_tables(running: Running) -> None:
    from astraflow_cli.main import app

    base = ["--set", f"kafka.bootstrap_servers={running.kafka.bootstrap_servers}", "status", "-e", running.experiment]
    res = CliRunner().invoke(app, [*base, "--json"])
    assert res.exit_code == 0, res.output
    data = json.loads(res.output)
    assert {n["node_id"]: n["region"] for n in data["nodes"]} == {"node-cpu": "us-east", "node-gpu": "eu-west"}
    assert data["policies"][0]["version"] == 4
    assert {(g["group"], g["lag"]) for g in data["lags"]} >= {(f"af.{running.experiment}.raas", TASKS - TASKS_CONSUMED)}

    res = CliRunner().invoke(app, base, env={"COLUMNS": "200"})
    assert res.exit_code == 0, res.output
    for text in ("node-cpu", "node-gpu", "gpu:H200", "eu-west", "policy@v3", "raas", "dlq 2 records"):
        assert text in res.output, text

    res = CliRunner().invoke(app, base, env={"COLUMNS": "80"})  # a default terminal: nothing cut to 'raas…'
    assert res.exit_code == 0 and "…" not in res.output, res.output
    assert max(len(line) for line in res.output.splitlines()) <= 80
    assert "add 1" in res.output  # a running experiment gets the autoscale rule's advice

    # --watch in a pipe: one full report per refresh (not a live display that prints nothing)
    cmd = [sys.executable, "-m", "astraflow_cli.main", *base, "--watch", "--interval", "1"]
    try:
        out = subprocess.run(cmd, capture_output=True, text=True, timeout=25).stdout
    except subprocess.TimeoutExpired as exc:
        out = exc.stdout.decode() if isinstance(exc.stdout, bytes) else exc.stdout or ""
    assert out.count(f"experiment {running.experiment}") >= 2, out[-2000:]


def test_status_of_a_missing_experiment_says_how_to_create_it(kafka: KafkaSettings) -> None:
    from astraflow_cli.main import app

    res = CliRunner().invoke(app, ["--set", f"kafka.bootstrap_servers={kafka.bootstrap_servers}", "status", "-e",
                                   f"missing-{uuid.uuid4().hex[:8]}"])
    assert res.exit_code == 1
    assert "astraflow topics create" in res.output and "astraflow experiments list" in res.output
    assert "Error" not in res.output and len(res.output.strip().splitlines()) == 1


def _scrape(port: int) -> str:
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10) as resp:
        return resp.read().decode()


def test_prometheus_bridge_serves_the_experiment(running: Running) -> None:
    from astraflow.metrics_export import MetricsBridge, start_metrics_server

    exp = running.experiment
    bridge = MetricsBridge(running.kafka, exp, interval_s=60.0)
    registry = CollectorRegistry()
    registry.register(bridge)
    bridge.start()
    server = start_metrics_server(0, "127.0.0.1", registry)  # port 0: the OS picks a free one
    try:
        text = _scrape(server.port)
    finally:
        server.close()
        bridge.stop()
    assert f'astraflow_status_up{{experiment="{exp}"}} 1.0' in text
    assert f'astraflow_consumer_lag{{experiment="{exp}",group="af.{exp}.raas",topic="af.{exp}.tasks"}} 6.0' in text
    assert f'astraflow_published_version{{experiment="{exp}",policy="policy"}} 4.0' in text
    assert f'astraflow_dlq_records{{experiment="{exp}"}} 2.0' in text
    assert f'astraflow_raas_nodes{{experiment="{exp}"}} 2.0' in text
    assert f'astraflow_region_version_lag{{experiment="{exp}",region="eu-west"}} 1.0' in text
    assert f'astraflow_autoscale_task_lag{{experiment="{exp}"}} 6.0' in text
    # The roles' own series come from their own endpoints (serve_role), not through the bridge.
    assert "astraflow_tokens_per_s" not in text and "astraflow_trainer_loss" not in text


def test_every_role_serves_its_own_metrics_under_one_naming_rule() -> None:
    from astraflow.errors import ConfigError
    from astraflow.metrics_export import serve_role

    assert serve_role("e1", "curate", "c1", env={}) is None  # nothing listens unless asked
    with pytest.raises(ConfigError, match="port number"):
        serve_role("e1", "curate", "c1", env={"ASTRAFLOW_METRICS_PORT": "nine"})
    env = {"ASTRAFLOW_METRICS_PORT": "0"}  # port 0: the OS picks a free one
    node, curate, reward = (serve_role("e1", c, p, env=env) for c, p in (("raas", "n1"), ("curate", "c1"), ("reward", "r1")))
    assert node and curate and reward
    try:
        assert {e.server.addr for e in (node, curate, reward)} == {"127.0.0.1"}  # loopback unless configured
        node.observe(Metric("rollouts_per_s", 2.0, "raas", "n1", {"node_id": "n1", "step": "1"}, ts=1))
        node.observe(Metric("rollouts_per_s", 3.0, "raas", "n1", {"node_id": "n1", "step": "2"}, ts=2))
        curate.observe(Metric("records_in_total", 7.0, "curate", "c1", {"experiment": "e1"}))
        reward.observe(Metric("records_in_total", 5.0, "reward", "r1", {"experiment": "e1"}))
        texts = {e: _scrape(e.port) for e in (node, curate, reward)}
    finally:
        for e in (node, curate, reward):
            e.close()
    assert 'astraflow_rollouts_per_s{component="raas",experiment="e1",node_id="n1",process="n1"} 3.0' in texts[node]
    # The same counter has one name in every role; the role is a label.
    assert 'astraflow_records_in_total{component="curate",experiment="e1",process="c1"} 7.0' in texts[curate]
    assert 'astraflow_records_in_total{component="reward",experiment="e1",process="r1"} 5.0' in texts[reward]
    for e, (c, p) in ((node, ("raas", "n1")), (curate, ("curate", "c1")), (reward, ("reward", "r1"))):
        assert f'astraflow_role_up{{component="{c}",experiment="e1",process="{p}"}} 1.0' in texts[e]
        assert "process_resident_memory_bytes" in texts[e]  # the process' own CPU and memory
    assert "records_in_total" not in texts[node]  # each endpoint serves its own process only
