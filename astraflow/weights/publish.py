"""Publishing policy versions on Kafka (the receiving side is in `astraflow.weights.follow`).

Trainer side: `VersionEncoder` (pure, `astraflow.weights.encoder`, re-exported here) turns
successive state dicts into payloads in the published dtype, deltas or snapshots, and refuses
weights that are not finite (`NonFiniteWeightsError`). `WeightPublisher` sends each version to ``<policy>.weights`` (key = policy): the PolicyVersion
manifest, then its WeightChunks (in-band), or only the manifest with the URI and sha256 of a
blob that it wrote to the `WeightStore` first (claim-check). Partition 0 is the stream, every
version in order; a snapshot (every `snapshot_every` versions, on request, and a publisher's
first version) goes to partition 1 first, beside its version's delta in the stream, so that
followers that are current never fetch it (`astraflow.weights.versions.SNAPSHOT_PARTITION`). Once those are acknowledged, the
manifest goes to the compacted ``policies`` topic, which therefore always names the latest
version. With a `transactional_id` (what the trainer uses) all of this is one Kafka
transaction: readers (read_committed) see a version whole or not at all, a publisher killed
mid-version leaves nothing visible, and a second publisher with the same id fences the first.
A broker outage only delays a publication: the publisher waits for Kafka, and retries the same
version (same number, same weights) when the transaction had to be aborted.

The receiving side is `astraflow.weights.follow`; what both sides read of the topics (the
latest version, the last number used, the snapshot request) is `astraflow.weights.versions`.
Details: docs/training.md.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Mapping, Sequence
from dataclasses import replace
from typing import Any

from confluent_kafka import KafkaError, KafkaException

from astraflow.config import KafkaSettings
from astraflow.errors import KafkaLayerError, ProduceError, WeightsError
from astraflow.kafka.clients import RecordProducer
from astraflow.kafka.signing import Signer
from astraflow.kafka.topics import Topics
from astraflow.records import PolicyVersion, WeightKind
from astraflow.weights.encoder import (
    NonFiniteWeightsError,
    Publication,
    PublishSettings,
    VersionEncoder,
    check_finite,
    published_state,
    split_chunks,
)
from astraflow.weights.store import WeightStore
from astraflow.weights.versions import (
    MAX_STEP,
    OFFSET,
    SNAPSHOT_OFFSET,
    SNAPSHOT_PARTITION,
    SNAPSHOT_TS,
    STREAM_PARTITION,
    last_published_version,
    latest_policy_version,
)

log = logging.getLogger(__name__)


class PublisherFencedError(WeightsError):
    """Raised when another publisher with the same transactional id (another trainer of this
    policy) took over: this one must stop publishing."""


_DENIED = (
    KafkaError.TRANSACTIONAL_ID_AUTHORIZATION_FAILED,
    KafkaError.TOPIC_AUTHORIZATION_FAILED,
    KafkaError.CLUSTER_AUTHORIZATION_FAILED,
)
TRANSACTION_TIMEOUT_MS = 15 * 60 * 1000  # the broker's default transaction.max.timeout.ms


def _log_kafka_error(err: KafkaError) -> None:
    # An error callback keeps librdkafka's error events out of delivery callbacks (without one,
    # a fatal error such as fencing is raised inside them); failures still reach `publish`
    # through delivery reports and the transaction calls.
    log.log(logging.ERROR if err.fatal() else logging.WARNING, "weights producer: %s", err.str())


def publisher_producer_config(transactional_id: str | None) -> dict[str, Any]:
    """Producer settings of a weight publisher (on top of the shared ones). No Kafka compression:
    the chunks are the weight codec's zstd frames already, and compressing them again would cost
    the trainer (and every follower's decompression) CPU for nothing."""
    if transactional_id is None:  # wait for Kafka through any outage
        return {"message.timeout.ms": 0, "compression.type": "none", "error_cb": _log_kafka_error}
    # Transactional: records wait for Kafka up to the transaction timeout (librdkafka caps
    # message.timeout.ms there); a transaction aborted by then is retried whole.
    return {"transactional.id": transactional_id, "transaction.timeout.ms": TRANSACTION_TIMEOUT_MS,
            "compression.type": "none", "error_cb": _log_kafka_error}


class WeightPublisher:
    """Sends versions to ``<policy>.weights`` and the latest to ``policies``; see the module doc."""

    def __init__(
        self,
        kafka: KafkaSettings,
        experiment: str,
        policy: str,
        settings: PublishSettings = PublishSettings(),
        *,
        store: WeightStore | None = None,
        producer: RecordProducer | None = None,
        transactional_id: str | None = None,
        on_progress: Callable[[str], None] | None = None,
    ) -> None:
        self.kafka, self.topics, self.policy, self.settings, self.store = (
            kafka,
            Topics(experiment),
            policy,
            settings,
            store,
        )
        # A given producer must have been built with publisher_producer_config(transactional_id).
        self.producer = producer or RecordProducer(kafka, **publisher_producer_config(transactional_id))
        self.transactional = transactional_id is not None
        self.producer_id = transactional_id
        self.on_progress = on_progress  # called with "chunks_sent" mid-publication (crash tests)
        self.encoder = VersionEncoder(policy, settings)
        self.latest: PolicyVersion | None = None  # last version published by this process
        self.committed: PolicyVersion | None = None  # latest version on `policies` when `start` ran
        self._snapshot: tuple[int, str | None, int, int] | None = None  # (version, uri, weights-topic offset, timestamp ms)
        self._snapshot_requested = False
        self._lineage: list[Any] = []  # records sent with the version being published (lineage topic)
        self._txn_ready = False
        self.signer = Signer(experiment, "trainer")  # every record it writes is signed (astraflow.kafka.signing)

    def _signed(self, topic: str, stream: str, record: Any, key: str, **kw: Any) -> None:
        # Encoded here to sign it, and again by `send` (a copy of the bytes: cheap next to the
        # network; `send` stays the one way records leave, for producers that wrap it).
        value = self.producer.serde.dumps(record)
        self.producer.send(topic, record, key, self.signer.headers(stream, key, value), **kw)

    def start(self, timeout_s: float = 10.0) -> int | None:
        """Continue the numbering after any version already on the topics; returns that version.

        Transactional: first fences any earlier publisher with the same id and aborts its open
        transaction (a version it left half-sent disappears), so what is read next is final.
        Waits for Kafka as long as it takes: a version number is never guessed.
        The first publication of this process is always a snapshot (no delta base in memory).
        """
        waited = 0.0
        while True:
            try:
                if self.transactional and not self._txn_ready:
                    self.producer.raw.init_transactions(timeout_s)
                    self._txn_ready = True
                self.committed = latest_policy_version(self.kafka, self.topics, self.policy, timeout_s, strict=True)
                last = last_published_version(self.kafka, self.topics, self.policy, timeout_s, latest=self.committed)
                break
            except (KafkaException, KafkaLayerError) as exc:
                err = exc.args[0] if isinstance(exc, KafkaException) else None
                if err is not None and err.code() in _DENIED:
                    raise KafkaLayerError(
                        f"Kafka denies the publisher of {self.policy} ({err.str()}): its principal needs WRITE and "
                        f"DESCRIBE on the transactional id {self.producer_id!r} and on the weights and policies topics"
                    ) from exc
                if err is not None and err.fatal():
                    raise PublisherFencedError(f"cannot start publishing {self.policy}: {exc}") from exc
                waited += timeout_s
                log.warning("waiting for Kafka to read the versions of %s (%.0f s): %s", self.policy, waited, exc)
        self._check_partitions(timeout_s)
        self.encoder.next_version = 0 if last is None else last + 1
        return last

    def _check_partitions(self, timeout_s: float) -> None:
        """The weights topic needs its snapshot partition (topics made before it had one)."""
        topic = self.topics.weights(self.policy)
        found = self.producer.raw.list_topics(topic, timeout_s).topics.get(topic)
        if found is not None and found.error is None and len(found.partitions) <= SNAPSHOT_PARTITION:
            raise WeightsError(
                f"{topic} has {len(found.partitions)} partition(s); snapshots go to partition {SNAPSHOT_PARTITION}: "
                f"add it with kafka-topics.sh --alter --topic {topic} --partitions {SNAPSHOT_PARTITION + 1}"
            )

    def request_snapshot(self) -> None:
        """Make the next publication a full snapshot."""
        self._snapshot_requested = True

    @property
    def version(self) -> int | None:
        """Version of the last publication of this process."""
        return None if self.latest is None else self.latest.version

    def publish(
        self,
        state: Mapping[str, Any],
        *,
        trainer_step: int = 0,
        trained_samples: int = 0,
        snapshot: bool = False,
        version: int | None = None,
        lineage: Sequence[Any] = (),
        prepared: bool = False,
    ) -> PolicyVersion:
        """Encode `state` as the next version (or as `version`, e.g. one a checkpoint promised)
        and send it, with `lineage` records (e.g. `TrainedSamples`) to the lineage topic in the same
        transaction; returns its manifest once acknowledged (committed). `prepared`: see
        `VersionEncoder.encode` (weights already cast and checked, not copied again)."""
        if version is not None:
            self.encoder.next_version = version
        pub = self.encoder.encode(
            state,
            trainer_step=trainer_step,
            trained_samples=trained_samples,
            snapshot=snapshot or self._snapshot_requested,
            prepared=prepared,
        )
        self._lineage = list(lineage)
        try:
            manifest = self._send_transaction(pub) if self.transactional else self._send(pub)
        except BaseException:
            self.encoder.reset()  # receivers may lack this version: never delta against it
            raise
        self._snapshot_requested = False
        self.latest = manifest
        return manifest

    def _send_transaction(self, pub: Publication, attempts: int = 5) -> PolicyVersion:
        raw = self.producer.raw
        for attempt in range(1, attempts + 1):
            try:
                raw.begin_transaction()
                latest = self._send(pub)
                while True:
                    try:
                        raw.commit_transaction(60.0)
                        return latest
                    except KafkaException as exc:
                        if not exc.args[0].retriable():
                            raise
                        log.warning("waiting for Kafka to commit version %d: %s", pub.manifest.version, exc)
            except (KafkaException, ProduceError) as exc:
                log.warning("version %d: transaction failed (%s); retrying it whole", pub.manifest.version, exc)
                try:
                    if isinstance(exc, KafkaException) and exc.args[0].fatal():
                        raise exc
                    raw.abort_transaction(60.0)
                except KafkaException as fatal:
                    if fatal.args[0].fatal():
                        raise PublisherFencedError(
                            f"publishing {self.policy} v{pub.manifest.version} failed for good ({fatal.args[0].str()}); "
                            "another trainer of this policy took over, or the broker fenced this one: restart it"
                        ) from exc
                    log.warning("abort failed (%s)", fatal)
                if attempt == attempts:
                    raise KafkaLayerError(f"could not publish version {pub.manifest.version} in {attempts} attempts: {exc}") from exc
        raise AssertionError("unreachable")

    def _flush(self) -> None:
        waited = 0.0
        while self._flush_once():
            waited += 10.0
            log.warning("waiting for Kafka to acknowledge weights of %s (%.0f s)", self.policy, waited)
        self.producer.flush(0)  # raises ProduceError on records Kafka rejected

    def _flush_once(self) -> int:
        try:
            return self.producer.raw.flush(10.0)
        except SystemError as exc:
            # confluent-kafka raises a fatal error (fencing) while a delivery callback runs, which
            # surfaces as SystemError with the KafkaException as its cause.
            if isinstance(exc.__cause__, KafkaException):
                raise exc.__cause__ from None
            raise ProduceError(f"the producer failed while flushing ({exc}); the transaction is aborted") from exc

    def _records(self, m: PolicyVersion, payload: bytes, partition: int,
                 uri: str | None = None) -> tuple[list[int], list[int]]:
        """Queue `m` and its payload (chunks, or a blob in the store) on `partition` of the weights
        topic and wait for them; returns the manifest's (offset, timestamp ms), as lists filled on
        delivery. `uri`: the payload is in the store already."""
        if uri is None and self.store is not None and len(payload) > self.settings.inband_max_bytes:
            kind = "snapshot" if m.kind == WeightKind.SNAPSHOT else "delta"
            uri = self.store.put(f"{self.policy}/v{m.version:010d}.{kind}", payload)  # blob before record
        m.uri = uri
        chunks = [] if uri is not None else split_chunks(self.policy, m.version, payload, self.settings.chunk_bytes)
        m.num_chunks = len(chunks)
        offsets: list[int] = []
        stamps: list[int] = []
        topic = self.topics.weights(self.policy)

        def delivered(err: Any, msg: Any) -> None:
            if err is None:
                offsets.append(msg.offset())
                stamps.append(msg.timestamp()[1])

        stream = f"{self.policy}.weights"
        self._signed(topic, stream, m, self.policy, on_delivery=delivered, partition=partition)
        for chunk in chunks:
            self._signed(topic, stream, chunk, self.policy, partition=partition)
        self._flush()
        if not offsets:
            raise KafkaLayerError(f"no delivery report for version {m.version} on {topic} [{partition}]")
        return offsets, stamps

    def _send(self, pub: Publication) -> PolicyVersion:
        """The snapshot beside the stream first (when there is one), so that a follower that loads
        it finds every later stream record at or after its timestamp; then the stream's record
        naming the latest snapshot, its lineage, and the manifest on `policies`."""
        m = pub.manifest
        m.metadata = {**m.metadata, MAX_STEP: str(self.settings.max_version_step)}
        if pub.beside is not None:
            snap, payload = pub.beside
            snap.latest_snapshot = snap.version
            offsets, stamps = self._records(snap, payload, SNAPSHOT_PARTITION)
            self._snapshot = (snap.version, snap.uri, offsets[0], stamps[0])
        reuse = self._snapshot[1] if m.kind == WeightKind.SNAPSHOT and self._snapshot and self._snapshot[0] == m.version else None
        if self._snapshot is not None:
            m.latest_snapshot, m.latest_snapshot_uri = self._snapshot[0], self._snapshot[1]
            m.metadata = {**m.metadata, SNAPSHOT_OFFSET: str(self._snapshot[2]), SNAPSHOT_TS: str(self._snapshot[3])}
        offsets, _ = self._records(m, pub.payload, STREAM_PARTITION, reuse)
        if self.on_progress is not None:
            self.on_progress("chunks_sent")
        latest = replace(m, metadata={**m.metadata, OFFSET: str(offsets[0])})
        for record in self._lineage:  # before the manifest: a version is announced with its lineage
            self.producer.send(self.topics.lineage, record, key=self.policy)
        self._signed(self.topics.policies, "policies", latest, self.policy)
        self._flush()
        return latest

    def close(self) -> None:
        self._flush()


__all__ = [
    "NonFiniteWeightsError",
    "Publication",
    "PublishSettings",
    "PublisherFencedError",
    "VersionEncoder",
    "WeightPublisher",
    "check_finite",
    "published_state",
    "publisher_producer_config",
    "split_chunks",
]
