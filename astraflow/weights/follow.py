"""Following published policy versions: the receiving side of `astraflow.weights.publish`.

`WeightFollower` (pure: feed it records in topic order) refuses manifests that break the rules
of `astraflow.weights.verify` (malformed, too large, a version number reused or going back, a
payload location outside the allowed prefixes), reassembles chunks within the announced size,
checks each chunk's crc32, the payload's sha256 and the resulting state checksum, decodes with
bounded decompression against the served model's layout, and applies versions to a
`WeightChain`; when it cannot advance by deltas it sets `snapshot_hint` to the newest snapshot
that helps. Whatever it refuses, it keeps the last good version. `KafkaWeightFollower` reads the
weights topic with a plain assigned consumer, dead-letters every refused version (with a
`weights_refused_total` metric), acts on hints (seek back to an in-band snapshot or fetch it
from the store) and can ask the trainer for a fresh snapshot over the control topic. Details:
docs/weights.md and docs/training.md.
"""

from __future__ import annotations

import collections
import logging
import zlib
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

from confluent_kafka import OFFSET_BEGINNING, KafkaException, Message, TopicPartition

from astraflow.config import KafkaSettings
from astraflow.errors import SerdeError, WeightsError
from astraflow.kafka.clients import RecordProducer, consume_ready, data_messages
from astraflow.kafka.read import assigned_consumer
from astraflow.kafka.received import DeadLetterWriter, Received
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
    SNAPSHOT_OFFSET,
    SNAPSHOT_TS,
    ask_trainer_for_snapshot,
    latest_policy_version,
)

log = logging.getLogger("astraflow.weights")


class PayloadError(WeightsError):
    """Raised when in-band chunks are missing, out of order or fail their crc32, or a payload
    fails its sha256 or does not produce the version its manifest announces."""

@dataclass(frozen=True)
class SnapshotHint:
    """The newest snapshot that would let a stuck follower advance."""

    version: int  # snapshot version
    uri: str | None  # where the store holds it, when claim-checked
    offset: int | None  # offset of its manifest on the weights topic, when known
    manifest: PolicyVersion | None = None  # its own manifest, when seen (its sha256 verifies a fetch)
    ts_ms: int | None = None  # Kafka timestamp of its manifest record (finds it on a mirrored cluster too)


@dataclass(frozen=True)
class FollowEvent:
    """What happened to one announced version."""

    version: int  # the version the manifest announced
    kind: WeightKind  # SNAPSHOT or DELTA
    result: ApplyResult  # APPLIED / STALE / SNAPSHOT_NEEDED / REFUSED, and why
    offset: int | None = None  # weights-topic offset of its manifest, when read from Kafka

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
        self.chain = chain or WeightChain(layout, limits.max_state_bytes)
        # claim-checked payloads: the default checks the location and reads at most the announced size
        self.fetch: BlobFetcher = fetch or (lambda uri, sha, size: fetch_bounded(uri, sha, limits, size))
        self.snapshot_hint: SnapshotHint | None = None  # set while deltas cannot advance the chain
        self.newest: PolicyVersion | None = None  # newest well-formed manifest (its snapshot fields drive hints)
        self.ledger = VersionLedger()  # versions applied: a number never means other weights
        self._snapshots: collections.OrderedDict[int, PolicyVersion] = collections.OrderedDict()  # recent ones
        self._pending: PolicyVersion | None = None  # manifest whose chunks are being collected
        self._pending_offset: int | None = None
        self._parts: list[bytes] = []
        self._pending_bytes = 0

    @property
    def version(self) -> int | None:
        return self.chain.version

    @property
    def state(self) -> Mapping[str, Any]:
        """The current weights (read-only view; patched in place by later deltas)."""
        return self.chain.state

    def state_copy(self) -> dict[str, Any]:
        """A copy of the current weights that later deltas will not touch (hand this to an
        inference engine that applies it asynchronously)."""
        return {k: v.clone() if hasattr(v, "clone") else v.copy() for k, v in self.chain.state.items()}

    def feed(self, record: Any, offset: int | None = None) -> list[FollowEvent]:
        """Take one record (PolicyVersion or WeightChunk; others are ignored); return the events
        of the versions it completed or gave up on."""
        if isinstance(record, PolicyVersion):
            return self._manifest(record, offset)
        if isinstance(record, WeightChunk):
            return self._chunk(record)
        return []

    def load_hinted(self, hint: SnapshotHint) -> list[FollowEvent]:
        """Fetch and load a claim-checked snapshot named by a hint (verified by its own manifest)."""
        if hint.uri is None:
            raise WeightsError(
                "this snapshot is in-band: seek the weights topic to the hint's offset instead"
            )
        m = hint.manifest
        if m is None or m.uri != hint.uri or m.version != hint.version:
            error = WeightRefusedError(
                f"snapshot {hint.version} at {hint.uri[:200]} has no manifest here to verify it against"
            )
            return [FollowEvent(hint.version, WeightKind.SNAPSHOT,
                                ApplyResult(ApplyStatus.SNAPSHOT_NEEDED, self.chain.version, str(error), error))]
        return [self._apply(m, hint.offset, lambda: self.fetch(hint.uri or "", m.sha256, m.payload_bytes))]

    def _refuse(self, m: PolicyVersion, offset: int | None, error: WeightsError) -> FollowEvent:
        return FollowEvent(m.version, m.kind, ApplyResult(ApplyStatus.REFUSED, self.chain.version, str(error), error),
                           offset)

    def _manifest(self, m: PolicyVersion, offset: int | None) -> list[FollowEvent]:
        if m.policy != self.policy:
            return []
        events = []
        if self._pending is not None:  # the previous version never completed: a gap
            p = self._pending
            error = PayloadError(f"version {p.version} is truncated: {len(self._parts)} of {p.num_chunks} chunks")
            events.append(self._give_up(p, self._pending_offset, str(error), error))
            self._pending, self._parts = None, []
        try:
            check_manifest(m, self.limits)
            if m.num_chunks == 0 and m.uri is not None:
                check_uri(m.uri, self.limits)
            repeated = self.ledger.check(m, offset)
        except WeightRefusedError as exc:
            return [*events, self._refuse(m, offset, exc)]
        if self.newest is None or m.version >= self.newest.version:
            self.newest = m
        if m.kind == WeightKind.SNAPSHOT:
            self._snapshots[m.version] = m
            while len(self._snapshots) > 64:
                self._snapshots.popitem(last=False)
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
            self._pending, self._pending_offset, self._parts, self._pending_bytes = m, offset, [], 0
        return events

    def _chunk(self, c: WeightChunk) -> list[FollowEvent]:
        m = self._pending
        if m is None or c.policy != self.policy or c.version != m.version:
            return []  # chunks of a version we skip or gave up on
        problem = None
        if c.index != len(self._parts) or c.count != m.num_chunks or zlib.crc32(c.data) != c.crc32:
            problem = f"chunk {c.index}/{c.count} is out of order or corrupt"
        elif self._pending_bytes + len(c.data) > m.payload_bytes:
            problem = f"its chunks hold more than the {m.payload_bytes:,} bytes its manifest announced"
        if problem is not None:
            self._pending, self._parts = None, []
            return [self._give_up(m, self._pending_offset, problem, PayloadError(problem))]
        self._parts.append(c.data)
        self._pending_bytes += len(c.data)
        if len(self._parts) < m.num_chunks:
            return []
        payload = b"".join(self._parts)
        self._pending, self._parts = None, []
        return [self._apply(m, self._pending_offset, lambda: payload)]

    def _apply(self, m: PolicyVersion, offset: int | None, payload_of: Callable[[], bytes]) -> FollowEvent:
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
            self.ledger.record(m, offset)
            return FollowEvent(m.version, m.kind, result, offset)
        return self._give_up(m, offset, result.reason, result.error)

    def _give_up(
        self, m: PolicyVersion, offset: int | None, reason: str, error: WeightsError | None = None
    ) -> FollowEvent:
        """Record that `m` cannot be applied and point at the newest snapshot that would help."""
        have = -1 if self.chain.version is None else self.chain.version
        n = self.newest
        if n is not None and n.latest_snapshot is not None and n.latest_snapshot > have:
            self.snapshot_hint = SnapshotHint(
                n.latest_snapshot,
                n.latest_snapshot_uri,
                _number(n.metadata.get(SNAPSHOT_OFFSET)),
                self._snapshots.get(n.latest_snapshot),
                _number(n.metadata.get(SNAPSHOT_TS)),
            )
        result = ApplyResult(ApplyStatus.SNAPSHOT_NEEDED, self.chain.version, reason, error)
        return FollowEvent(m.version, m.kind, result, offset)


def _number(raw: str | None) -> int | None:
    return int(raw) if raw and raw.isdigit() else None


class KafkaWeightFollower:
    """Follows ``<policy>.weights`` with an assigned consumer (no group) and a `WeightFollower`.

    `start()` positions the reader at the newest snapshot named on the ``policies`` topic (or
    the beginning); `poll()` feeds what arrives, seeks back to or fetches the hinted snapshot,
    and, when stuck with no snapshot to fall back to, asks the trainer for one (once per version).
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
        self.serde = serde or AvroSerde()
        self.topic = self.topics.weights(policy)
        self._consumer = assigned_consumer(kafka, self.serde)
        self._acted: SnapshotHint | None = None
        producer = RecordProducer(kafka) if request_snapshots or report_refusals else None
        self._requests = producer if request_snapshots else None
        self._dlq = DeadLetterWriter(producer, self.topics.dlq, requester) if report_refusals and producer else None
        self._manifests: collections.OrderedDict[int, Message] = collections.OrderedDict()  # recent, for the DLQ
        self._requested_for = -1  # newest manifest version we already asked a snapshot for
        self.requester = requester
        self.refused = 0  # versions and records refused so far

    def start(self, offset: int | None = None, timeout_s: float = 10.0) -> None:
        """Start reading at `offset`, else at the latest snapshot's manifest, else the beginning."""
        if offset is None:
            latest = latest_policy_version(self.kafka, self.topics, self.policy, timeout_s, self.serde)
            meta = latest.metadata if latest is not None else {}
            found = self._locate(_number(meta.get(SNAPSHOT_OFFSET)), _number(meta.get(SNAPSHOT_TS)), timeout_s)
            offset = OFFSET_BEGINNING if found is None else found
        self._consumer.assign([TopicPartition(self.topic, 0, offset)])

    def _locate(self, offset: int | None, ts_ms: int | None, timeout_s: float = 10.0) -> int | None:
        """Offset of a snapshot's manifest on the cluster read: the first record at or after its
        Kafka timestamp when the manifest names one (right on a cluster fed by MirrorMaker 2, whose
        offsets differ from the publisher's), else the publisher's offset."""
        if ts_ms is not None:
            try:
                got = self._consumer.offsets_for_times([TopicPartition(self.topic, 0, ts_ms)], timeout=timeout_s)
            except KafkaException as exc:
                log.warning("cannot look up the snapshot at %d ms on %s (%s); using its offset", ts_ms, self.topic, exc)
            else:
                if got and got[0].offset >= 0:
                    return got[0].offset
        return offset

    def poll(self, timeout_s: float = 1.0, max_records: int = 64) -> list[FollowEvent]:
        """Read what is available (waiting up to `timeout_s`) and return the version events."""
        events: list[FollowEvent] = []
        for msg in data_messages(consume_ready(self._consumer, max_records, timeout_s), self.topic):
            try:
                record = self.serde.loads(msg.value())
            except SerdeError as exc:  # the version it belongs to fails its checks as well
                self._report(msg, None, exc)
                continue
            if isinstance(record, PolicyVersion):
                self._manifests[msg.offset()] = msg
                while len(self._manifests) > 256:
                    self._manifests.popitem(last=False)
            events += self.follower.feed(record, msg.offset())
            if self._on_hint(events, msg.offset()):
                break  # we seeked: the rest of this batch is stale
        for e in events:
            if e.refused:
                log.error("version %d of %s refused: %s", e.version, self.policy, e.result.reason)
                self._report(self._manifests.get(e.offset) if e.offset is not None else None, e.version,
                             e.result.error or e.result.reason)
        self._maybe_request(events)
        return events

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

    def _on_hint(self, events: list[FollowEvent], at: int) -> bool:
        hint = self.follower.snapshot_hint
        if hint is None or hint == self._acted:
            return False
        self._acted = hint
        target = self._locate(hint.offset, hint.ts_ms)
        if target is not None and target < at:  # replays the snapshot and every delta after it
            self._consumer.seek(TopicPartition(self.topic, 0, target))
            return True
        if hint.uri is not None:
            events += self.follower.load_hinted(hint)
        return False

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
        for producer in {id(p): p for p in (self._requests, self._dlq and self._dlq.producer) if p}.values():
            producer.flush()



__all__ = ["FollowEvent", "KafkaWeightFollower", "SnapshotHint", "WeightFollower"]
