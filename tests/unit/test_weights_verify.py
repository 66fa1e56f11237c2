"""What a weight follower refuses, without a broker: crafted payloads and manifests that lie.

Each bad record is built the way an attacker or a broken writer would (checksums recomputed so
that only the check under test can catch it), and the follower must refuse it and keep exactly
the weights of its last good version.
"""

from __future__ import annotations

import dataclasses
import tracemalloc

import numpy as np
import pytest
from helpers import replace_tensor

from astraflow.records import PolicyVersion, WeightKind
from astraflow.weights.bits import StateManifest
from astraflow.weights.chain import ApplyStatus
from astraflow.weights.codec import zstd
from astraflow.weights.delta import SparseDelta, encode
from astraflow.weights.follow import WeightFollower
from astraflow.weights.format import (
    FULL_CHUNK,
    FULL_ZSTD_PLANES,
    OP_FULL,
    TensorRecord,
)
from astraflow.weights.layout import ModelLayout
from astraflow.weights.publish import split_chunks
from astraflow.weights.snapshot import snapshot
from astraflow.weights.store import WeightStore, WeightStoreError, sha256_hex
from astraflow.weights.verify import (
    FollowLimits,
    VersionLedger,
    WeightRefusedError,
    check_manifest,
    fetch_bounded,
    uri_allowed,
)

RNG = np.random.default_rng(0)
S0 = {"emb": RNG.standard_normal((64, 16)).astype(np.float32), "bias": RNG.standard_normal(16).astype(np.float32)}
LAYOUT = ModelLayout.of(S0)


def _changed(state: dict, scale: float) -> dict:
    return {k: (v + np.float32(scale)).astype(v.dtype) for k, v in state.items()}


S1, S2 = _changed(S0, 0.5), _changed(S0, 0.25)


def _manifest(version: int, payload: bytes, kind: WeightKind = WeightKind.SNAPSHOT, **kw) -> PolicyVersion:
    trailer = SparseDelta.from_bytes(payload).trailer.checksum.hex()
    fields = {"policy": "p", "version": version, "kind": kind, "dtype": "float32", "num_chunks": 0,
              "payload_bytes": len(payload), "sha256": sha256_hex(payload), "state_checksum": trailer,
              "trainer_step": 0, "trained_samples": 0, "base_version": version - 1 if kind == WeightKind.DELTA else None}
    return PolicyVersion(**{**fields, **kw})


def _feed(f: WeightFollower, version: int, payload: bytes, offset: int, kind=WeightKind.SNAPSHOT, drop_last=False,
          **kw) -> list:
    m = _manifest(version, payload, kind, **kw)
    chunks = split_chunks("p", version, payload, 1024)
    m = dataclasses.replace(m, num_chunks=len(chunks))
    events = f.feed(m, offset)
    for c in chunks[:-1] if drop_last else chunks:
        events += f.feed(c)
    return events


def _follower() -> WeightFollower:
    f = WeightFollower("p", layout=LAYOUT)
    assert [e.result.status for e in _feed(f, 0, snapshot(S0, 0), 0)] == [ApplyStatus.APPLIED]
    assert [e.result.status for e in _feed(f, 1, encode(S0, S1, base_version=0, version=1).to_bytes(), 10,
                                            WeightKind.DELTA)] == [ApplyStatus.APPLIED]
    return f


def _holds(f: WeightFollower, version: int, state: dict) -> None:
    assert f.version == version
    assert set(f.state) == set(state) and all(np.array_equal(np.asarray(f.state[k]), v) for k, v in state.items())


def _refused(events: list, says: str) -> None:
    assert len(events) == 1 and events[0].refused, events
    assert says in events[0].result.reason, events[0].result.reason


def test_a_delta_whose_checksum_lies_is_rolled_back_exactly() -> None:
    f = _follower()
    a, b = encode(S1, S2, base_version=1, version=2), encode(S1, _changed(S1, 1.0), base_version=1, version=2)
    # b's tensor blocks under a's header and trailer: every frame and the payload sha256 are right.
    lying = b"".join([a.blocks[0], *b.blocks[1:-1], a.blocks[-1]])
    _refused(_feed(f, 2, lying, 20, WeightKind.DELTA), "does not match its checksum after applying")
    _holds(f, 1, S1)
    honest = a.to_bytes()
    _refused(_feed(f, 2, honest, 30, WeightKind.DELTA, state_checksum="ab" * 32), "does not produce the announced")
    _refused(_feed(f, 2, honest, 40, WeightKind.DELTA, sha256="cd" * 32), "does not match its sha256")
    _holds(f, 1, S1)


def test_a_chunk_that_decompresses_to_a_gigabyte_is_refused_without_inflating_it() -> None:
    f = _follower()
    z = zstd.ZstdCompressor(level=1)
    zeros = bytes(16 * 1024 * 1024)
    bomb = b"".join(z.compress(zeros) for _ in range(64)) + z.flush()  # 1 GiB of zeros, ~32 KiB compressed
    meta = LAYOUT.tensors["emb"]
    head = TensorRecord("emb", OP_FULL, meta, 0, 0, meta.numel, 1, 0).pack_head()
    body = head + FULL_CHUNK.pack(0, meta.numel, FULL_ZSTD_PLANES, len(bomb)) + bomb
    payload = replace_tensor(snapshot(S2, 2), "emb", body)
    tracemalloc.start()
    try:
        events = _feed(f, 2, payload, 20)
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    _refused(events, "decompresses to more than the 4096 bytes")
    assert peak < 64 * 1024 * 1024, f"{peak:,} bytes allocated while refusing the bomb"
    _holds(f, 1, S1)


@pytest.mark.parametrize(
    ("state", "says"),
    [
        ({**S2, "emb": np.zeros((64, 17), np.float32)}, "has shape [64, 17] but the served model's is [64, 16]"),
        ({**S2, "emb": np.zeros((64, 16), np.int32)}, "is int32 but the served model holds float32"),
        ({**S2, "evil": np.zeros(4, np.float32)}, "'evil' is not a tensor of the served model"),
        ({"emb": S2["emb"]}, "the snapshot lacks 1 tensors of the served model (e.g. ['bias'])"),
    ],
)
def test_a_snapshot_that_does_not_fit_the_model_is_refused(state: dict, says: str) -> None:
    f = _follower()
    _refused(_feed(f, 2, snapshot(state, 2), 20), says)
    _holds(f, 1, S1)


def test_a_huge_shape_is_refused_before_anything_is_allocated_even_without_a_layout() -> None:
    f = WeightFollower("p", limits=FollowLimits(max_state_bytes=1 << 20))
    _feed(f, 0, snapshot(S0, 0), 0)
    meta = dataclasses.replace(LAYOUT.tensors["emb"], shape=(1 << 20, 1 << 20))
    body = TensorRecord("emb", OP_FULL, meta, 0, 0, meta.numel, 0, 0).pack_head()
    _refused(_feed(f, 1, replace_tensor(snapshot(S1, 1), "emb", body), 10), "weights.max_state_bytes")
    _holds(f, 0, S0)


def test_truncated_payloads_are_refused() -> None:
    f = _follower()
    delta = encode(S1, S2, base_version=1, version=2).to_bytes()
    assert len(delta) > 1024  # more than one chunk
    events = _feed(f, 2, delta, 20, WeightKind.DELTA, drop_last=True) + _feed(f, 3, snapshot(S2, 3), 30)
    assert events[0].refused and "truncated" in events[0].result.reason
    assert events[1].result.status == ApplyStatus.APPLIED  # the next good version still applies
    _holds(f, 3, S2)


def test_truncated_claim_checked_blob_is_refused(tmp_path) -> None:
    store = WeightStore(tmp_path)
    f = WeightFollower("p", layout=LAYOUT, limits=FollowLimits(allowed_uri_prefixes=(store.root,)))
    payload = snapshot(S0, 0)
    m = _manifest(0, payload, uri=store.put("p/v0", payload[:-10]))
    _refused(f.feed(m, 0), "does not match its recorded sha256 (corrupt, truncated")
    assert f.version is None


def test_versions_never_go_back_and_a_number_never_means_other_weights() -> None:
    f = _follower()
    # v1 again with other weights (a valid, self-consistent snapshot)
    _refused(_feed(f, 1, snapshot(S2, 1), 20), "a version number must always mean the same weights")
    _holds(f, 1, S1)
    assert _feed(f, 3, snapshot(S2, 3), 30)[0].result.status == ApplyStatus.APPLIED
    _refused(_feed(f, 2, snapshot(S1, 2), 40), "version 2 comes after version 3 in the log")
    _holds(f, 3, S2)
    # the same version and weights again (a duplicate send, or a replay after a seek back): stale, not refused
    assert [e.result.status for e in _feed(f, 3, snapshot(S2, 3), 50)] == [ApplyStatus.STALE]


@pytest.mark.parametrize("uri", ["file:///etc/passwd", "http://127.0.0.1:9/w", "https://example.com/store/p/v1",
                                 "file:///data/store/../../etc/passwd", "file:///data/storex/p", "memory://store/p",
                                 "simplecache::file:///data/store/p", "file:///data/store/p?x=1", "s3://other/store/p"])
def test_payload_locations_outside_the_allowed_prefixes_are_refused(uri: str) -> None:
    limits = FollowLimits(allowed_uri_prefixes=("file:///data/store/", "s3://bucket/store"))
    assert not uri_allowed(uri, limits.allowed_uri_prefixes)
    f = WeightFollower("p", limits=limits)
    m = _manifest(0, snapshot(S0, 0), uri=uri)
    _refused(f.feed(m, 0), "outside weights.allowed_uri_prefixes")
    assert f.version is None


def test_locations_inside_the_allowed_prefixes() -> None:
    prefixes = ("file:///data/store/", "s3://bucket/store")
    assert uri_allowed("file:///data/store/p/v1.snapshot", prefixes)
    assert uri_allowed("s3://bucket/store/p/v1", prefixes) and uri_allowed("S3://BUCKET/store/p", prefixes)
    assert not uri_allowed("file:///data/store/p", ())


def test_fetch_reads_at_most_the_bound(tmp_path) -> None:
    store = WeightStore(tmp_path)
    data = bytes(5000)
    uri = store.put("p/v1", data)
    limits = FollowLimits(allowed_uri_prefixes=(store.root,), max_payload_bytes=4096)
    with pytest.raises(WeightStoreError, match="more than the 4,096 bytes"):
        fetch_bounded(uri, sha256_hex(data), limits)
    roomy = dataclasses.replace(limits, max_payload_bytes=8192)
    assert fetch_bounded(uri, sha256_hex(data), roomy) == data
    with pytest.raises(WeightStoreError, match="sha256"):
        fetch_bounded(uri, "00" * 32, roomy)
    with pytest.raises(WeightRefusedError, match="outside weights.allowed_uri_prefixes"):
        fetch_bounded(uri, None, FollowLimits())


@pytest.mark.parametrize(
    ("change", "says"),
    [
        ({"dtype": "float64"}, "dtype 'float64' is not one of"),
        ({"sha256": "not-hex"}, "64 lowercase hex digits"),
        ({"payload_bytes": 1 << 40}, "weights.max_payload_bytes"),
        ({"payload_bytes": 0}, "payload_bytes=0"),
        ({"version": -1}, "version -1 is negative"),
        ({"num_chunks": 10**9}, "num_chunks=1000000000 does not fit"),
        ({"kind": WeightKind.DELTA, "base_version": 5}, "base_version=5 must be below its version 5"),
        ({"kind": WeightKind.DELTA, "base_version": None}, "base_version=None"),
    ],
)
def test_malformed_manifests_are_refused(change: dict, says: str) -> None:
    m = dataclasses.replace(_manifest(5, snapshot(S0, 5)), **{"num_chunks": 3, **change})
    with pytest.raises(WeightRefusedError, match=says.replace("(", r"\(").replace("[", r"\[")):
        check_manifest(m, FollowLimits())


def test_ledger_tells_replays_from_reuse() -> None:
    ledger = VersionLedger()
    m = _manifest(4, snapshot(S0, 4))
    assert ledger.check(m, 100) is False
    ledger.record(m, 100)
    assert ledger.check(m, 200) is True  # same weights again
    assert ledger.check(_manifest(3, snapshot(S1, 3)), 90) is True  # read again after a seek back
    with pytest.raises(WeightRefusedError, match="comes after version 4"):
        ledger.check(_manifest(3, snapshot(S1, 3)), 150)
    with pytest.raises(WeightRefusedError, match="same weights"):
        ledger.check(_manifest(4, snapshot(S1, 4)), 300)
    assert StateManifest.of(S0).checksum().hex() == m.state_checksum
