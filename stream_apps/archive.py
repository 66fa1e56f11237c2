"""The archive app: copies topics into Avro container files (see docs/archive.md).

    astraflow archive run --experiment EXP --topics rollouts,scored --to DIR_OR_URI

A plain confluent-kafka consumer loop rather than a Faust agent: the app's whole job is file I/O
with manual offset control (seek to where the archive ends, commit only after fsync and rename),
which Faust's automatic commits and table machinery would fight rather than help.

Guarantees:
- Offsets are committed only after the file that holds them is durable (and its manifest).
- On start (and on every partition assignment) the app reads the partition's manifests and
  seeks past the last archived offset, so Kafka commits are only advisory: a crash, `kill -9`,
  or a reset consumer group never writes a record twice, and never skips one that Kafka still
  retains.
- Several instances may share the consumer group to split partitions; on a rebalance each
  seals and commits its open files before giving partitions up. A crashed member holds its
  partitions until its session times out (10 s here); give each instance a stable
  `--instance-id` (static membership) and its restart takes them over at once.
"""

from __future__ import annotations

import hashlib
import logging
import signal
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Literal

if TYPE_CHECKING:  # heavy imports stay inside functions so that --help is instant
    from confluent_kafka import Consumer, TopicPartition

    from astraflow.archive.manifest import Manifest
    from astraflow.archive.writer import RollPolicy
    from astraflow.config import KafkaSettings
    from astraflow.schema_catalog import SchemaCatalog

log = logging.getLogger("astraflow.archive.app")

StartFrom = Literal["earliest", "latest", "committed"]


@dataclass(slots=True)
class ArchiveStats:
    """What one run of the app archived."""

    records: int = 0  # records written into files
    files: int = 0  # files sealed
    bytes: int = 0  # bytes of sealed files
    skipped: int = 0  # records already in the archive (dropped)


def default_group(experiment: str | None, to: str) -> str:
    """One group per destination, so two archives of one experiment do not split its partitions."""
    digest = hashlib.sha1(to.encode()).hexdigest()[:8]
    if experiment:
        from astraflow.kafka.topics import Topics

        return Topics(experiment).archive_group(digest)
    return f"af-archive.{digest}"


def resolve_topics(experiment: str | None, names: list[str]) -> list[str]:
    """Stream names (`rollouts`, `solver.train`) of an experiment, or full topic names."""
    from astraflow.kafka.topics import Topics

    flat = [n.strip() for item in names for n in item.split(",") if n.strip()]
    if not flat:
        from astraflow.errors import ConfigError

        raise ConfigError("no topics to archive; pass --topics rollouts,scored (stream names or full topic names)")
    if experiment is None:
        return flat
    t = Topics(experiment)
    return [t.stream(n) for n in flat]


class ArchiveApp:
    """Consumes topics and feeds an `ArchiveWriter`, committing after each sealed file."""

    def __init__(
        self,
        kafka: KafkaSettings,
        topics: list[str],
        to: str,
        *,
        group: str,
        policy: RollPolicy | None = None,
        start: StartFrom = "earliest",
        catalog: SchemaCatalog | None = None,
        on_seal: Callable[[Manifest], None] | None = None,
        instance_id: str | None = None,
        session_timeout_s: float = 10.0,
    ) -> None:
        from astraflow.archive.writer import ArchiveWriter
        from astraflow.kafka.clients import group_member

        self.topics = topics
        self.start = start
        self.stats = ArchiveStats()
        self._user_on_seal = on_seal
        self._to_commit: dict[tuple[str, int], int] = {}
        self.writer = ArchiveWriter(to, policy, catalog, on_seal=self._sealed)
        self.consumer: Consumer = group_member(
            kafka, group, 16 * 1024 * 1024,
            **{
                "enable.auto.offset.store": False,
                "max.poll.interval.ms": 600000,
                "session.timeout.ms": int(session_timeout_s * 1000),
                # eager rebalancing: the callbacks below assign and unassign whole assignments
                "partition.assignment.strategy": "range,roundrobin",
                **({"group.instance.id": instance_id} if instance_id else {}),
            },
        )
        self.assigned = False

    # ---- rebalance callbacks (run inside consume(), on this thread) -------------------------------

    def _on_assign(self, consumer: Consumer, partitions: list[TopicPartition]) -> None:
        from confluent_kafka import OFFSET_BEGINNING, OFFSET_END, OFFSET_STORED

        default = {"earliest": OFFSET_BEGINNING, "latest": OFFSET_END, "committed": OFFSET_STORED}[self.start]
        for tp in partitions:
            pa = self.writer.partition(tp.topic, tp.partition)  # reads the manifests
            nxt = pa.next_offset
            tp.offset = nxt if nxt is not None else default
            log.info("assigned %s[%d]: %s", tp.topic, tp.partition,
                     f"resuming after archived offset {nxt - 1}" if nxt is not None else f"starting at {self.start}")
        consumer.assign(partitions)
        self.assigned = True

    def _on_revoke(self, consumer: Consumer, partitions: list[TopicPartition]) -> None:
        keys = [(tp.topic, tp.partition) for tp in partitions]
        self.writer.seal(keys)
        self._commit()
        self.writer.drop(keys)
        consumer.unassign()

    def _on_lost(self, consumer: Consumer, partitions: list[TopicPartition]) -> None:
        # Someone else may own them now: discard open (uncommitted, non-durable) files.
        self.writer.drop([(tp.topic, tp.partition) for tp in partitions], abort=True)
        self._to_commit.clear()
        consumer.unassign()

    # ---- loop --------------------------------------------------------------------------------

    def _sealed(self, m: Manifest) -> None:
        self.stats.files += 1
        self.stats.records += m.records
        self.stats.bytes += m.bytes
        self._to_commit[(m.topic, m.partition)] = m.last_offset + 1
        log.info("sealed %s/p%04d/%s: %d records, offsets %d..%d, %.1f KiB",
                 m.topic, m.partition, m.file, m.records, m.first_offset, m.last_offset, m.bytes / 1024)
        if self._user_on_seal is not None:
            self._user_on_seal(m)

    def _commit(self) -> None:
        if not self._to_commit:
            return
        from confluent_kafka import KafkaException, TopicPartition

        offsets = [TopicPartition(t, p, off) for (t, p), off in sorted(self._to_commit.items())]
        self._to_commit.clear()
        try:
            self.consumer.commit(offsets=offsets, asynchronous=False)
        except KafkaException as exc:  # advisory only: the manifests are the archive's position
            log.warning("offset commit failed (%s); the archive's manifests still hold the position", exc)

    def _check_topics(self) -> None:
        from astraflow.archive.errors import ArchiveError

        md = self.consumer.list_topics(timeout=15)
        missing = [t for t in self.topics if t not in md.topics]
        if missing:
            raise ArchiveError(
                f"topics not found: {', '.join(missing)}; create them (`astraflow topics create`) or fix --topics"
            )

    def run(self, stop: threading.Event | None = None, exit_when_idle_s: float | None = None,
            poll_timeout_s: float = 0.5) -> ArchiveStats:
        """Archives until `stop` is set (or, with `exit_when_idle_s`, until no record came for that long)."""
        from astraflow.archive.format import ArchivedRecord
        from astraflow.kafka.clients import data_messages

        stop = stop or threading.Event()
        self._check_topics()
        self.consumer.subscribe(self.topics, on_assign=self._on_assign, on_revoke=self._on_revoke, on_lost=self._on_lost)
        last_record = time.monotonic()
        try:
            while not stop.is_set():
                msgs = self.consumer.consume(1000, poll_timeout_s)
                for msg in data_messages(msgs, ", ".join(self.topics), _restart_the_app):
                    if (msg.topic(), msg.partition()) not in self.writer.partitions:
                        continue  # fetched before a revoke
                    self.writer.append(ArchivedRecord.from_message(msg))
                    last_record = time.monotonic()
                self.writer.seal_due()
                self._commit()
                if not self.assigned:
                    last_record = time.monotonic()
                elif exit_when_idle_s is not None and time.monotonic() - last_record >= exit_when_idle_s:
                    break
        finally:
            self.writer.close()
            self._commit()
            self.stats.skipped = sum(pa.skipped for pa in self.writer.partitions.values())
            self.consumer.close()
        return self.stats



def _restart_the_app(message: str) -> Exception:
    from astraflow.archive.errors import ArchiveError

    return ArchiveError(f"{message}; restart the app")


def run(
    kafka: KafkaSettings,
    topics: list[str],
    to: str,
    *,
    group: str | None = None,
    experiment: str | None = None,
    policy: RollPolicy | None = None,
    start: StartFrom = "earliest",
    stop: threading.Event | None = None,
    exit_when_idle_s: float | None = None,
    catalog: SchemaCatalog | None = None,
    on_seal: Callable[[Manifest], None] | None = None,
    instance_id: str | None = None,
) -> ArchiveStats:
    """Archives `topics` (full names) into `to` (a directory or an fsspec URI)."""
    app = ArchiveApp(kafka, topics, to, group=group or default_group(experiment, to), policy=policy, start=start,
                     catalog=catalog, on_seal=on_seal, instance_id=instance_id)
    return app.run(stop, exit_when_idle_s)


def serve(
    kafka: KafkaSettings,
    topics: list[str],
    to: str,
    **kwargs: Any,
) -> ArchiveStats:
    """`run` until SIGTERM or SIGINT (then seals open files, commits and returns); main thread only."""
    stop = threading.Event()

    def _stop(signum: int, _frame: Any) -> None:
        log.info("signal %d: sealing open files and stopping", signum)
        stop.set()

    previous = {s: signal.signal(s, _stop) for s in (signal.SIGTERM, signal.SIGINT)}
    try:
        return run(kafka, topics, to, stop=stop, **kwargs)
    finally:
        for s, handler in previous.items():
            signal.signal(s, handler)


def policy_from(max_file_mb: float, max_file_age: float, max_file_records: int | None, block_kb: float) -> RollPolicy:
    from astraflow.archive.writer import RollPolicy

    return RollPolicy(
        max_file_bytes=int(max_file_mb * 1024 * 1024),
        max_file_age_s=max_file_age,
        max_file_records=max_file_records,
        block_bytes=int(block_kb * 1024),
    )
