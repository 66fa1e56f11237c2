"""Attacks on authority records (weights, `policies`, `control`), on the default local cluster.

Each attack is sent by an outside client (`outsider.py`: plain fastavro and confluent-kafka) that
reaches the broker, as anyone does on a cluster without ACLs. Each must be refused with a dead
letter that names the rule broken, and the honest records around it must be handled as if it
were not there. `ATTACKS` counts what is tried here; every test asserts its attacks refused and
no honest record lost.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable

import pytest
import torch
from helpers import collect
from outsider import Outsider, defaults, encode, forged_signature

from astraflow.config import KafkaSettings
from astraflow.control import CompactedReader, ControlReader, ControlWriter
from astraflow.kafka.signing import Signer
from astraflow.kafka.topics import Topics
from astraflow.records import DeadLetter, PolicyVersion
from astraflow.weights.chain import ApplyStatus
from astraflow.weights.follow import KafkaWeightFollower
from astraflow.weights.publish import PublishSettings, WeightPublisher, split_chunks
from astraflow.weights.snapshot import snapshot
from astraflow.weights.store import sha256_hex
from astraflow.weights.versions import latest_policy_version

pytestmark = [pytest.mark.security, pytest.mark.timeout(300)]


def _wait(cond: Callable[[], bool], what: str, timeout_s: float = 60.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not cond():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.2)


def _letters(kafka: KafkaSettings, experiment: str, n: int) -> list[DeadLetter]:
    return collect(kafka, Topics(experiment).dlq, DeadLetter, lambda out: len(out) >= n, timeout_s=30)


def _forged_snapshot(out: Outsider, topic: str, state: dict[str, torch.Tensor], version: int, headers) -> None:
    """A self-consistent snapshot (names, shapes, dtypes, hashes, checksum all right) sent as a trainer would."""
    payload = snapshot(state, version)
    from astraflow.weights.delta import SparseDelta

    chunks = split_chunks("policy", version, payload, 64 * 1024)
    m = defaults("policy_version", policy="policy", version=version, kind="SNAPSHOT", dtype="float32",
                 num_chunks=len(chunks), payload_bytes=len(payload), sha256=sha256_hex(payload),
                 state_checksum=SparseDelta.from_bytes(payload).trailer.checksum.hex(), trainer_step=0,
                 trained_samples=0, created_at=int(time.time() * 1000))
    out.send(topic, encode("policy_version", m), "policy", headers, partition=0)
    for c in chunks:
        out.send(topic, encode("weight_chunk", {"policy": c.policy, "version": c.version, "index": c.index,
                                                "count": c.count, "data": c.data, "crc32": c.crc32}),
                 "policy", headers, partition=0)


def test_forged_nan_weights_under_a_huge_version_are_refused_and_the_trainers_versions_apply(
        kafka: KafkaSettings, experiment: str) -> None:
    topics, out = Topics(experiment), Outsider(kafka.bootstrap_servers)
    state = {"w": torch.randn(64, 8), "b": torch.zeros(8)}
    nan = {k: torch.full_like(v, math.nan) for k, v in state.items()}
    follower = KafkaWeightFollower(kafka, experiment, "policy", requester="node-a", request_snapshots=False)
    follower.start()
    # 1. unsigned; 2. a signature header made up; 3. the trainer's header copied from another record.
    _forged_snapshot(out, topics.weights("policy"), nan, 1_000_000, None)
    _forged_snapshot(out, topics.weights("policy"), nan, 1_000_001, forged_signature())
    publisher = WeightPublisher(kafka, experiment, "policy", PublishSettings(snapshot_every=100))
    publisher.start()
    honest = [publisher.publish({k: v + i for k, v in state.items()}).version for i in range(3)]
    stolen = out.capture(topics.weights("policy"))[-1][2]  # the headers of the trainer's last chunk
    _forged_snapshot(out, topics.weights("policy"), nan, 1_000_002, stolen)
    honest.append(publisher.publish({k: v + 3 for k, v in state.items()}).version)
    events: list = []
    _wait(lambda: events.extend(follower.poll(0.5)) or follower.follower.version == honest[-1], "the honest versions")
    follower.close()
    assert honest == [0, 1, 2, 3]
    assert [e.version for e in events if e.result.status == ApplyStatus.APPLIED] == honest  # none lost
    assert all(bool(torch.isfinite(t).all()) for t in follower.follower.state.values())
    letters = _letters(kafka, experiment, 3)
    assert len({d.offset for d in letters}) >= 3 and all(d.error_class == "SignatureError" for d in letters)
    reasons = " | ".join(d.error for d in letters)
    assert "unsigned" in reasons and "not in" in reasons and "bad signature" in reasons, reasons
    assert latest_policy_version(kafka, topics, "policy").version == 3


def test_forged_and_replayed_policy_versions_do_not_move_curates_view(kafka: KafkaSettings, experiment: str) -> None:
    topics, out = Topics(experiment), Outsider(kafka.bootstrap_servers)
    publisher = WeightPublisher(kafka, experiment, "policy")
    publisher.start()
    publisher.publish({"w": torch.zeros(4)})
    old = out.capture(topics.policies)[-1]  # version 0, signed by the trainer
    publisher.publish({"w": torch.ones(4)})
    forged = defaults("policy_version", policy="policy", version=1_000_000_000, kind="SNAPSHOT", dtype="float32",
                      num_chunks=1, payload_bytes=1, sha256="0" * 64, state_checksum="0" * 64, trainer_step=0,
                      trained_samples=0, created_at=int(time.time() * 1000))
    out.send(topics.policies, encode("policy_version", forged), "policy")  # attack: unsigned version 1e9
    out.send(topics.policies, old[1], old[0], old[2])  # attack: the trainer's own version 0, replayed
    trainer = Signer(experiment, "trainer")
    v = encode("policy_version", {**forged, "version": 0})  # attack: a version going back, freshly signed
    out.send(topics.policies, v, "policy", list(trainer.headers("policies", "policy", v).items()))
    publisher.publish({"w": torch.full((4,), 2.0)})  # honest work goes on
    reader = CompactedReader(kafka, topics.policies, expect=PolicyVersion, signed=(experiment, "policies"),
                             component="curate")
    try:
        reader.catch_up()
        assert reader.latest["policy"].version == 2 and reader.refused == 3
    finally:
        reader.close()
    assert latest_policy_version(kafka, topics, "policy").version == 2
    reasons = " | ".join(d.error for d in _letters(kafka, experiment, 3))
    assert "unsigned" in reasons and "replayed" in reasons and "goes back" in reasons, reasons


def test_control_only_from_the_operator_never_replayed(kafka: KafkaSettings, experiment: str) -> None:
    topics, out = Topics(experiment), Outsider(kafka.bootstrap_servers)
    operator = ControlWriter(kafka, experiment)
    operator.set("reward", "reward", "exact_match")
    first = out.capture(topics.control)[-1]
    operator.set("reward", "reward", "math_verify")
    evil = encode("control", defaults("control", app="reward", slot="reward", strategy="always_one", version=99,
                                      issued_by="raas-node-7", issued_at=int(time.time() * 1000)))
    out.send(topics.control, evil, "reward/reward")  # a rollout node (or anyone) sets the reward
    out.send(topics.control, evil, "reward/reward", forged_signature())
    trainer = Signer(experiment, "trainer")  # a trainer's host speaking for the operator
    out.send(topics.control, evil, "reward/reward", list(trainer.headers("control", "reward/reward", evil).items()))
    out.send(topics.control, first[1], first[0], first[2])  # the operator's old command, replayed
    out.send(topics.control, None, "reward/reward")  # an unsigned tombstone: back to the default
    operator.set("curate", "advantage", "rloo")  # honest work goes on
    reader = ControlReader(kafka, experiment, None).start()
    try:
        assert reader.get_for("reward", "reward").strategy == "math_verify"
        assert reader.get_for("curate", "advantage").strategy == "rloo"
        assert reader.errors and len(reader.errors) == 5
    finally:
        reader.close()
    reasons = " | ".join(d.error for d in _letters(kafka, experiment, 5))
    for says in ("unsigned", "not in", "only the operator writes it", "replayed"):
        assert says in reasons, (says, reasons)


def test_replayed_old_signed_weights_roll_nothing_back(kafka: KafkaSettings, experiment: str) -> None:
    topics, out = Topics(experiment), Outsider(kafka.bootstrap_servers)
    follower = KafkaWeightFollower(kafka, experiment, "policy", requester="node-b", request_snapshots=False)
    follower.start()
    publisher = WeightPublisher(kafka, experiment, "policy", PublishSettings(snapshot_every=100))
    publisher.start()
    states = [{"w": torch.full((16,), float(i))} for i in range(3)]
    publisher.publish(states[0])
    old = out.capture(topics.weights("policy"))  # version 0 as the trainer signed it
    for s in states[1:]:
        publisher.publish(s)
    for key, value, headers in old:  # the attack: version 0 again, signatures intact
        out.send(topics.weights("policy"), value, key, headers, partition=0)
    publisher.publish({"w": torch.full((16,), 3.0)})  # honest work goes on
    events: list = []
    _wait(lambda: events.extend(follower.poll(0.5)) or follower.follower.version == 3, "version 3")
    follower.close()
    assert [e.version for e in events if e.result.status == ApplyStatus.APPLIED] == [0, 1, 2, 3]
    assert [e.result.status for e in events if e.version == 0][1:] == [ApplyStatus.STALE]  # seen, never applied
    assert bool((follower.follower.state["w"] == 3.0).all())


def test_oversized_and_malformed_signatures_are_refused(kafka: KafkaSettings, experiment: str) -> None:
    topics, out = Topics(experiment), Outsider(kafka.bootstrap_servers)
    operator = ControlWriter(kafka, experiment)
    operator.set("reward", "reward", "exact_match")
    big = b"\xc3\x01" + bytes(900_000)  # near the control topic's record limit
    out.send(topics.control, big, "reward/reward", forged_signature())
    out.send(topics.control, big[:64], "reward/reward", [("af-sig", b"v1:" + b"f" * 4000)])  # a huge header
    out.send(topics.control, big[:64], "reward/reward", [("af-sig", b"x"), ("af-sig", b"y")])  # two of them
    operator.set("reward", "reward", "math_verify")
    reader = ControlReader(kafka, experiment, None).start()
    try:
        assert reader.get_for("reward", "reward").strategy == "math_verify" and len(reader.errors) == 3
    finally:
        reader.close()
    reasons = " | ".join(d.error for d in _letters(kafka, experiment, 3))
    assert "not in" in reasons and "malformed" in reasons and "2 af-sig headers" in reasons, reasons
