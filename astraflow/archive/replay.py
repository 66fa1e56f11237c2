"""Replay: re-publish archived (or still retained) records into a topic.

Order: each source partition's records go out in offset order, to the same partition number
when the target has that many partitions (else by key, else partition modulo the target's
count), with the same key and headers; an idempotent producer keeps that order through retries.
Partitions are interleaved by timestamp.

Bytes: by default the value is published byte for byte as it was archived, whatever schema
version wrote it; consumers decode older versions through their fingerprints into the current
schema. Records are decoded only when a `--filter` needs their fields, and re-encoded in the
current schema version only with `reencode=True` (`--reencode`), for consumers that expect the
latest version's fingerprint.

Pacing: `rate` sends record i at t0 + i / rate (an absolute schedule, so the achieved rate does
not drift); `speed` reproduces the original gaps between timestamps divided by `speed`.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass, field
from pathlib import Path

from confluent_kafka import KafkaError, KafkaException, Message, Producer

from astraflow.archive.errors import ArchiveError, FilterError, ReplayError
from astraflow.archive.filter import RecordFilter, record_env
from astraflow.archive.format import ArchivedRecord
from astraflow.archive.kafka_source import TopicSource
from astraflow.archive.reader import ArchiveReader, CorruptHandler
from astraflow.archive.store import is_uri
from astraflow.config import KafkaSettings
from astraflow.errors import SerdeError
from astraflow.kafka.clients import producer_config
from astraflow.serde import SINGLE_OBJECT_MAGIC, AvroSerde

PROVENANCE_HEADER = "af-replay-from"


@dataclass(frozen=True, slots=True)
class ReplayOptions:
    """What to replay and how fast."""

    since_ms: int | None = None  # only records with a timestamp at or after this
    until_ms: int | None = None  # ... and at or before this
    filter: str | None = None  # a RecordFilter expression over the decoded record
    rate: float | None = None  # records per second
    speed: float | None = None  # multiple of the original pace (timestamps)
    limit: int | None = None  # stop after publishing this many
    reencode: bool = False  # write values in the current schema version instead of the archived bytes
    keep_timestamps: bool = False  # publish with the original timestamps (mind the target's retention)
    provenance: bool = True  # add an `af-replay-from: topic/partition/offset` header

    def __post_init__(self) -> None:
        if self.rate is not None and self.speed is not None:
            raise ReplayError("use either --rate or --speed, not both")
        if self.rate is not None and self.rate <= 0:
            raise ReplayError(f"--rate must be positive, got {self.rate}")
        if self.speed is not None and self.speed <= 0:
            raise ReplayError(f"--speed must be positive, got {self.speed}")
        if self.limit is not None and self.limit < 0:
            raise ReplayError(f"--limit must be zero or more, got {self.limit}")
        if self.since_ms is not None and self.until_ms is not None and self.since_ms > self.until_ms:
            raise ReplayError("--since is after --until: nothing to replay")


@dataclass(slots=True)
class ReplayStats:
    """Counts of a replay so far."""

    read: int = 0  # records read from the source
    published: int = 0  # acknowledged by Kafka (after flush: all sent ones)
    sent: int = 0  # handed to the producer
    filtered_out: int = 0
    undecodable: int = 0  # values the serde could not decode (kept when no filter needs them)
    reencoded: int = 0
    corrupt_blocks: list[str] = field(default_factory=list)
    started: float = 0.0  # monotonic time of the first send
    last_send: float = 0.0
    elapsed_s: float = 0.0

    @property
    def rate(self) -> float:
        """Achieved send rate over the sends so far (records/s)."""
        span = self.last_send - self.started
        return (self.sent - 1) / span if self.sent > 1 and span > 0 else 0.0


@dataclass
class ReplaySource:
    """An opened source: its records in per-partition order, and what a progress bar needs."""

    description: str
    records: Iterator[ArchivedRecord]
    total: int | None  # records expected, None if unknown
    close: Callable[[], None] = lambda: None
    partitions: int | None = None  # partitions of the source (a target made for it gets as many)


def open_source(
    spec: str,
    kafka: KafkaSettings,
    *,
    topic: str | None = None,
    since_ms: int | None = None,
    until_ms: int | None = None,
    skip_corrupt: bool = False,
    on_corrupt: CorruptHandler | None = None,
    resolve_topic: Callable[[str], str] = lambda name: name,
) -> ReplaySource:
    """An archive (an existing path, or a URI) or a Kafka topic (anything else)."""
    path = Path(spec)
    if is_uri(spec) or spec.startswith("file://") or path.exists():
        root, in_topic = spec, topic
        if not is_uri(spec) and path.is_dir() and any(c.name.startswith("p") and c.name[1:].isdigit() for c in path.iterdir()):
            root, in_topic = str(path.parent), path.name  # --from <archive>/<topic>
        reader = ArchiveReader(root, skip_corrupt=skip_corrupt, on_corrupt=on_corrupt)
        try:  # a full name, or the one archived topic of a stream (`rollouts`)
            name = reader.resolve_topic(in_topic)
        except ArchiveError:
            if in_topic is None:
                raise
            name = reader.resolve_topic(resolve_topic(in_topic))
        return ReplaySource(f"archive {root} ({name})", reader.read_topic(name, since_ms, until_ms),
                            reader.count(name, since_ms, until_ms), partitions=len(reader.partitions(name)) or None)
    if "/" in spec or spec.startswith("."):  # Kafka topic names never hold a slash
        raise ReplayError(f"no archive at {spec}: the path does not exist (a topic name has no '/')")
    name = resolve_topic(spec)
    src = TopicSource(kafka, name, since_ms=since_ms, until_ms=until_ms)
    return ReplaySource(f"topic {name}", iter(src), src.total, src.close, partitions=src.partitions)


class Replayer:
    """Publishes records to one topic with the options' filter, pacing and limit."""

    def __init__(self, kafka: KafkaSettings, target: str, options: ReplayOptions, serde: AvroSerde | None = None,
                 **producer_overrides: object) -> None:
        self.target = target
        self.options = options
        self.serde = serde or AvroSerde.for_kafka(kafka)
        self.filter = RecordFilter(options.filter) if options.filter else None
        self.producer = Producer(producer_config(kafka, self.serde.max_record_bytes, **producer_overrides))
        self.partitions = self._target_partitions()
        self.stats = ReplayStats()
        self._failures: list[str] = []
        self._latest_fp: dict[str, bytes] = {}

    def _target_partitions(self, wait_s: float = 10.0) -> int:
        """The target's partition count. A topic created a moment ago may not be in a broker's
        metadata yet, so a missing one is looked for again for `wait_s` (as roles do)."""
        deadline = time.monotonic() + wait_s
        while True:
            try:
                md = self.producer.list_topics(self.target, timeout=15)
            except KafkaException as exc:
                raise ReplayError(f"cannot read metadata of {self.target} (is Kafka reachable?): {exc}") from exc
            t = md.topics.get(self.target)
            if (t is not None and t.error is None and t.partitions) or time.monotonic() >= deadline:
                break
            time.sleep(0.5)
        if t is None or t.error is not None or not t.partitions:
            raise ReplayError(
                f"target topic {self.target} does not exist: add --create-target to make it (as many partitions as "
                "the source, delete policy), or create it first with `astraflow topics create -e EXPERIMENT` "
                "(--stream NAME for one stream) to choose its partitions and retention"
            )
        return len(t.partitions)

    def _on_delivery(self, err: KafkaError | None, msg: Message) -> None:
        if err is not None:
            self._failures.append(f"{msg.topic()}[{msg.partition()}]: {err.str()}")
        else:
            self.stats.published += 1

    def _transform(self, rec: ArchivedRecord) -> bytes | bool | None:
        """The value to publish, or False to drop the record."""
        opts = self.options
        if self.filter is None and not opts.reencode:
            return rec.value
        try:
            fullname, datum = self.serde.decode(rec.value)
        except SerdeError:
            self.stats.undecodable += 1
            if self.filter is None:
                return rec.value
            try:  # a filter on meta fields alone still applies to undecodable records
                keep = self.filter(record_env(None, None, rec.topic, rec.partition, rec.offset, rec.timestamp_ms, rec.key))
            except FilterError:
                keep = False
            return rec.value if keep else False
        if self.filter is not None and not self.filter(
            record_env(fullname, datum, rec.topic, rec.partition, rec.offset, rec.timestamp_ms, rec.key)
        ):
            return False
        if opts.reencode and rec.value is not None and rec.value[:2] == SINGLE_OBJECT_MAGIC:
            latest = self._latest_fp.get(fullname)
            if latest is None:
                latest = self._latest_fp[fullname] = self.serde.catalog.latest(fullname).fingerprint
            if bytes(rec.value[2:10]) != latest:
                self.stats.reencoded += 1
                return self.serde.encode(fullname, datum)
        return rec.value

    def _partition_for(self, rec: ArchivedRecord) -> int | None:
        if rec.partition < self.partitions:
            return rec.partition
        if rec.key is not None:
            return None  # the producer's key hash: records of one key stay together and in order
        return rec.partition % self.partitions

    def _wait(self, ts_ms: int, ts0: int | None) -> None:
        opts, s = self.options, self.stats
        if opts.rate is not None:
            due = s.started + s.sent / opts.rate
        elif opts.speed is not None and ts0 is not None:
            due = s.started + (ts_ms - ts0) / 1000.0 / opts.speed
        else:
            return
        while True:
            left = due - time.monotonic()
            if left <= 0:
                return
            self.producer.poll(min(left, 0.05))  # serves delivery reports while it waits

    def run(
        self,
        records: Iterable[ArchivedRecord],
        on_progress: Callable[[ReplayStats], None] | None = None,
        stop: Callable[[], bool] | None = None,
    ) -> ReplayStats:
        """Publishes every record that passes; flushes; returns the counts."""
        opts, s = self.options, self.stats
        ts0: int | None = None
        t_start = time.monotonic()
        last_report = 0.0
        try:
            for rec in records:
                if opts.limit is not None and s.sent >= opts.limit:
                    break
                if stop is not None and stop():
                    break
                s.read += 1
                value = self._transform(rec)
                if value is False:
                    s.filtered_out += 1
                    continue
                if s.sent == 0:
                    s.started = time.monotonic()
                    ts0 = rec.timestamp_ms
                self._wait(rec.timestamp_ms, ts0)
                self._produce(rec, value)  # type: ignore[arg-type]
                s.sent += 1
                s.last_send = time.monotonic()
                if self._failures:
                    break
                if on_progress is not None and s.last_send - last_report >= 0.1:
                    last_report = s.last_send
                    on_progress(s)
        finally:
            remaining = self.producer.flush(60)
            s.elapsed_s = time.monotonic() - t_start
            if on_progress is not None:
                on_progress(s)
        if remaining:
            raise ReplayError(f"{remaining} records not acknowledged by Kafka within 60 s; is it reachable?")
        if self._failures:
            raise ReplayError(f"Kafka rejected {len(self._failures)} records, first: {self._failures[0]}")
        return s

    def _produce(self, rec: ArchivedRecord, value: bytes | None) -> None:
        headers = list(rec.headers)
        if self.options.provenance:
            headers.append((PROVENANCE_HEADER, f"{rec.topic}/{rec.partition}/{rec.offset}".encode()))
        kwargs: dict[str, object] = {"value": value, "key": rec.key, "headers": headers or None,
                                     "on_delivery": self._on_delivery}
        part = self._partition_for(rec)
        if part is not None:
            kwargs["partition"] = part
        if self.options.keep_timestamps:
            kwargs["timestamp"] = rec.timestamp_ms
        while True:
            try:
                self.producer.produce(self.target, **kwargs)  # type: ignore[arg-type]
                break
            except BufferError:  # local queue full: serve delivery reports, then retry
                self.producer.poll(0.1)
        self.producer.poll(0)
