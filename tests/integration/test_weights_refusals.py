"""A RaaS node's weight follower on a real broker refuses every crafted bad version and keeps serving.

Good versions and crafted bad ones (checksums recomputed wherever a liar would) are written to
the policy's weights topic; the node's follower (`BackendWeightFollower` over a real torch
backend) must apply the good ones, dead-letter each bad one with its reason, count it in the
`weights_refused_total` metric, and keep the backend on the last good version, bit for bit.
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Callable
from pathlib import Path

import numpy as np
import torch
from helpers import collect, replace_tensor

from astraflow.config import AstraflowConfig, KafkaSettings
from astraflow.kafka.clients import RecordProducer
from astraflow.kafka.signing import Signer
from astraflow.kafka.topics import Topics
from astraflow.raas.backends.base import GenerateRequest
from astraflow.raas.backends.torch_backend import TorchBackend
from astraflow.raas.weight_follower import BackendWeightFollower
from astraflow.records import DeadLetter, Metric, PolicyVersion, WeightKind
from astraflow.weights.codec import zstd
from astraflow.weights.delta import SparseDelta, encode
from astraflow.weights.format import (
    FULL_CHUNK,
    FULL_ZSTD_PLANES,
    OP_FULL,
    TensorRecord,
)
from astraflow.weights.publish import split_chunks
from astraflow.weights.snapshot import snapshot
from astraflow.weights.store import sha256_hex

EMB = "model.embed_tokens.weight"


def _unique_state(backend: TorchBackend) -> dict[str, torch.Tensor]:
    """The model's tensors without tied aliases, as a trainer publishes them."""
    layout = backend.weight_layout()
    sd = backend.state_dict()
    return {g[0]: sd[g[0]].clone().contiguous() for g in layout.groups}


def _shifted(state: dict[str, torch.Tensor], by: float) -> dict[str, torch.Tensor]:
    return {k: v + by if v.is_floating_point() else v for k, v in state.items()}


class Writer:
    """Writes manifests and chunks to the weights topic, as a trainer would (or a liar): signed
    with the trainer's own key, so what is refused here is refused for what it holds."""

    def __init__(self, kafka: KafkaSettings, topic: str, experiment: str) -> None:
        self.producer, self.topic = RecordProducer(kafka), topic
        self.signer = Signer(experiment, "trainer")

    def _send(self, record, key: str = "policy") -> None:
        value = self.producer.serde.dumps(record)
        self.producer.send_raw(self.topic, value, key, self.signer.headers("policy.weights", key, value))

    def send(self, version: int, payload: bytes, kind: WeightKind = WeightKind.SNAPSHOT, *, drop_last: bool = False,
             chunk_bytes: int = 256 * 1024, **fields) -> None:
        chunks = split_chunks("policy", version, payload, chunk_bytes)
        m = PolicyVersion(policy="policy", version=version, kind=kind, dtype="float32", num_chunks=len(chunks),
                          payload_bytes=len(payload), sha256=sha256_hex(payload),
                          state_checksum=SparseDelta.from_bytes(payload).trailer.checksum.hex(), trainer_step=0,
                          trained_samples=0, base_version=version - 1 if kind == WeightKind.DELTA else None)
        m = dataclasses.replace(m, **fields)
        self._send(m)
        for c in chunks[:-1] if drop_last and m.num_chunks else chunks[: m.num_chunks]:
            self._send(c)
        self.producer.flush()

    def garbage(self) -> None:
        value = b"\xc3\x01 not a record"
        self.producer.send_raw(self.topic, value, "policy", self.signer.headers("policy.weights", "policy", value))
        self.producer.flush()


def _zip_bomb(backend: TorchBackend, state: dict, version: int) -> bytes:
    """A snapshot whose embedding chunk inflates to 1 GiB (frames and checksums all consistent)."""
    z = zstd.ZstdCompressor(level=1)
    zeros = bytes(16 * 1024 * 1024)
    bomb = b"".join(z.compress(zeros) for _ in range(64)) + z.flush()
    meta = backend.weight_layout().tensors[EMB]
    body = (TensorRecord(EMB, OP_FULL, meta, 0, 0, meta.numel, 1, 0).pack_head()
            + FULL_CHUNK.pack(0, meta.numel, FULL_ZSTD_PLANES, len(bomb)) + bomb)
    return replace_tensor(snapshot(state, version), EMB, body)


def _wait(cond: Callable[[], bool], what: str, timeout_s: float = 60.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not cond():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.1)


def _serves(backend: TorchBackend, version: int, state: dict[str, torch.Tensor]) -> None:
    _wait(lambda: backend.version == version, f"backend at version {version}")
    sd = backend.state_dict()
    for name, value in state.items():
        assert torch.equal(sd[name], value), f"{name} differs from version {version}"
    gen = backend.generate_sync(GenerateRequest([1, 2, 3], 4, temperature=1.0))
    assert len(gen.token_ids) > 0 and (gen.versions == version).all()



def test_bad_versions_are_refused_dead_lettered_and_the_node_keeps_its_weights(
        kafka: KafkaSettings, experiment: str, tiny_model_dir: Path) -> None:
    topics = Topics(experiment)
    backend = TorchBackend("policy", str(tiny_model_dir), seed=0, max_batch=2, threads=1)
    s0 = _unique_state(backend)
    s1, s2, s3 = _shifted(s0, 0.01), _shifted(s0, 0.02), _shifted(s0, 0.03)
    w = Writer(kafka, topics.weights("policy"), experiment)
    follower = BackendWeightFollower(AstraflowConfig(kafka=kafka), experiment, "policy", backend).start()
    try:
        w.send(0, snapshot(s0, 0))
        w.send(1, encode(s0, s1, base_version=0, version=1).to_bytes(), WeightKind.DELTA)
        _serves(backend, 1, s1)

        honest = encode(s1, s2, base_version=1, version=2)
        other = encode(s1, _shifted(s1, 0.5), base_version=1, version=2)
        lying = b"".join([honest.blocks[0], *other.blocks[1:-1], honest.blocks[-1]])
        wrong_shape = {**s2, EMB: torch.zeros(s2[EMB].shape[0], s2[EMB].shape[1] + 1)}
        wrong_dtype = {**s2, EMB: torch.zeros(s2[EMB].shape, dtype=torch.int32)}
        bad = {  # version -> (what we send, a phrase of the reason the node gives)
            2: (lambda: w.send(2, lying, WeightKind.DELTA), "does not match its checksum after applying"),
            3: (lambda: w.send(3, _zip_bomb(backend, s2, 3)), "decompresses to more than"),
            4: (lambda: w.send(4, snapshot(wrong_shape, 4)), "but the served model's is"),
            5: (lambda: w.send(5, snapshot(wrong_dtype, 5)), "is int32 but the served model holds float32"),
            6: (lambda: w.send(6, snapshot({**s2, "evil.weight": torch.zeros(3)}, 6)), "not a tensor of the served model"),
            7: (lambda: w.send(7, snapshot(s2, 7), num_chunks=0, uri="file:///etc/passwd"), "outside weights.allowed_uri_prefixes"),
            8: (lambda: w.send(8, snapshot(s2, 8), num_chunks=0, uri="http://127.0.0.1:9/policy/v8"), "outside weights.allowed_uri_prefixes"),
            9: (lambda: w.send(9, encode(s1, s2, base_version=1, version=9).to_bytes(), WeightKind.DELTA, base_version=1,
                               drop_last=True, chunk_bytes=64 * 1024, metadata={"max_version_step": "100"}), "truncated"),
            11: (lambda: w.send(11, snapshot({k: torch.full_like(v, float("nan")) if v.is_floating_point() else v
                                              for k, v in s2.items()}, 11)), "holds NaN or infinity"),
            12: (lambda: w.send(12, encode(s1, s2, base_version=1, version=12).to_bytes(), WeightKind.DELTA,
                                base_version=1), "declares at most 1 per delta"),
            1: (lambda: w.send(1, snapshot(s2, 1)), "a version number must always mean the same weights"),
        }
        for send, _ in bad.values():
            send()
        w.garbage()
        _wait(lambda: follower.follower.refused >= len(bad) + 1, "every bad record refused")
        _serves(backend, 1, s1)  # still the last good version, bit for bit

        w.send(10, snapshot(s3, 10))
        _serves(backend, 10, s3)
        w.send(9, snapshot(s2, 9))  # a valid snapshot, but numbered below the version it follows
        bad[90] = (None, "version 9 comes after version 10 in the log")
        _wait(lambda: follower.follower.refused >= len(bad) + 1, "the backwards version refused")
        _serves(backend, 10, s3)
    finally:
        follower.stop()
        backend.close()

    letters: list[DeadLetter] = collect(kafka, topics.dlq, DeadLetter, lambda out: len(out) >= len(bad) + 1, timeout_s=30)
    assert len(letters) == len(bad) + 1 and all(d.component == "raas" for d in letters)
    assert any(d.error_class in ("CorruptRecordError", "UnknownSchemaError") for d in letters), \
        [d.error_class for d in letters]  # the record that does not decode
    for _, says in bad.values():
        assert any(says in d.error for d in letters), (says, [d.error[:120] for d in letters])
    metrics: list[Metric] = collect(kafka, topics.metrics, Metric,
                                     lambda out: any(m.value >= len(bad) + 1 for m in out), timeout_s=30)
    refused = [m for m in metrics if m.name == "weights_refused_total" and m.labels["policy"] == "policy"]
    assert max(m.value for m in refused) == len(bad) + 1
    assert np.all(np.diff([m.value for m in refused]) >= 0)
