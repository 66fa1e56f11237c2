"""Following published policy versions: the receiving side of `astraflow.weights.publish`.

`WeightFollower` (pure: feed it records in topic order) refuses manifests that break the rules
of `astraflow.weights.verify` (malformed, too large, a version number reused or going back, a
payload location outside the allowed prefixes), reassembles chunks within the announced size,
checks each chunk's crc32, the payload's sha256 and the resulting state checksum, decodes with
bounded decompression against the served model's layout, and applies versions to a
`WeightChain`: the stream's deltas with `feed`, a snapshot read beside the stream with
`feed_snapshot`. When it cannot advance by deltas it sets `snapshot_hint` to the newest snapshot
that helps. Whatever it refuses, it keeps the last good version. `KafkaWeightFollower` reads the
stream (partition 0 of the weights topic) with a plain assigned consumer; a snapshot (partition
1) only when it joins or is stuck: it loads the hinted one, then reads the stream again from that
snapshot's time. A follower that keeps up never reads a snapshot's bytes. It dead-letters every
refused version (with a `weights_refused_total` metric) and can ask the trainer for a fresh
snapshot over the control topic. Before a record is fed, its signature must be the trainer's
(`astraflow.kafka.signing`): an unsigned or forged one is dead-lettered and changes nothing.
Plausibility holds whatever signed it: finite weights (`astraflow.weights.transaction`), a delta
that applies to the base it names and moves at most the step its trainer declares
(`check_step`), a version that never goes back (`VersionLedger`). Every backend (torch, vLLM, a
large model's loader) gets its weights through this class, so the same checks guard each apply
path. Details: docs/weights.md and docs/training.md.
"""

from __future__ import annotations

import collections
import logging
import zlib
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

from confluent_kafka import OFFSET_BEGINNING, Consumer, KafkaError, KafkaException, Message, TopicPartition

from astraflow.config import KafkaSettings
from astraflow.errors import KafkaLayerError, SerdeError, WeightsError
from astraflow.kafka.clients import RecordProducer, consume_ready, data_messages
from astraflow.kafka.read import assigned_consumer
from astraflow.kafka.received import DeadLetterWriter, Received
from astraflow.kafka.signing import SignatureError, Verifier
from astraflow.kafka.topics import Topics
from astraflow.records import Metric, PolicyVersion, WeightChunk, WeightKind
from astraflow.serde import AvroSerde
from astraflow.weights.chain import ApplyResult, ApplyStatus, WeightChain
from astraflow.weights.delta import SparseDelta
from astraflow.weights.format import STREAM_SNAPSHOT
from astraflow.weights.layout import ModelLayout
from astraflow.weights.store import sha256_hex
from astraflow.weights.verify import (
    FollowLimits,
    VersionLedger,
    WeightRefusedError,
    check_manifest,
    check_uri,
    fetch_bounded,
)
from astraflow.weights.versions import (
    DEFAULT_MAX_STEP,
    MAX_STEP,
    SNAPSHOT_OFFSET,
    SNAPSHOT_PARTITION,
    SNAPSHOT_TS,
    STREAM_PARTITION,
    ask_trainer_for_snapshot,
    latest_policy_version,
)

log = logging.getLogger("astraflow.weights")


class PayloadError(WeightsError):
    """Raised when in-band chunks are missing, out of order or fail their crc32, or a payload
    fails its sha256 or does not produce the version its manifest announces."""

@dataclass(frozen=True)
class SnapshotHint:
    """The newest snapshot that would let a stuck follower advance, on the snapshot partition."""

    version: int  # snapshot version
    offset: int | None  # offset of its manifest on the snapshot partition, when known
    ts_ms: int | None = None  # Kafka timestamp of its manifest record (finds it on a mirrored cluster too)


class _Assembly:
    """One payload's chunks being collected, never more bytes than its manifest announced."""

    def __init__(self, m: PolicyVersion, offset: int | None) -> None:
        self.m, self.offset, self.parts, self.size = m, offset, [], 0

    def add(self, c: WeightChunk) -> str | None:
        """Take the next chunk; the problem when it is out of order, corrupt or too much."""
        m = self.m
        if c.index != len(self.parts) or c.count != m.num_chunks or zlib.crc32(c.data) != c.crc32:
            return f"chunk {c.index}/{c.count} is out of order or corrupt"
        if self.size + len(c.data) > m.payload_bytes:
            return f"its chunks hold more than the {m.payload_bytes:,} bytes its manifest announced"
        self.parts.append(c.data)
        self.size += len(c.data)
        return None

    @property
    def complete(self) -> bool:
        return len(self.parts) >= self.m.num_chunks


@dataclass(frozen=True)
class FollowEvent:
    """What happened to one announced version."""

    version: int  # the version the manifest announced
    kind: WeightKind  # SNAPSHOT or DELTA
    result: ApplyResult  # APPLIED / STALE / SNAPSHOT_NEEDED / REFUSED, and why
    offset: int | None = None  # weights-topic offset of its manifest, when read from Kafka
    partition: int = STREAM_PARTITION  # and its partition

    @property
    def refused(self) -> bool:
        """Whether the version's records were bad (not merely missing): dead-letter them."""
        return self.result.status == ApplyStatus.REFUSED or self.result.error is not None


BlobFetcher = Callable[[str, str, int], bytes]  # (uri, sha256, announced size) -> payload


class WeightFollower:
    """Pure receiver: feed records of ``<policy>.weights`` in topic order; see the module doc.

    It never holds wrong weights: a payload is applied only after every chunk crc32, the
    payload sha256 and the announced state checksum agree, and the chain itself rolls back a
    delta that fails its own checks or the model's layout. Only one payload is buffered at a
    time, never more bytes than its manifest announced (itself bounded by `limits`).
    """

    def __init__(
        self,
        policy: str,
        *,
        chain: WeightChain | None = None,
        fetch: BlobFetcher | None = None,
        limits: FollowLimits = FollowLimits(),
        layout: ModelLayout | None = None,
    ) -> None:
        self.policy = policy
        self.limits = limits
        self.chain = chain or WeightChain(layout, limits.max_state_bytes, require_finite=True)
        # claim-checked payloads: the default checks the location and reads at most the announced size
        self.fetch: BlobFetcher = fetch or (lambda uri, sha, size: fetch_bounded(uri, sha, limits, size))
        self.snapshot_hint: SnapshotHint | None = None  # set while deltas cannot advance the chain
        self.newest: PolicyVersion | None = None  # newest well-formed manifest (its snapshot fields drive hints)
        self.ledger = VersionLedger()  # versions applied: a number never means other weights
        self._pending: _Assembly | None = None  # the stream's version whose chunks are being collected
        self._beside: _Assembly | None = None  # the same for a snapshot read beside the stream

    @property
    def version(self) -> int | None:
        return self.chain.version

    @property
    def state(self) -> Mapping[str, Any]:
        """The current weights (read-only view; patched in place by later deltas)."""
        return self.chain.state

    def lend_state(self) -> dict[str, Any]:
        """The current weights for an inference engine that loads them asynchronously: not a
        copy, and later deltas never change them (`WeightChain.lend`)."""
        return self.chain.lend()

    def feed(self, record: Any, offset: int | None = None) -> list[FollowEvent]:
        """Take one record (PolicyVersion or WeightChunk; others are ignored); return the events
        of the versions it completed or gave up on."""
        if isinstance(record, PolicyVersion):
            return self._manifest(record, offset)
        if isinstance(record, WeightChunk):
            return self._chunk(record)
        return []

    def feed_snapshot(self, record: Any, resume_offset: int | None = None) -> list[FollowEvent]:
        """Take one record of the snapshot partition (read from a snapshot's manifest on); return
        the event of the snapshot once loaded, stale or refused. `resume_offset`: where the reader
        resumes the stream once it is loaded (the stream's versions up to it are then replays)."""
        if isinstance(record, PolicyVersion):
            if record.policy != self.policy:
                return []
            m, self._beside = record, None
            try:
                check_manifest(m, self.limits)
                if m.kind != WeightKind.SNAPSHOT:
                    raise WeightRefusedError(f"version {m.version} on the snapshot partition is a {m.kind}")
                if m.num_chunks == 0 and m.uri is not None:
                    check_uri(m.uri, self.limits)
                self.ledger.same_weights(m)
            except WeightRefusedError as exc:
                return [self._refuse(m, None, exc)]
            have = self.chain.version
            if have is not None and m.version <= have:
                return [FollowEvent(m.version, m.kind, ApplyResult(ApplyStatus.STALE, have, f"already at {have}"))]
            if m.num_chunks == 0:
                uri = m.uri or ""
                return [self._apply(m, resume_offset, lambda: self.fetch(uri, m.sha256, m.payload_bytes), beside=True)]
            self._beside = _Assembly(m, resume_offset)
            return []
        a = self._beside
        if not isinstance(record, WeightChunk) or a is None or record.policy != self.policy or record.version != a.m.version:
            return []
        events = self._add_chunk(a, record, beside=True)
        if events is None:
            return []
        self._beside = None
        return events

    @property
    def loading(self) -> bool:
        """Whether a snapshot read beside the stream is part-way collected."""
        return self._beside is not None

    def _refuse(self, m: PolicyVersion, offset: int | None, error: WeightsError) -> FollowEvent:
        return FollowEvent(m.version, m.kind, ApplyResult(ApplyStatus.REFUSED, self.chain.version, str(error), error),
                           offset)

    def _manifest(self, m: PolicyVersion, offset: int | None) -> list[FollowEvent]:
        if m.policy != self.policy:
            return []
        events = []
        if self._pending is not None:  # the previous version never completed: a gap
            p = self._pending
            error = PayloadError(f"version {p.m.version} is truncated: {len(p.parts)} of {p.m.num_chunks} chunks")
            events.append(self._give_up(p.m, p.offset, str(error), error))
            self._pending = None
        try:
            check_manifest(m, self.limits)
            if m.num_chunks == 0 and m.uri is not None:
                check_uri(m.uri, self.limits)
            check_step(m)
            repeated = self.ledger.check(m, offset)
        except WeightRefusedError as exc:
            return [*events, self._refuse(m, offset, exc)]
        if self.newest is None or m.version >= self.newest.version:
            self.newest = m
        have = self.chain.version
        if repeated or (have is not None and m.version <= have):
            events.append(
                FollowEvent(
                    m.version, m.kind, ApplyResult(ApplyStatus.STALE, have, f"already at {have}"), offset
                )
            )
        elif m.kind == WeightKind.DELTA and m.base_version != have:
            events.append(
                self._give_up(m, offset, f"delta {m.base_version} -> {m.version} does not apply to {have}")
            )
        elif m.num_chunks == 0:  # claim-checked (check_manifest refused one with no uri)
            uri = m.uri or ""
            events.append(self._apply(m, offset, lambda: self.fetch(uri, m.sha256, m.payload_bytes)))
        else:
            self._pending = _Assembly(m, offset)
        return events

    def _chunk(self, c: WeightChunk) -> list[FollowEvent]:
        a = self._pending
        if a is None or c.policy != self.policy or c.version != a.m.version:
            return []  # chunks of a version we skip or gave up on
        events = self._add_chunk(a, c)
        if events is None:
            return []
        self._pending = None
        return events

    def _add_chunk(self, a: _Assembly, c: WeightChunk, beside: bool = False) -> list[FollowEvent] | None:
        """Adds `c` to `a`: None while more chunks are due, else the event of `a`'s end (applied
        or given up), after which the caller lets `a` go."""
        problem = a.add(c)
        if problem is not None:
            return [self._give_up(a.m, a.offset, problem, PayloadError(problem))]
        if not a.complete:
            return None
        payload = b"".join(a.parts)
        a.parts.clear()  # the joined payload is the only copy from here on
        return [self._apply(a.m, a.offset, lambda: payload, beside=beside)]

    def _apply(self, m: PolicyVersion, offset: int | None, payload_of: Callable[[], bytes],
               beside: bool = False) -> FollowEvent:
        try:
            payload = payload_of()
            if len(payload) != m.payload_bytes:
                raise PayloadError(
                    f"payload of version {m.version} has {len(payload):,} bytes, its manifest announced "
                    f"{m.payload_bytes:,} (truncated or padded)"
                )
            if sha256_hex(payload) != m.sha256:
                raise PayloadError(f"payload of version {m.version} does not match its sha256")
            stream = SparseDelta.from_bytes(payload)  # splits and checks the frames (either kind)
            if stream.header.version != m.version or stream.trailer.checksum.hex() != m.state_checksum:
                raise PayloadError(f"payload does not produce the announced version {m.version}")
            is_snapshot = stream.header.stream == STREAM_SNAPSHOT
            if is_snapshot != (m.kind == WeightKind.SNAPSHOT):
                raise PayloadError(f"version {m.version} is announced as a {m.kind} but its payload is not")
        except WeightsError as exc:
            return self._give_up(m, offset, str(exc), exc)
        if m.kind == WeightKind.SNAPSHOT:
            result = self.chain.load_snapshot(stream.blocks)
        else:
            result = self.chain.apply_delta(m.version, stream)
        if result.status == ApplyStatus.APPLIED:
            self.snapshot_hint = None
            self.ledger.record(m, offset, beside)
            return FollowEvent(m.version, m.kind, result, offset)
        return self._give_up(m, offset, result.reason, result.error)

    def _give_up(
        self, m: PolicyVersion, offset: int | None, reason: str, error: WeightsError | None = None
    ) -> FollowEvent:
        """Record that `m` cannot be applied and point at the newest snapshot that would help."""
        have = -1 if self.chain.version is None else self.chain.version
        n = self.newest
        if n is not None and n.latest_snapshot is not None and n.latest_snapshot > have:
            self.snapshot_hint = _hint(n)
        result = ApplyResult(ApplyStatus.SNAPSHOT_NEEDED, self.chain.version, reason, error)
        return FollowEvent(m.version, m.kind, result, offset)


def check_step(m: PolicyVersion) -> None:
    """A delta moves from its base by at least 1 and at most the step its trainer declared
    (`MAX_STEP` in its signed metadata): a version number far ahead would make every honest
    version after it look old. Snapshots are how a follower catches up: no bound."""
    if m.kind != WeightKind.DELTA or m.base_version is None:
        return
    declared = _number(m.metadata.get(MAX_STEP))
    bound = declared if declared is not None and declared >= 1 else DEFAULT_MAX_STEP
    step = m.version - m.base_version
    if not 1 <= step <= bound:
        raise WeightRefusedError(f"delta {m.base_version} -> {m.version} moves {step} versions; its trainer "
                                 f"declares at most {bound} per delta")


def _number(raw: str | None) -> int | None:
    return int(raw) if raw and raw.isdigit() else None


def _hint(m: PolicyVersion) -> SnapshotHint | None:
    """Where the snapshot a manifest names as the latest is, on the snapshot partition."""
    if m.latest_snapshot is None:
        return None
    return SnapshotHint(m.latest_snapshot, _number(m.metadata.get(SNAPSHOT_OFFSET)), _number(m.metadata.get(SNAPSHOT_TS)))


class KafkaWeightFollower:
    """Follows ``<policy>.weights`` with assigned consumers (no group) and a `WeightFollower`.

    `start()` positions the reader at the newest snapshot named on the ``policies`` topic (or
    the stream's beginning); `poll()` loads a snapshot being loaded, then feeds what the stream
    has; on a hint it loads that snapshot (from the store when claim-checked) and reads the
    stream again from its time; when stuck with no snapshot to fall back to, it asks the trainer
    for one (once per version).
    Every refused version (and every record that does not decode) is dead-lettered with its
    reason, and counted in `refused` and the `weights_refused_total` metric (component
    `requester`), unless `report_refusals` is off.
    """

    def __init__(
        self,
        kafka: KafkaSettings,
        experiment: str,
        policy: str,
        *,
        follower: WeightFollower | None = None,
        request_snapshots: bool = True,
        requester: str = "weight-follower",
        serde: AvroSerde | None = None,
        limits: FollowLimits = FollowLimits(),
        layout: ModelLayout | None = None,
        report_refusals: bool = True,
    ) -> None:
        self.kafka, self.topics, self.policy = kafka, Topics(experiment), policy
        self.follower = follower or WeightFollower(policy, limits=limits, layout=layout)
        self.serde = serde or AvroSerde.for_kafka(kafka)
        self.topic = self.topics.weights(policy)
        self._consumer = assigned_consumer(kafka, self.serde)
        self._acted: SnapshotHint | None = None
        producer = RecordProducer(kafka) if request_snapshots or report_refusals else None
        self._requests = producer if request_snapshots else None
        self._dlq = DeadLetterWriter(producer, self.topics.dlq, requester) if report_refusals and producer else None
        # recent manifests by (partition, offset), for the DLQ
        self._manifests: collections.OrderedDict[tuple[int, int], Message] = collections.OrderedDict()
        self._loader: Consumer | None = None  # reads the snapshot partition while a snapshot loads
        self._loading: SnapshotHint | None = None
        self._resume: int | None = None  # where the stream resumes after that snapshot
        self._requested_for = -1  # newest manifest version we already asked a snapshot for
        self.requester = requester
        self.refused = 0  # versions and records refused so far
        self.verifier = Verifier(experiment)  # only the trainer's signed records are fed
        self._stream = f"{policy}.weights"

    def start(self, offset: int | None = None, timeout_s: float = 10.0) -> None:
        """Read the stream from `offset`; else load the latest snapshot named on ``policies`` from
        the snapshot partition and read the stream from its time; else from the beginning. Both
        partitions are assigned here, so the client fetches them while the caller does other work;
        `poll` loads the snapshot first."""
        if offset is None:
            latest = latest_policy_version(self.kafka, self.topics, self.policy, timeout_s, self.serde)
            hint = _hint(latest) if latest is not None else None
            resume = self._begin_load(hint, timeout_s) if hint is not None else None
            offset = OFFSET_BEGINNING if resume is None else resume
        self._consumer.assign([TopicPartition(self.topic, STREAM_PARTITION, offset)])

    def _locate(self, partition: int, offset: int | None, ts_ms: int | None, timeout_s: float = 10.0) -> int | None:
        """The first offset of `partition` at or after `ts_ms` when given (right on a cluster fed by
        MirrorMaker 2 too, whose offsets differ from the publisher's), else `offset`."""
        if ts_ms is not None:
            try:
                got = self._consumer.offsets_for_times([TopicPartition(self.topic, partition, ts_ms)], timeout=timeout_s)
            except KafkaException as exc:
                log.warning("cannot look up %d ms on %s [%d] (%s)", ts_ms, self.topic, partition, exc)
            else:
                if got and got[0].offset >= 0:
                    return got[0].offset
        return offset

    def _begin_load(self, hint: SnapshotHint, timeout_s: float = 10.0) -> int | None:
        """Start reading the hinted snapshot from the snapshot partition; returns where the stream
        should resume (its first record at or after the snapshot's time), or None if unknown."""
        at = self._locate(SNAPSHOT_PARTITION, hint.offset, hint.ts_ms, timeout_s)
        if at is None:
            log.warning("snapshot %d of %s: no location on %s [%d]", hint.version, self.policy, self.topic,
                        SNAPSHOT_PARTITION)
            return None
        if self._loader is None:
            self._loader = assigned_consumer(self.kafka, self.serde)
        self._loader.assign([TopicPartition(self.topic, SNAPSHOT_PARTITION, at)])
        self._loading = hint
        self._resume = self._locate(STREAM_PARTITION, None, hint.ts_ms, timeout_s)
        return self._resume

    def _load(self, events: list[FollowEvent], timeout_s: float, max_records: int) -> None:
        """Feed what the snapshot partition has; ends the load once the snapshot is resolved (or
        the partition ends without one)."""
        assert self._loader is not None and self._loading is not None
        ended = False
        for msg in consume_ready(self._loader, max_records, timeout_s):
            err = msg.error()
            if err is not None:
                ended = ended or err.code() == KafkaError._PARTITION_EOF
                if err.fatal():
                    raise KafkaLayerError(f"fatal Kafka error on {self.topic} [{SNAPSHOT_PARTITION}]: {err.str()}")
                continue
            try:
                self.verifier.check(self._stream, msg.key(), msg.value(), msg.headers())
                record = self.serde.loads(msg.value())
            except (SerdeError, SignatureError) as exc:
                self._report(msg, None, exc)
                continue
            if isinstance(record, PolicyVersion):
                self._manifests[(SNAPSHOT_PARTITION, msg.offset())] = msg
            got = self.follower.feed_snapshot(record, self._resume)
            for e in got:
                events.append(FollowEvent(e.version, e.kind, e.result, msg.offset(), SNAPSHOT_PARTITION)
                              if e.refused else e)
            if got:
                ended = True
                break
        if ended and not self.follower.loading:
            if not any(e.kind == WeightKind.SNAPSHOT for e in events):
                log.warning("no snapshot of %s found on %s [%d] at the hinted place", self.policy, self.topic,
                            SNAPSHOT_PARTITION)
            self._loader.unassign()
            self._loading = None

    def poll(self, timeout_s: float = 1.0, max_records: int = 64) -> list[FollowEvent]:
        """Read what is available (waiting up to `timeout_s`) and return the version events: a
        snapshot being loaded first, then the stream."""
        events: list[FollowEvent] = []
        if self._loading is not None:
            self._load(events, timeout_s, max_records)
            timeout_s = 0.0
        if self._loading is None:
            self._poll_stream(events, timeout_s, max_records)
        for e in events:
            if e.refused:
                log.error("version %d of %s refused: %s", e.version, self.policy, e.result.reason)
                msg = self._manifests.get((e.partition, e.offset)) if e.offset is not None else None
                self._report(msg, e.version, e.result.error or e.result.reason)
        self._maybe_request(events)
        return events

    def _poll_stream(self, events: list[FollowEvent], timeout_s: float, max_records: int) -> None:
        for msg in data_messages(consume_ready(self._consumer, max_records, timeout_s), self.topic):
            try:
                self.verifier.check(self._stream, msg.key(), msg.value(), msg.headers())
                record = self.serde.loads(msg.value())
            except (SerdeError, SignatureError) as exc:  # not fed: nothing it says changes anything
                self._report(msg, None, exc)
                continue
            if isinstance(record, PolicyVersion):
                self._manifests[(STREAM_PARTITION, msg.offset())] = msg
                while len(self._manifests) > 256:
                    self._manifests.popitem(last=False)
            events += self.follower.feed(record, msg.offset())
            if self._on_hint(msg.offset()):
                break  # the rest of the stream waits for the snapshot

    def _report(self, msg: Message | None, version: int | None, error: BaseException | str) -> None:
        """Dead-letter a refused record (when its message is at hand) and publish the count."""
        self.refused += 1
        if self._dlq is None:
            return
        if msg is not None:
            self._dlq.send(Received.of(msg), error)
        labels = {"policy": self.policy, "version": "" if version is None else str(version),
                  "reason": str(error)[:200]}
        metric = Metric("weights_refused_total", float(self.refused), self.requester, self.requester, labels)
        self._dlq.producer.send(self.topics.metrics, metric, key=self.requester)
        self._dlq.producer.poll(0)

    def _on_hint(self, at: int) -> bool:
        """Load a newly hinted snapshot from the snapshot partition, and read the stream again
        from its time (or from after `at`): True if the stream was moved."""
        hint = self.follower.snapshot_hint
        if hint is None or hint == self._acted:
            return False
        self._acted = hint
        resume = self._begin_load(hint)
        if self._loading is None:
            return False
        self._consumer.seek(TopicPartition(self.topic, STREAM_PARTITION, at + 1 if resume is None else resume))
        return True

    def _maybe_request(self, events: list[FollowEvent]) -> None:
        stuck = [e for e in events if e.result.status == ApplyStatus.SNAPSHOT_NEEDED]
        if not stuck or self._requests is None or self.follower.snapshot_hint is not None:
            return
        newest = max(e.version for e in stuck)
        if newest > self._requested_for:
            self._requested_for = newest
            reason = stuck[-1].result.reason[:200]
            ask_trainer_for_snapshot(self._requests, self.topics, self.policy, self.requester, reason)

    def close(self) -> None:
        self._consumer.close()
        if self._loader is not None:
            self._loader.close()
        for producer in {id(p): p for p in (self._requests, self._dlq and self._dlq.producer) if p}.values():
            producer.flush()



__all__ = ["FollowEvent", "KafkaWeightFollower", "SnapshotHint", "WeightFollower"]
