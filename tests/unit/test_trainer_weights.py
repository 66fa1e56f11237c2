"""Publishing without a broker: VersionEncoder -> records -> WeightFollower, and the weight store.

The follower is fed the records the publisher would send, in topic order, so every check here
is about the pure logic: bit-exact reproduction over many deltas, chunk and payload checks,
gaps, and falling back to a snapshot (never to wrong weights).
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import replace

import pytest
import torch

from astraflow.errors import WeightsError
from astraflow.records import PolicyVersion, WeightChunk, WeightKind
from astraflow.weights.chain import ApplyStatus
from astraflow.weights.follow import WeightFollower
from astraflow.weights.publish import PublishSettings, VersionEncoder, published_state, split_chunks
from astraflow.weights.store import WeightStore, WeightStoreError, fetch_blob, sha256_hex
from astraflow.weights.verify import FollowLimits
from astraflow.weights.versions import SNAPSHOT_OFFSET

pytestmark = pytest.mark.unit

# torch sets TORCHINDUCTOR_CACHE_DIR the first time an optimizer is built; build one at import
# so the environment is already settled when conftest's leak guard takes its snapshot.
torch.optim.Adam([torch.zeros(1, requires_grad=True)])


def _bits_equal(a: dict, b: dict) -> bool:
    return a.keys() == b.keys() and all(
        a[k].dtype == b[k].dtype and torch.equal(a[k].view(torch.int16), b[k].view(torch.int16)) for k in a
    )


class _Tied(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.emb = torch.nn.Embedding(64, 32)
        self.mid = torch.nn.Linear(32, 32)
        self.head = torch.nn.Linear(32, 64, bias=False)
        self.head.weight = self.emb.weight  # tied, like small LMs

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(torch.tanh(self.mid(self.emb(x))))


def _versions(n: int, settings: PublishSettings, seed: int = 0,
              beside: dict[int, list] | None = None) -> Iterator[tuple[list, dict]]:
    """(stream records as the publisher sends them, published state) for n versions of Adam
    training; `beside` collects, by version, the records of the snapshots written beside the
    stream (the weights topic's snapshot partition), with their offsets there."""
    torch.manual_seed(seed)
    model = _Tied()
    opt = torch.optim.Adam(model.parameters(), lr=1e-3)
    enc = VersionEncoder("p", settings)
    snap, offset, snap_offset = None, 0, 0
    for _ in range(n):
        pub = enc.encode(model.state_dict(), trainer_step=enc.next_version)
        m = pub.manifest
        if pub.beside is not None:
            sm, payload = pub.beside
            chunks = split_chunks("p", sm.version, payload, settings.chunk_bytes)
            sm.num_chunks, sm.latest_snapshot = len(chunks), sm.version
            if beside is not None:
                beside[sm.version] = [(snap_offset, sm)] + [(snap_offset + 1 + i, c) for i, c in enumerate(chunks)]
            snap, snap_offset = (sm.version, snap_offset), snap_offset + 1 + len(chunks)
        chunks = split_chunks("p", m.version, pub.payload, settings.chunk_bytes)
        m.num_chunks = len(chunks)
        if snap is not None:
            m.latest_snapshot, m.metadata = snap[0], {SNAPSHOT_OFFSET: str(snap[1])}
        records = [(offset, m)] + [(offset + 1 + i, c) for i, c in enumerate(chunks)]
        offset += 1 + len(chunks)
        yield records, pub.state
        x = torch.randint(0, 64, (16,))
        loss = model(x).logsumexp(-1).mean()
        opt.zero_grad()
        loss.backward()
        opt.step()


def _feed(f: WeightFollower, records: list) -> list:
    events = []
    for off, r in records:
        events += f.feed(r, off)
    return events


def test_published_state_casts_and_drops_tied_aliases() -> None:
    state = published_state(_Tied().state_dict(), "bfloat16")
    assert "head.weight" not in state and "emb.weight" in state
    assert all(t.dtype == torch.bfloat16 and t.device.type == "cpu" for t in state.values())


def test_prepared_weights_encode_to_the_same_bytes_and_a_wrong_dtype_is_refused() -> None:
    """The trainer hands the encoder weights it already cast and checked (`prepared`): the same
    payloads and manifests as from the raw state, and weights not in the published dtype refused."""
    torch.manual_seed(0)
    model, settings = _Tied(), PublishSettings(dtype="bfloat16", snapshot_every=2)
    raw, ready = VersionEncoder("p", settings), VersionEncoder("p", settings)
    opt = torch.optim.Adam(model.parameters(), lr=1e-2)
    for _ in range(3):
        state = model.state_dict()
        a = raw.encode(state, trainer_step=1)
        b = ready.encode(published_state(state, "bfloat16"), trainer_step=1, prepared=True)
        assert a.payload == b.payload and _bits_equal(a.state, b.state)
        assert replace(a.manifest, created_at=0) == replace(b.manifest, created_at=0)
        assert (a.beside is None) == (b.beside is None) and (a.beside is None or a.beside[1] == b.beside[1])
        model(torch.randint(0, 64, (8,))).logsumexp(-1).mean().backward()
        opt.step()
        opt.zero_grad()
    with pytest.raises(WeightsError, match="not the published bfloat16"):
        ready.encode(published_state(model.state_dict(), "float32"), prepared=True)
    assert ready.next_version == 3  # nothing changed


def test_chain_of_20_deltas_reproduces_published_weights_bit_for_bit() -> None:
    settings = PublishSettings(snapshot_every=100, chunk_bytes=2048)
    f = WeightFollower("p")
    kinds = []
    for records, state in _versions(21, settings):
        events = _feed(f, records)
        assert [e.result.status for e in events] == [ApplyStatus.APPLIED]
        kinds.append(records[0][1].kind)
        assert _bits_equal(dict(f.state), state)
        assert f.chain.checksum.hex() == records[0][1].state_checksum
    assert kinds[0] == WeightKind.SNAPSHOT and kinds[1:] == [WeightKind.DELTA] * 20


def test_every_version_is_a_delta_in_the_stream_with_a_snapshot_beside_every_n() -> None:
    beside: dict[int, list] = {}
    kinds = [r[0][1].kind for r, _ in _versions(7, PublishSettings(snapshot_every=3, chunk_bytes=4096), beside=beside)]
    # only the first version (nothing to delta against) is a snapshot in the stream
    assert kinds == [WeightKind.SNAPSHOT] + [WeightKind.DELTA] * 6
    assert sorted(beside) == [0, 3, 6] and all(b[0][1].kind == WeightKind.SNAPSHOT for b in beside.values())


def test_a_versions_delta_and_its_snapshot_give_the_same_weights() -> None:
    """A version number means one set of weights: a follower that applies version 3's delta and
    one that loads version 3's snapshot hold the same bits, and both manifests say so."""
    beside: dict[int, list] = {}
    vs = list(_versions(5, PublishSettings(snapshot_every=3, chunk_bytes=1024), beside=beside))
    by_delta = WeightFollower("p")
    for records, _ in vs[:4]:
        _feed(by_delta, records)
    by_snapshot = WeightFollower("p")
    events = [e for _, r in beside[3] for e in by_snapshot.feed_snapshot(r, vs[3][0][0][0])]
    assert [e.result.status for e in events] == [ApplyStatus.APPLIED]
    assert by_delta.version == by_snapshot.version == 3
    assert vs[3][0][0][1].kind == WeightKind.DELTA and beside[3][0][1].kind == WeightKind.SNAPSHOT
    assert vs[3][0][0][1].state_checksum == beside[3][0][1].state_checksum
    assert _bits_equal(dict(by_delta.state), dict(by_snapshot.state)) and _bits_equal(dict(by_delta.state), vs[3][1])
    # read on from the snapshot's place in the stream: its own delta is stale, the next applies
    after = [e.result.status for records, _ in vs[3:] for e in _feed(by_snapshot, records)]
    assert after == [ApplyStatus.STALE, ApplyStatus.APPLIED] and _bits_equal(dict(by_snapshot.state), vs[4][1])


def test_a_snapshot_under_an_applied_number_with_other_weights_is_refused() -> None:
    beside: dict[int, list] = {}
    vs = list(_versions(4, PublishSettings(snapshot_every=3, chunk_bytes=4096), beside=beside))
    other: dict[int, list] = {}
    list(_versions(4, PublishSettings(snapshot_every=3, chunk_bytes=4096), seed=1, beside=other))
    f = WeightFollower("p")
    for records, _ in vs:
        _feed(f, records)
    events = [e for _, r in other[3] for e in f.feed_snapshot(r)]
    assert [e.result.status for e in events] == [ApplyStatus.REFUSED] and "same weights" in events[0].result.reason
    assert f.version == 3 and _bits_equal(dict(f.state), vs[3][1])


def test_a_follower_that_keeps_up_never_needs_a_snapshot() -> None:
    beside: dict[int, list] = {}
    f = WeightFollower("p")
    for records, state in _versions(12, PublishSettings(snapshot_every=4, chunk_bytes=2048), beside=beside):
        assert [e.result.status for e in _feed(f, records)] == [ApplyStatus.APPLIED]
        assert _bits_equal(dict(f.state), state) and f.snapshot_hint is None
    assert sorted(beside) == [0, 4, 8]


def _recover(f: WeightFollower, beside: dict[int, list], stream: list[tuple[list, dict]]) -> list:
    """What a Kafka follower does on a hint: load that snapshot from beside the stream, then read
    the stream again from the snapshot's version on."""
    hint = f.snapshot_hint
    assert hint is not None and hint.offset == beside[hint.version][0][0]
    resume = stream[hint.version][0][0][0]
    events = [e for _, r in beside[hint.version] for e in f.feed_snapshot(r, resume)]
    for records, _ in stream[hint.version:]:
        events += _feed(f, records)
    return events


def test_corrupted_chunk_falls_back_to_the_next_snapshot_never_wrong_weights() -> None:
    settings = PublishSettings(snapshot_every=4, chunk_bytes=1024)
    beside: dict[int, list] = {}
    stream = list(_versions(9, settings, beside=beside))
    f = WeightFollower("p")
    statuses = []
    for records, _ in stream:
        m = records[0][1]
        if m.version == 2:  # flip a byte of the second chunk, keep its recorded crc32
            off, c = records[2]
            records = [*records[:2], (off, WeightChunk(c.policy, c.version, c.index, c.count, bytes([c.data[0] ^ 1]) + c.data[1:], c.crc32)), *records[3:]]
        statuses += [(e.version, e.result.status) for e in _feed(f, records)]
        if f.version is not None:  # whatever it holds is exactly a published version
            assert _bits_equal(dict(f.state), stream[f.version][1])
        if f.snapshot_hint is not None:
            break
    assert (2, ApplyStatus.SNAPSHOT_NEEDED) in statuses and (3, ApplyStatus.SNAPSHOT_NEEDED) in statuses
    assert f.snapshot_hint is not None and f.snapshot_hint.version == 4 and f.version == 1
    events = _recover(f, beside, stream)
    assert (4, ApplyStatus.APPLIED) in [(e.version, e.result.status) for e in events]  # the snapshot beside
    assert f.version == 8 and f.snapshot_hint is None and _bits_equal(dict(f.state), stream[8][1])


def test_missing_version_points_at_a_newer_snapshot() -> None:
    settings = PublishSettings(snapshot_every=3, chunk_bytes=4096)
    beside: dict[int, list] = {}
    stream = list(_versions(8, settings, beside=beside))
    f = WeightFollower("p")
    _feed(f, stream[0][0])
    assert f.version == 0
    # v1..v4 never reach this follower (it was away); v5 is a delta from v4.
    events = _feed(f, stream[5][0])
    assert events[0].result.status == ApplyStatus.SNAPSHOT_NEEDED and f.version == 0
    assert f.snapshot_hint is not None and f.snapshot_hint.version == 3
    events = _recover(f, beside, stream)
    assert f.version == 7 and f.snapshot_hint is None
    assert not [e for e in events if e.refused]  # v3 (and v5 again) read after the snapshot: replays
    assert _bits_equal(dict(f.state), stream[7][1])


def test_stream_records_before_a_snapshot_loaded_beside_are_replays() -> None:
    """Found by time, the stream may resume a little before the snapshot's version: the versions
    below it are stale, not refused as numbers going back; after it, order is strict again."""
    beside: dict[int, list] = {}
    stream = list(_versions(6, PublishSettings(snapshot_every=3, chunk_bytes=4096), beside=beside))
    f = WeightFollower("p")
    assert [e.result.status for _, r in beside[3] for e in f.feed_snapshot(r, stream[2][0][0][0])] == [ApplyStatus.APPLIED]
    statuses = [e.result.status for records, _ in stream[2:] for e in _feed(f, records)]
    assert statuses == [ApplyStatus.STALE, ApplyStatus.STALE, ApplyStatus.APPLIED, ApplyStatus.APPLIED]
    assert [e.result.status for e in _feed(f, stream[4][0][:1])] == [ApplyStatus.STALE]  # an applied number
    assert _feed(f, [(stream[5][0][-1][0] + 1, stream[1][0][0][1])])[0].refused  # older, after newer ones


def test_incomplete_version_and_bad_sha_are_refused() -> None:
    settings = PublishSettings(snapshot_every=50, chunk_bytes=1024)
    vs = list(_versions(3, settings))
    f = WeightFollower("p")
    _feed(f, vs[0][0])
    # v1 loses its last chunk: the next manifest finds it incomplete
    events = _feed(f, vs[1][0][:-1]) + _feed(f, vs[2][0])
    assert [e.result.status for e in events] == [ApplyStatus.SNAPSHOT_NEEDED, ApplyStatus.SNAPSHOT_NEEDED]
    assert f.version == 0
    # a manifest whose sha256 does not match its chunks
    g = WeightFollower("p")
    _feed(g, vs[0][0])
    (off, m), *chunks = vs[1][0]
    bad = PolicyVersion(**{**{k: getattr(m, k) for k in m.__slots__}, "sha256": "0" * 64})
    events = _feed(g, [(off, bad), *chunks])
    assert events[0].result.status == ApplyStatus.SNAPSHOT_NEEDED and g.version == 0
    assert "sha256" in events[0].result.reason


def test_stale_versions_and_other_policies_are_skipped() -> None:
    vs = list(_versions(2, PublishSettings(chunk_bytes=4096)))
    f = WeightFollower("p")
    _feed(f, vs[0][0] + vs[1][0])
    events = _feed(f, vs[1][0])
    assert [e.result.status for e in events] == [ApplyStatus.STALE]
    other = WeightFollower("q")
    assert _feed(other, vs[0][0]) == [] and other.version is None


def test_claim_checked_payload_is_fetched_and_verified(tmp_path) -> None:
    store = WeightStore(tmp_path / "store")
    (records, state), *_ = _versions(1, PublishSettings())
    (_, m), *chunks = records
    payload = b"".join(c.data for _, c in chunks)
    m.uri, m.num_chunks = store.put("p/v0.snapshot", payload), 0
    assert WeightFollower("p").feed(m)[0].result.status == ApplyStatus.REFUSED  # the store is not allowed yet
    limits = FollowLimits(allowed_uri_prefixes=(store.root,))
    f = WeightFollower("p", limits=limits)
    assert f.feed(m)[0].result.status == ApplyStatus.APPLIED
    assert _bits_equal(dict(f.state), state)
    (tmp_path / "store" / "p" / "v0.snapshot").write_bytes(payload[:-1] + b"\0")
    g = WeightFollower("p", limits=limits)
    event = g.feed(m)[0]
    assert event.result.status == ApplyStatus.SNAPSHOT_NEEDED and g.version is None


def test_store_round_trip_local_and_fsspec(tmp_path) -> None:
    data = b"weights" * 1000
    local = WeightStore(tmp_path)
    uri = local.put("pol/v1.delta", data)
    assert uri.startswith("file://") and fetch_blob(uri, sha256_hex(data)) == data
    assert not [p for p in (tmp_path / "pol").iterdir() if p.name.endswith(".tmp")]
    mem = WeightStore("memory://astraflow-test-store")
    uri = mem.put("pol/v2.snapshot", data)
    assert mem.get(uri, sha256_hex(data)) == data
    with pytest.raises(WeightStoreError, match="sha256"):
        mem.get(uri, sha256_hex(b"other"))
    mem.delete(uri)
    with pytest.raises(WeightStoreError, match="cannot read"):
        fetch_blob(uri)


def test_a_snapshot_request_fits_its_schema() -> None:
    """The follower's snapshot request is a Control record whose `version` is an Avro int: the
    millisecond clock it once held (over 2^31) made the compiled encoder refuse it, and the
    follower crashed where it asks for a snapshot."""
    from astraflow.serde import AvroSerde
    from astraflow.weights.versions import snapshot_request

    req = snapshot_request("solver", "raas-1", "chunk 0/1 is out of order or corrupt")
    back = AvroSerde().loads(AvroSerde().dumps(req))
    assert back.slot == "solver.snapshot" and back.params == {"reason": "chunk 0/1 is out of order or corrupt"}
    assert 0 < back.version < 2**31
