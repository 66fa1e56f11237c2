"""A writer that claims another's identity in `metrics`, or publishes a policy version it does
not own, on the default local cluster: `astraflow status` (and the dashboard, which reads the
same report) must not believe it.

The honest node and trainer write through AstraFlow's own producer, which signs each metric with
its role's key; the attacker is an outside client (`outsider.py`). Each forged record must be
left out of every figure (nodes, trainers, policy versions) and listed apart as unverified, and
the honest node's figures must be what it reported.
"""

from __future__ import annotations

import time

import pytest
import torch
from outsider import Outsider, defaults, encode, forged_signature

from astraflow.config import KafkaSettings
from astraflow.kafka.clients import RecordProducer
from astraflow.kafka.signing import METRICS, Signer
from astraflow.kafka.topics import Topics
from astraflow.ops.status import collect_status
from astraflow.records import Metric
from astraflow.weights.publish import WeightPublisher

pytestmark = [pytest.mark.security, pytest.mark.timeout(300)]


def _metric(name: str, value: float, component: str, instance: str, ts: int, **labels: str) -> bytes:
    return encode("metric", {"name": name, "value": value, "component": component, "instance": instance,
                             "labels": labels, "ts": ts})


def test_a_writer_claiming_another_nodes_identity_is_shown_unverified_and_counts_nowhere(
        kafka: KafkaSettings, experiment: str) -> None:
    t, out = Topics(experiment), Outsider(kafka.bootstrap_servers)
    honest = RecordProducer(kafka)
    publisher = WeightPublisher(kafka, experiment, "policy")
    publisher.start()
    version = publisher.publish({"w": torch.ones(4)}).version

    def node_metrics(rate: float) -> None:
        labels = {"hardware": "cpu", "region": "local", "backend": "torch"}
        honest.send(t.metrics, Metric("rollouts_per_s", rate, "raas", "node-1", labels), key="node-1")
        honest.send(t.metrics, Metric("trainer.loss", 0.5, "trainer", "trainer-1", {"policy": "policy"}), key="trainer-1")
        honest.flush(30)

    node_metrics(2.0)
    old = out.capture(t.metrics)  # the node's own signed records, to replay later
    later = int(time.time() * 1000) + 60_000  # newer than anything honest: believed, it would win
    forged = _metric("rollouts_per_s", 1e6, "raas", "node-1", later, hardware="h200", region="local", backend="vllm")
    out.send(t.metrics, forged, b"node-1")  # unsigned
    out.send(t.metrics, forged, b"node-1", forged_signature())  # a made-up signature
    trainer_key = Signer(experiment, "trainer")  # a trainer's host speaking for a node
    out.send(t.metrics, forged, b"node-1", list(trainer_key.headers(METRICS, b"node-1", forged).items()))
    out.send(t.metrics, _metric("rollouts_per_s", 5.0, "raas", "node-ghost", later), b"node-ghost")  # a node that is not
    out.send(t.metrics, _metric("trainer.loss", 99.0, "trainer", "trainer-1", later, policy="policy"), b"trainer-1")
    pv = defaults("policy_version", policy="policy", version=10**9, kind="SNAPSHOT", dtype="float32", num_chunks=1,
                  payload_bytes=1, sha256="0" * 64, state_checksum="0" * 64, trainer_step=0, trained_samples=0,
                  created_at=later)
    out.send(t.policies, encode("policy_version", pv), b"policy")
    for key, value, headers in old:  # the honest node's own signed metrics, replayed
        out.send(t.metrics, value, key, headers)
    node_metrics(3.0)  # honest work goes on after the attacks
    publisher.close()

    r = collect_status(kafka, experiment)
    assert [(n.node_id, n.rollouts_per_s, n.hardware) for n in r.nodes] == [("node-1", 3.0, "cpu")]
    claims = {(m.component, m.instance, m.value) for m in r.unverified}
    assert ("raas", "node-1", 1e6) in claims and ("raas", "node-ghost", 5.0) in claims
    assert ("trainer", "trainer-1", 99.0) in claims
    assert [(p.policy, p.version, p.trainer.get("loss")) for p in r.policies] == [("policy", version, 0.5)]
    assert r.refused_versions == 1
    assert all(m.component != "raas" or m.value != 1e6 for m in r.metrics)
    # The dashboard's page reads the same report: the claims are in its own table, not in nodes.
    from astraflow.ops.dashboard import DashboardState

    snap = DashboardState(kafka, experiment).refresh()
    assert [(n["node_id"], n["rollouts_per_s"]) for n in snap["nodes"]] == [("node-1", 3.0)]
    assert ("raas", "node-1", 1e6) in {(m["component"], m["instance"], m["value"]) for m in snap["unverified"]}


def test_a_forged_node_cannot_keep_a_dark_region_alive_for_the_curator(kafka: KafkaSettings, experiment: str) -> None:
    """The curator's region shares (`--region-share`) follow the nodes' metrics: a forged node
    "reading" region B's tasks would keep B live, and B's outstanding tasks would never be given
    back. The curator's reader believes only metrics the `raas` key signed."""
    from astraflow.ops.provenance import Provenance
    from astraflow.serde import AvroSerde
    from stream_apps.region_fleet import RegionFleet, feed_fleet, fleet_reader

    t, out = Topics(experiment), Outsider(kafka.bootstrap_servers)
    a, b = t.tasks, t.tasks_of("b")
    now = time.monotonic()
    fleet = RegionFleet({"": a, "b": b}, {a: 0.5, b: 0.5}, n_samples=1, dead_after_s=5.0, now=now - 60, window=8)
    fleet.refresh(now - 60)  # the curator has been reading for a minute: no node of region B in that time
    reader, _ = fleet_reader(kafka, f"af-curator-{experiment}", t.metrics, t.rollouts, since_s=60)
    honest = RecordProducer(kafka)
    ts = int(time.time() * 1000)
    honest.send(t.metrics, Metric("rollouts_per_s", 2.0, "raas", "node-a", {"region": "local"}), key="node-a")
    honest.flush(30)
    forged = _metric("rollouts_per_s", 9.0, "raas", "node-b", ts, tasks_region="b")
    out.send(t.metrics, forged, b"node-b")  # unsigned
    out.send(t.metrics, forged, b"node-b", list(Signer(experiment, "trainer").headers(METRICS, b"node-b", forged).items()))
    out.send(t.metrics, forged, b"node-b", forged_signature())
    msgs: list = []
    deadline = time.monotonic() + 30
    try:
        while len(msgs) < 4 and time.monotonic() < deadline:
            msgs += [m for m in reader.consume(50, 0.5) if m.error() is None]
    finally:
        reader.close()
    assert len(msgs) == 4
    feed_fleet(fleet, msgs, AvroSerde(), t.metrics, time.monotonic(), time.time(), Provenance(experiment))
    assert set(fleet.nodes) == {"node-a"} and fleet.bad_metrics == 3
    assert fleet.dead == {b} and fleet.next_topic() == a  # B is dark: it gets nothing, its tasks go back
