"""Writes Kafka records into the archive, one open file per topic-partition, rolled by size and age.

Durability and exactly-once, without trusting Kafka commits:
- a file is staged, fsynced and renamed into place whole (see `store`), then its manifest is
  written the same way; only then may the caller commit the offsets it holds;
- on start, `recover()` reads the partition's manifests (rebuilding the manifest of a data file
  whose manifest write was cut short, and deleting staging files of a crashed run) and returns
  the last archived offset; the caller seeks past it, and `append` drops any record at or below
  it, so a restart or a consumer that rewinds never writes a record twice.
"""

from __future__ import annotations

import hashlib
import logging
import os
import socket
import time
import zlib
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import BinaryIO

from astraflow.archive.errors import ArchiveCorruptError, ArchiveError
from astraflow.archive.format import CODEC, ArchivedRecord, ContainerWriter
from astraflow.archive.manifest import (
    DATA_RE,
    BlockInfo,
    Manifest,
    ManifestBuilder,
    data_name,
    manifest_name,
    partition_dir,
)
from astraflow.archive.reader import read_blocks
from astraflow.archive.store import ArchiveStore, LocalStore
from astraflow.records import now_ms
from astraflow.schema_catalog import SchemaCatalog, default_catalog

log = logging.getLogger(__name__)


@dataclass(frozen=True, slots=True)
class RollPolicy:
    """When an open archive file is sealed and a new one started."""

    max_file_bytes: int = 64 * 1024 * 1024  # roll when the file (plus its open block) reaches this
    max_file_age_s: float = 300.0  # roll a file this long after its first record, even if idle
    max_file_records: int | None = None  # roll after this many records (mostly for tests)
    block_bytes: int = 1024 * 1024  # uncompressed bytes per Avro block
    block_records: int | None = None  # records per block at most (mostly for tests)
    zstd_level: int = 3


def _writer_id() -> str:
    return f"{socket.gethostname()}:{os.getpid()}"


class _OpenFile:
    """The file being written for one partition: staged locally, not yet durable."""

    def __init__(self, store: ArchiveStore, topic: str, partition: int, first: ArchivedRecord,
                 policy: RollPolicy, catalog: SchemaCatalog) -> None:
        self.rel_dir = partition_dir(topic, partition)
        self.path: Path = store.staging_file(self.rel_dir, f"{first.offset:020d}.avro")
        self.fo: BinaryIO = open(self.path, "wb")  # noqa: SIM115 - closed in seal/abort
        meta = {"astraflow.topic": topic, "astraflow.partition": str(partition), "astraflow.writer": _writer_id()}
        self.container = ContainerWriter(self.fo, meta, policy.zstd_level)
        self.builder = ManifestBuilder(topic, partition, catalog)
        self.pending: list[ArchivedRecord] = []
        self.pending_bytes = 0
        self.opened_at = time.monotonic()
        self.last_offset = first.offset - 1

    def add(self, rec: ArchivedRecord) -> None:
        self.pending.append(rec)
        self.pending_bytes += len(rec.value or b"") + len(rec.key or b"") + 64
        self.builder.add(rec)
        self.last_offset = rec.offset

    def flush_block(self) -> None:
        if not self.pending:
            return
        start, size, blob = self.container.write_block(self.pending)
        self.builder.blocks.append(
            BlockInfo(start, size, len(self.pending), self.pending[0].offset, self.pending[-1].offset, zlib.crc32(blob))
        )
        self.pending, self.pending_bytes = [], 0

    @property
    def size(self) -> int:
        return self.container.position + self.pending_bytes

    def close(self) -> None:
        self.flush_block()
        self.fo.flush()
        os.fsync(self.fo.fileno())
        self.fo.close()

    def abort(self) -> None:
        self.fo.close()
        self.path.unlink(missing_ok=True)


class PartitionArchive:
    """The archive of one topic-partition."""

    def __init__(self, store: ArchiveStore, topic: str, partition: int, policy: RollPolicy,
                 catalog: SchemaCatalog) -> None:
        self.store = store
        self.topic = topic
        self.partition = partition
        self.policy = policy
        self.catalog = catalog
        self.rel_dir = partition_dir(topic, partition)
        self.last_offset: int | None = None  # last offset durable in the archive
        self.skipped = 0  # records dropped because they were already archived
        self._open: _OpenFile | None = None

    def recover(self) -> int | None:
        """Cleans up after a crash and returns the last archived offset (None if nothing yet)."""
        if isinstance(self.store, LocalStore):
            for stale in self.store.stale_staging(self.rel_dir):
                log.info("removing staging file of an interrupted run: %s", stale)
                stale.unlink(missing_ok=True)
        names = self.store.listdir(self.rel_dir)
        present = set(names)
        last = None
        for name in names:
            m = DATA_RE.match(name)
            if not m:
                continue
            mname = manifest_name(name)
            if mname not in present:
                manifest = self._rebuild_manifest(name)
                if manifest is None:
                    continue
            else:
                try:
                    manifest = Manifest.from_json(self.store.read_bytes(f"{self.rel_dir}/{mname}"))
                except (ValueError, TypeError, KeyError):
                    log.warning("manifest %s/%s unreadable; rebuilding it from the data file", self.rel_dir, mname)
                    manifest = self._rebuild_manifest(name)
                    if manifest is None:
                        continue
            if last is not None and manifest.first_offset <= last:
                log.warning("archive file %s/%s overlaps the previous file (offset %d <= %d)",
                            self.rel_dir, name, manifest.first_offset, last)
            last = manifest.last_offset if last is None else max(last, manifest.last_offset)
        self.last_offset = last
        return last

    def _rebuild_manifest(self, name: str) -> Manifest | None:
        rel = f"{self.rel_dir}/{name}"
        data = self.store.read_bytes(rel)
        builder = ManifestBuilder(self.topic, self.partition, self.catalog)
        try:
            for info, records in read_blocks(data, rel):
                builder.blocks.append(info)
                for r in records:
                    builder.add(r)
        except ArchiveCorruptError as exc:
            # Its offsets were never committed (the manifest comes first), so Kafka still has them.
            log.error("%s; moving it aside to %s.corrupt and archiving its records again", exc, rel)
            self.store.rename(rel, rel + ".corrupt")
            return None
        if builder.records == 0:
            self.store.delete(rel)
            return None
        manifest = builder.build(file=name, size=len(data), sha256=hashlib.sha256(data).hexdigest(), codec=CODEC,
                                 created_at_ms=now_ms(), writer=_writer_id(), rebuilt=True)
        self.store.put_bytes(f"{self.rel_dir}/{manifest_name(name)}", manifest.to_json().encode())
        log.info("rebuilt missing manifest of %s (offsets %d..%d)", rel, manifest.first_offset, manifest.last_offset)
        return manifest

    @property
    def next_offset(self) -> int | None:
        """Where consumption should resume: one past the last archived offset."""
        return None if self.last_offset is None else self.last_offset + 1

    @property
    def open_records(self) -> int:
        return self._open.builder.records if self._open else 0

    def append(self, rec: ArchivedRecord) -> Manifest | None:
        """Adds a record; returns the manifest of the file this sealed, if it reached its size."""
        floor = self._open.last_offset if self._open else self.last_offset
        if floor is not None and rec.offset <= floor:
            self.skipped += 1
            return None
        if self._open is None:
            self._open = _OpenFile(self.store, self.topic, self.partition, rec, self.policy, self.catalog)
        f = self._open
        f.add(rec)
        p = self.policy
        if f.pending_bytes >= p.block_bytes or (p.block_records and len(f.pending) >= p.block_records):
            f.flush_block()
        if f.size >= p.max_file_bytes or (p.max_file_records and f.builder.records >= p.max_file_records):
            return self.seal()
        return None

    def due(self, now: float | None = None) -> bool:
        """Whether the open file has reached its maximum age."""
        if self._open is None:
            return False
        return (now if now is not None else time.monotonic()) - self._open.opened_at >= self.policy.max_file_age_s

    def seal(self) -> Manifest | None:
        """Makes the open file durable and visible, then its manifest; returns the manifest."""
        f, self._open = self._open, None
        if f is None:
            return None
        f.close()
        name = data_name(f.builder.first.offset, f.builder.last.offset)  # type: ignore[union-attr]
        size = f.container.position
        try:
            self.store.publish(f.path, f"{self.rel_dir}/{name}")
            manifest = f.builder.build(file=name, size=size, sha256=f.container.sha256.hexdigest(), codec=CODEC,
                                       created_at_ms=now_ms(), writer=_writer_id())
            self.store.put_bytes(f"{self.rel_dir}/{manifest_name(name)}", manifest.to_json().encode())
        except OSError as exc:
            f.path.unlink(missing_ok=True)
            raise ArchiveError(f"cannot write archive file {self.store.describe(self.rel_dir)}/{name}: {exc}") from exc
        self.last_offset = manifest.last_offset
        return manifest

    def abort(self) -> None:
        """Drops the open file (not durable, offsets not committed: Kafka still has them)."""
        f, self._open = self._open, None
        if f is not None:
            f.abort()


class ArchiveWriter:
    """Archives records of any number of topic-partitions into one archive root."""

    def __init__(self, location: str | Path | ArchiveStore, policy: RollPolicy | None = None,
                 catalog: SchemaCatalog | None = None,
                 on_seal: Callable[[Manifest], None] | None = None) -> None:
        self.store = location if isinstance(location, ArchiveStore) else ArchiveStore.open(location, create=True)
        self.policy = policy or RollPolicy()
        self.catalog = catalog or default_catalog()
        self.on_seal = on_seal
        self.partitions: dict[tuple[str, int], PartitionArchive] = {}

    def partition(self, topic: str, partition: int) -> PartitionArchive:
        """The partition's archive, recovered from its manifests on first use."""
        key = (topic, partition)
        pa = self.partitions.get(key)
        if pa is None:
            pa = PartitionArchive(self.store, topic, partition, self.policy, self.catalog)
            pa.recover()
            self.partitions[key] = pa
        return pa

    def append(self, rec: ArchivedRecord) -> Manifest | None:
        m = self.partition(rec.topic, rec.partition).append(rec)
        if m is not None and self.on_seal is not None:
            self.on_seal(m)
        return m

    def seal_due(self, now: float | None = None) -> list[Manifest]:
        return self.seal([k for k, pa in self.partitions.items() if pa.due(now)])

    def seal(self, keys: list[tuple[str, int]] | None = None) -> list[Manifest]:
        out = []
        for key in list(self.partitions) if keys is None else keys:
            pa = self.partitions.get(key)
            m = pa.seal() if pa is not None else None
            if m is not None:
                out.append(m)
                if self.on_seal is not None:
                    self.on_seal(m)
        return out

    def drop(self, keys: list[tuple[str, int]], abort: bool = False) -> None:
        """Forgets partitions (revoked or lost); `abort` discards their open files."""
        for key in keys:
            pa = self.partitions.pop(key, None)
            if pa is not None and abort:
                pa.abort()

    def close(self) -> list[Manifest]:
        """Seals every open file."""
        return self.seal()
