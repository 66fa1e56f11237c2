"""Publishing without a broker: VersionEncoder -> records -> WeightFollower, and the weight store.

The follower is fed the records the publisher would send, in topic order, so every check here
is about the pure logic: bit-exact reproduction over many deltas, chunk and payload checks,
gaps, and falling back to a snapshot (never to wrong weights).
"""

from __future__ import annotations

from collections.abc import Iterator

import pytest
import torch

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


def _versions(n: int, settings: PublishSettings, seed: int = 0) -> Iterator[tuple[list, dict]]:
    """(records as the publisher sends them, published state) for n versions of Adam training."""
    torch.manual_seed(seed)
    model = _Tied()
    opt = torch.optim.Adam(model.parameters(), lr=1e-3)
    enc = VersionEncoder("p", settings)
    snap_offset, offset = None, 0
    for _ in range(n):
        pub = enc.encode(model.state_dict(), trainer_step=enc.next_version)
        m = pub.manifest
        chunks = split_chunks("p", m.version, pub.payload, settings.chunk_bytes)
        m.num_chunks = len(chunks)
        if m.kind == WeightKind.SNAPSHOT:
            m.latest_snapshot, snap_offset = m.version, offset
        elif snap_offset is not None:
            m.latest_snapshot = enc.next_version - 1 - (enc._since_snapshot)
            m.metadata = {SNAPSHOT_OFFSET: str(snap_offset)}
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


def test_snapshot_every_n_versions() -> None:
    kinds = [r[0][1].kind for r, _ in _versions(7, PublishSettings(snapshot_every=3, chunk_bytes=4096))]
    assert [k == WeightKind.SNAPSHOT for k in kinds] == [True, False, False, True, False, False, True]


def test_corrupted_chunk_falls_back_to_next_snapshot_never_wrong_weights() -> None:
    settings = PublishSettings(snapshot_every=4, chunk_bytes=1024)
    f = WeightFollower("p")
    published = {}
    statuses = []
    for records, state in _versions(9, settings):
        m = records[0][1]
        published[m.version] = state
        if m.version == 2:  # flip a byte of the second chunk, keep its recorded crc32
            off, c = records[2]
            records[2] = (off, WeightChunk(c.policy, c.version, c.index, c.count, bytes([c.data[0] ^ 1]) + c.data[1:], c.crc32))
        statuses += [(e.version, e.result.status) for e in _feed(f, records)]
        if f.version is not None:  # whatever it holds is exactly a published version
            assert _bits_equal(dict(f.state), published[f.version])
    assert (2, ApplyStatus.SNAPSHOT_NEEDED) in statuses and (3, ApplyStatus.SNAPSHOT_NEEDED) in statuses
    assert (4, ApplyStatus.APPLIED) in statuses  # the next snapshot
    assert f.version == 8 and f.snapshot_hint is None


def test_missing_version_points_at_a_newer_snapshot() -> None:
    settings = PublishSettings(snapshot_every=3, chunk_bytes=4096)
    all_versions = list(_versions(8, settings))
    f = WeightFollower("p")
    _feed(f, all_versions[0][0])
    assert f.version == 0
    # v1..v4 never reach this follower (it was away); v5 is a delta from v4.
    events = _feed(f, all_versions[5][0])
    assert events[0].result.status == ApplyStatus.SNAPSHOT_NEEDED and f.version == 0
    hint = f.snapshot_hint
    assert hint is not None and hint.version == 3
    assert hint.offset == all_versions[3][0][0][0]  # offset of v3's manifest: seek there and replay
    for records, _ in all_versions[3:]:
        _feed(f, records)
    assert f.version == 7 and f.snapshot_hint is None
    assert _bits_equal(dict(f.state), all_versions[7][1])


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
