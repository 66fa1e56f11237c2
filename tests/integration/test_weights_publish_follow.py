"""Weight publication and following against a real Kafka broker: a corrupted chunk and a version
that never arrives lead to snapshot fallbacks (and a snapshot request on the control topic),
never to wrong weights; a follower that keeps up never reads a snapshot, which goes beside the
stream (a delta and a snapshot of one version give the same bits); a late joiner starts from the
latest snapshot; claim-checked payloads via
the store; a second publisher of the policy fences the first.
"""

from __future__ import annotations

import time
from pathlib import Path

import pytest
import torch
from weights_helpers import bits_equal, follow_until

from astraflow.config import KafkaSettings
from astraflow.kafka.clients import RecordProducer
from astraflow.kafka.topics import Topics
from astraflow.records import WeightChunk, WeightKind
from astraflow.weights.chain import ApplyStatus, WeightChain
from astraflow.weights.follow import KafkaWeightFollower, WeightFollower
from astraflow.weights.publish import PublishSettings, WeightPublisher
from astraflow.weights.store import WeightStore
from astraflow.weights.verify import FollowLimits
from astraflow.weights.versions import latest_policy_version
from trainers.callbacks import SnapshotRequests

torch.optim.Adam([torch.zeros(1, requires_grad=True)])  # settles TORCHINDUCTOR_CACHE_DIR before the leak guard


class _Sabotage(RecordProducer):
    """Corrupts a chunk of one version and diverts another version to a decoy topic."""

    def __init__(self, kafka: KafkaSettings, corrupt: int, divert: int, decoy: str) -> None:
        super().__init__(kafka)
        self.corrupt, self.divert, self.decoy = corrupt, divert, decoy

    def send(self, topic, record, key=None, headers=None, on_delivery=None, partition=None) -> None:
        version = getattr(record, "version", None)
        if topic.endswith(".weights") and version == self.divert:
            topic, partition = self.decoy, None
        if isinstance(record, WeightChunk) and version == self.corrupt and record.index == 0:
            record = WeightChunk(record.policy, version, 0, record.count, b"\xff" + record.data[1:], record.crc32)
        super().send(topic, record, key, headers, on_delivery, partition)


class _Model(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.emb = torch.nn.Embedding(128, 32)
        self.mid = torch.nn.Linear(32, 32)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return (self.mid(self.emb(x)) @ self.emb.weight.T).logsumexp(-1).mean()


def _publish_versions(publisher: WeightPublisher, n: int, between=None) -> list:
    """Publishes n versions of a model in training; `between(version)` runs after each."""
    torch.manual_seed(0)
    model = _Model()
    opt = torch.optim.Adam(model.parameters(), lr=1e-3)
    out = []
    for step in range(n):
        m = publisher.publish(model.state_dict(), trainer_step=step)
        out.append((m, {k: v.clone() for k, v in publisher.encoder.state.items()}))
        if between is not None:
            between(m.version)
        loss = model(torch.randint(0, 128, (8,)))
        opt.zero_grad()
        loss.backward()
        opt.step()
    return out


def test_follower_falls_back_to_snapshots_and_never_holds_wrong_weights(
    kafka: KafkaSettings, experiment: str, topic_factory
) -> None:
    topics = Topics(experiment)
    requests = SnapshotRequests(kafka, topics, "policy")
    early = KafkaWeightFollower(kafka, experiment, "policy", requester="early")
    early.start()  # nothing published yet: reads from the beginning
    sabotage = _Sabotage(kafka, corrupt=2, divert=5, decoy=topic_factory("decoy"))
    publisher = WeightPublisher(kafka, experiment, "policy", PublishSettings(snapshot_every=4, chunk_bytes=4096), producer=sabotage)
    assert publisher.start() is None
    events: list = []
    asked = False

    def stuck_at_7(version: int) -> None:  # before snapshot 8 exists: the follower must ask for one
        nonlocal asked
        if version != 7:
            return
        deadline = time.monotonic() + 20
        while not any(e.version == 7 for e in events) and time.monotonic() < deadline:
            events.extend(early.poll(0.5))
        while not asked and time.monotonic() < deadline:
            asked = requests.pending()  # the stuck follower asked the trainer for a snapshot

    published = _publish_versions(publisher, 10, stuck_at_7)
    requests.close()
    assert asked
    # the stream: a snapshot only for the first version; snapshots 4 and 8 went beside it
    kinds = "".join("S" if m.kind == WeightKind.SNAPSHOT else "D" for m, _ in published)
    assert kinds == "SDDDDDDDDD" and [m.latest_snapshot for m, _ in published] == [0, 0, 0, 0, 4, 4, 4, 4, 8, 8]
    checksum = {m.version: m.state_checksum for m, _ in published}

    events += follow_until(early, 9)
    status = {e.version: e.result.status for e in events if e.result.status != ApplyStatus.STALE}
    applied = [(e.version, e.kind) for e in events if e.result.status == ApplyStatus.APPLIED]
    assert status[2] == status[3] == ApplyStatus.SNAPSHOT_NEEDED  # corrupted chunk, then no base
    assert (4, WeightKind.SNAPSHOT) in applied  # the next snapshot, loaded from beside the stream
    assert 5 not in status and status[6] == status[7] == ApplyStatus.SNAPSHOT_NEEDED  # v5 never arrived
    assert (8, WeightKind.SNAPSHOT) in applied and (9, WeightKind.DELTA) in applied
    for e in events:
        if e.result.status == ApplyStatus.APPLIED:
            assert e.result.version == e.version
        assert not e.refused or e.version == 2  # the corrupted one; read again after a snapshot: replays
    assert early.follower.chain.checksum.hex() == checksum[9]
    assert bits_equal(dict(early.follower.state), published[9][1])
    early.close()

    late = KafkaWeightFollower(kafka, experiment, "policy", request_snapshots=False)
    late.start()  # at the latest snapshot (v8) named on the policies topic
    events = follow_until(late, 9)
    late.close()
    applied = [(e.version, e.kind) for e in events if e.result.status == ApplyStatus.APPLIED]
    assert applied == [(8, WeightKind.SNAPSHOT), (9, WeightKind.DELTA)]
    assert bits_equal(dict(late.follower.state), published[9][1])

    # A follower still at v1 that resumes at v9's manifest: loads the v8 snapshot from beside the
    # stream, reads the stream again from its time (v8's delta: stale) and applies v9.
    behind = WeightFollower("policy", chain=WeightChain.from_state(published[1][1], 1))
    seeker = KafkaWeightFollower(kafka, experiment, "policy", follower=behind, request_snapshots=False)
    seeker.start(offset=int(published[9][0].metadata["offset"]))
    events = follow_until(seeker, 9)
    seeker.close()
    assert [(e.version, e.result.status) for e in events] == [
        (9, ApplyStatus.SNAPSHOT_NEEDED), (8, ApplyStatus.APPLIED), (8, ApplyStatus.STALE), (9, ApplyStatus.APPLIED)]
    assert bits_equal(dict(behind.state), published[9][1])

    again = WeightPublisher(kafka, experiment, "policy")
    assert again.start() == 9 and again.encoder.next_version == 10  # numbering continues after a restart


def test_a_follower_that_keeps_up_never_reads_a_snapshot(kafka: KafkaSettings, experiment: str) -> None:
    """Every version reaches the stream as a delta (the first as a snapshot: nothing to delta
    against), so a follower there never opens the snapshot partition; a joiner loads the
    snapshot beside the stream and both end with the same bits."""
    f = KafkaWeightFollower(kafka, experiment, "policy", request_snapshots=False)
    f.start()  # nothing published yet
    publisher = WeightPublisher(kafka, experiment, "policy", PublishSettings(snapshot_every=3, chunk_bytes=4096))
    assert publisher.start() is None
    published = _publish_versions(publisher, 8)  # snapshots 0, 3 and 6 beside the stream
    events = follow_until(f, 7)
    f.close()
    assert [(e.version, e.kind, e.result.status) for e in events] == [
        (0, WeightKind.SNAPSHOT, ApplyStatus.APPLIED), *[(v, WeightKind.DELTA, ApplyStatus.APPLIED) for v in range(1, 8)]]
    assert f._loader is None  # never read a byte of the snapshot partition
    joiner = KafkaWeightFollower(kafka, experiment, "policy", request_snapshots=False)
    joiner.start()
    events = follow_until(joiner, 7)
    joiner.close()
    assert [(e.version, e.kind) for e in events if e.result.status == ApplyStatus.APPLIED] == [
        (6, WeightKind.SNAPSHOT), (7, WeightKind.DELTA)]
    assert bits_equal(dict(joiner.follower.state), dict(f.follower.state))
    assert bits_equal(dict(f.follower.state), published[7][1])


def test_claim_checked_versions_through_the_store(kafka: KafkaSettings, experiment: str, tmp_path: Path) -> None:
    store = WeightStore(tmp_path / "store")
    settings = PublishSettings(snapshot_every=3, inband_max_bytes=2048)
    publisher = WeightPublisher(kafka, experiment, "policy", settings, store=store)
    published = _publish_versions(publisher, 4)
    assert all(m.uri and m.uri.startswith("file://") and m.num_chunks == 0 for m, _ in published)
    assert published[3][0].latest_snapshot == 3 and published[2][0].latest_snapshot_uri == published[0][0].uri
    follower = KafkaWeightFollower(kafka, experiment, "policy", request_snapshots=False,
                                   limits=FollowLimits(allowed_uri_prefixes=(store.root,)))
    follower.start(offset=0)
    events = follow_until(follower, 3)
    follower.close()
    assert [e.result.status for e in events] == [ApplyStatus.APPLIED] * 4
    assert bits_equal(dict(follower.follower.state), published[3][1])


def test_a_second_publisher_of_the_policy_fences_the_first(kafka: KafkaSettings, experiment: str) -> None:
    """Same transactional id (a restarted trainer): the old one can no longer publish, and the
    new one numbers after the last committed version."""
    from astraflow.weights.publish import PublisherFencedError

    tid = Topics(experiment).publisher_id("policy")
    old = WeightPublisher(kafka, experiment, "policy", transactional_id=tid)
    assert old.start() is None
    weights = {"w": torch.ones(8)}
    assert old.publish(weights).version == 0
    new = WeightPublisher(kafka, experiment, "policy", transactional_id=tid)
    assert new.start() == 0 and new.committed is not None and new.committed.version == 0
    with pytest.raises(PublisherFencedError):
        old.publish({"w": torch.full((8,), 2.0)})
    assert new.publish({"w": torch.full((8,), 3.0)}).version == 1
    latest = latest_policy_version(kafka, Topics(experiment), "policy")
    assert latest is not None and latest.version == 1


def _copy_like_mirrormaker(kafka: KafkaSettings, src: str, dst: str, partition: int = 0) -> list[bytes]:
    """Copies the committed records of `partition` of `src` to that of (empty) `dst` with their
    keys and timestamps, as MirrorMaker 2 does: transaction markers are not copied, so offsets
    differ. Returns the values copied (the i-th is at offset i in `dst`)."""
    from confluent_kafka import Consumer, Producer, TopicPartition

    from astraflow.kafka.clients import reader_config, watermarks

    consumer = Consumer(reader_config(kafka, f"copy-{dst}"))
    producer = Producer(kafka.client_config())
    _, high = watermarks(consumer, src, partition)
    consumer.assign([TopicPartition(src, partition, 0)])
    values: list[bytes] = []
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        msg = consumer.poll(0.5)
        if msg is not None and msg.error() is None:
            producer.produce(dst, msg.value(), msg.key(), partition=partition, timestamp=msg.timestamp()[1],
                             headers=msg.headers())  # MM2 copies headers: the signatures cross
            values.append(msg.value())
        position = consumer.position([TopicPartition(src, partition)])[0].offset
        if position >= high:
            break
    producer.flush(10)
    consumer.close()
    return values


def test_a_follower_on_a_mirrored_cluster_finds_the_snapshot_by_its_time(
        kafka: KafkaSettings, make_experiment) -> None:
    """MirrorMaker 2 keeps record timestamps but not offsets (A's transaction markers are not
    copied): the offset of the latest snapshot that A's manifests name lies past that snapshot in
    the copy. A follower there starts at the snapshot found by its manifest record's timestamp and
    holds the latest version at once, without waiting for the next snapshot."""
    a, b = make_experiment("mm-a"), make_experiment("mm-b")
    publisher = WeightPublisher(kafka, a, "policy", PublishSettings(snapshot_every=4, chunk_bytes=4096),
                                transactional_id=Topics(a).publisher_id("policy"))  # as the trainer: a marker per version
    assert publisher.start() is None
    published = _publish_versions(publisher, 7)  # snapshots 0 and 4 beside; deltas 4, 5, 6 name snapshot 4
    publisher.close()
    ta, tb = Topics(a), Topics(b)
    import shutil

    from astraflow.kafka.signing import KeyStore
    from astraflow.records import PolicyVersion
    from astraflow.serde import AvroSerde
    from astraflow.weights.versions import SNAPSHOT_OFFSET

    # Region B trusts the same keys as A (the operator ships the trust file): here, B's name gets A's folder.
    shutil.rmtree(KeyStore(b).dir, ignore_errors=True)
    shutil.copytree(KeyStore(a).dir, KeyStore(b).dir)
    assert _copy_like_mirrormaker(kafka, ta.weights("policy"), tb.weights("policy"))
    copied = [AvroSerde().loads(v) for v in _copy_like_mirrormaker(kafka, ta.weights("policy"), tb.weights("policy"), 1)]
    assert _copy_like_mirrormaker(kafka, ta.policies, tb.policies)
    latest = latest_policy_version(kafka, tb, "policy")
    assert latest is not None and latest.version == 6 and latest.latest_snapshot == 4
    # The premise: A's offset of snapshot 4's manifest lies past that manifest in the copy.
    there = next(i for i, r in enumerate(copied) if isinstance(r, PolicyVersion) and r.version == 4)
    assert int(latest.metadata[SNAPSHOT_OFFSET]) > there
    f = KafkaWeightFollower(kafka, b, "policy", request_snapshots=False, report_refusals=False)
    try:
        f.start()
        events = follow_until(f, 6, timeout_s=30)
        assert f.follower.version == 6, [(e.version, e.result.status) for e in events]
        assert events[0].version == 4 and events[0].result.status == ApplyStatus.APPLIED  # the snapshot, found by time
        assert events[0].kind == WeightKind.SNAPSHOT and not [e for e in events if e.refused]
        assert bits_equal(dict(f.follower.state), published[6][1])
    finally:
        f.close()
