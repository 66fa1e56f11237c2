"""Reads archive files back, block by block, checking each block.

A block is checked against its manifest entry (CRC-32, record count, first offset) when the
manifest is there, and always for its framing (sizes, sync marker), its zstd frame checksum and
its records' decoding. A bad block raises `ArchiveCorruptError` naming the file, the block and its
byte position; with `skip_corrupt=True` it is reported through `on_corrupt` instead and reading
goes on with the next block (found from the manifest, or by scanning for the file's sync marker),
so the rest of the file stays readable. A block's records are yielded only once the whole block
has decoded: a block is all or nothing.
"""

from __future__ import annotations

import heapq
import zlib
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass

from fastavro import parse_schema

from astraflow.archive.errors import ArchiveCorruptError, ArchiveError
from astraflow.archive.format import (
    ARCHIVED_RECORD_SCHEMA,
    SYNC_SIZE,
    ArchivedRecord,
    Header,
    decode_header,
    decode_records,
    decompress,
    iter_varint_block_header,
)
from astraflow.archive.manifest import (
    DATA_RE,
    PARTITION_RE,
    BlockInfo,
    Manifest,
    manifest_name,
    partition_dir,
)
from astraflow.archive.store import ArchiveStore


@dataclass(frozen=True, slots=True)
class CorruptBlock:
    """A part of an archive that could not be read, as reported in skip-and-report mode."""

    file: str  # relative to the archive root
    block: int | None  # 0-based block index; None for the header or a whole file
    byte_offset: int | None
    reason: str
    first_offset: int | None = None  # Kafka offsets lost with the block, when the manifest says
    last_offset: int | None = None
    records: int | None = None

    def __str__(self) -> str:
        where = "header" if self.block is None else f"block {self.block}"
        if self.byte_offset is not None:
            where += f" at byte {self.byte_offset}"
        lost = ""
        if self.records is not None:
            lost = f"; {self.records} records lost (offsets {self.first_offset}..{self.last_offset})"
        return f"{self.file}: {where}: {self.reason}{lost}"


CorruptHandler = Callable[[CorruptBlock], None]


def _decode_block(data: bytes, start: int, end_limit: int, header: Header, writer_schema: object) -> tuple[int, list[ArchivedRecord]]:
    """Decodes the block at `start`; returns (end position, records). ValueError when bad."""
    count, size, dpos = iter_varint_block_header(data, start)
    end = dpos + size + SYNC_SIZE
    if end > end_limit:
        raise ValueError(f"block claims {size} bytes of data, past the end of the file (truncated?)")
    if data[dpos + size : end] != header.sync:
        raise ValueError("sync marker missing after the block (sizes corrupted)")
    try:
        raw = decompress(data[dpos : dpos + size], header.codec)
    except Exception as exc:  # zstd raises its own ZstdError on a bad frame or checksum
        raise ValueError(f"{header.codec} data does not decompress ({exc})") from exc
    return end, decode_records(raw, count, writer_schema)


def read_blocks(
    data: bytes,
    file: str,
    manifest: Manifest | None = None,
    *,
    skip_corrupt: bool = False,
    on_corrupt: CorruptHandler | None = None,
) -> Iterator[tuple[BlockInfo, list[ArchivedRecord]]]:
    """Yields (block info, records) for every good block of one file."""

    def bad(block: int | None, pos: int | None, reason: str, info: BlockInfo | None = None) -> None:
        report = CorruptBlock(
            file, block, pos, reason,
            info.first_offset if info else None, info.last_offset if info else None, info.records if info else None,
        )
        if not skip_corrupt:
            raise ArchiveCorruptError(
                f"archive file {file} is corrupt: {report}. Read with skip-and-report mode "
                "(e.g. `--skip-corrupt`) to skip this block and read the rest",
                file=file, block=block, byte_offset=pos,
            )
        if on_corrupt is not None:
            on_corrupt(report)

    try:
        header = decode_header(data)
        writer_raw = header.schema()
        writer_schema = None if writer_raw == ARCHIVED_RECORD_SCHEMA else parse_schema(writer_raw, named_schemas={})
    except (ValueError, KeyError) as exc:
        bad(None, 0, f"header unreadable ({exc}); the whole file is lost")
        return

    if manifest is not None and manifest.blocks:
        for i, info in enumerate(manifest.blocks):
            blob_end = info.byte_offset + info.byte_size
            blob = data[info.byte_offset : blob_end]
            crc = zlib.crc32(blob)
            if len(blob) != info.byte_size:
                bad(i, info.byte_offset, f"file is truncated (block should end at byte {blob_end})", info)
                continue
            if crc != info.crc32:
                bad(i, info.byte_offset, f"CRC-32 mismatch (manifest {info.crc32:08x}, file {crc:08x})", info)
                continue
            try:
                _, records = _decode_block(data, info.byte_offset, blob_end, header, writer_schema)
            except ValueError as exc:
                bad(i, info.byte_offset, str(exc), info)
                continue
            if len(records) != info.records or records[0].offset != info.first_offset:
                bad(i, info.byte_offset, "block holds other records than its manifest entry says", info)
                continue
            yield info, records
        return

    pos, index = header.size, 0
    while pos < len(data):
        try:
            end, records = _decode_block(data, pos, len(data), header, writer_schema)
        except ValueError as exc:
            bad(index, pos, str(exc))
            nxt = data.find(header.sync, pos)  # resynchronise on the file's sync marker
            if nxt < 0:
                return
            pos, index = nxt + SYNC_SIZE, index + 1
            continue
        if records:
            info = BlockInfo(pos, end - pos, len(records), records[0].offset, records[-1].offset, zlib.crc32(data[pos:end]))
            yield info, records
        pos, index = end, index + 1


@dataclass(slots=True)
class ArchiveFile:
    """One data file of a partition, with its manifest when it has one."""

    path: str  # relative to the archive root
    first_offset: int
    last_offset: int
    manifest: Manifest | None


class ArchiveReader:
    """Lists and reads an archive (a local directory or an fsspec URI)."""

    def __init__(
        self,
        location: str | ArchiveStore,
        *,
        skip_corrupt: bool = False,
        on_corrupt: CorruptHandler | None = None,
    ) -> None:
        self.store = location if isinstance(location, ArchiveStore) else ArchiveStore.open(location)
        self.skip_corrupt = skip_corrupt
        self.corrupt: list[CorruptBlock] = []  # every problem reported so far
        self._on_corrupt = on_corrupt

    def _report(self, c: CorruptBlock) -> None:
        self.corrupt.append(c)
        if self._on_corrupt is not None:
            self._on_corrupt(c)

    def topics(self) -> list[str]:
        return [t for t in self.store.listdir("") if self.partitions(t)]

    def resolve_topic(self, topic: str | None) -> str:
        """`topic` if the archive has it; the only topic when `topic` is None."""
        topics = self.topics()
        if topic is None:
            if len(topics) == 1:
                return topics[0]
            raise ArchiveError(
                f"archive {self.store.location} holds {len(topics)} topics ({', '.join(topics) or 'none'}); "
                "name one with --topic"
            )
        if topic in topics:
            return topic
        # A stream name (`rollouts`) names the one archived topic of that stream, if only one.
        suffixed = [t for t in topics if t.endswith(f".{topic}")]
        if len(suffixed) == 1:
            return suffixed[0]
        raise ArchiveError(
            f"archive {self.store.location} has no topic {topic}"
            + (" (several match: pass --experiment or the full name)" if suffixed else "")
            + f"; it holds: {', '.join(topics) or 'nothing'}"
        )

    def partitions(self, topic: str) -> list[int]:
        out = []
        for name in self.store.listdir(topic):
            m = PARTITION_RE.match(name)
            if m:
                out.append(int(m.group(1)))
        return sorted(out)

    def files(self, topic: str, partition: int) -> list[ArchiveFile]:
        d = partition_dir(topic, partition)
        names = self.store.listdir(d)
        present = set(names)
        out = []
        for name in names:
            m = DATA_RE.match(name)
            if not m:
                continue
            manifest = None
            mname = manifest_name(name)
            if mname in present:
                try:
                    manifest = Manifest.from_json(self.store.read_bytes(f"{d}/{mname}"))
                except (ValueError, TypeError, KeyError) as exc:
                    self._report(CorruptBlock(f"{d}/{mname}", None, None, f"manifest unreadable ({exc}); reading without it"))
            out.append(ArchiveFile(f"{d}/{name}", int(m.group(1)), int(m.group(2)), manifest))
        return sorted(out, key=lambda f: f.first_offset)

    def read_file(self, f: ArchiveFile) -> Iterator[ArchivedRecord]:
        data = self.store.read_bytes(f.path)
        for _, records in read_blocks(data, f.path, f.manifest, skip_corrupt=self.skip_corrupt, on_corrupt=self._report):
            yield from records

    def read_partition(
        self, topic: str, partition: int, since_ms: int | None = None, until_ms: int | None = None,
        from_offset: int | None = None,
    ) -> Iterator[ArchivedRecord]:
        """Records of one partition in offset order, within the time range."""
        for f in self.files(topic, partition):
            if from_offset is not None and f.last_offset < from_offset:
                continue
            if f.manifest is not None and not f.manifest.overlaps_time(since_ms, until_ms):
                continue
            for r in self.read_file(f):
                if from_offset is not None and r.offset < from_offset:
                    continue
                if since_ms is not None and r.timestamp_ms < since_ms:
                    continue
                if until_ms is not None and r.timestamp_ms > until_ms:
                    continue
                yield r

    def read_topic(
        self, topic: str, since_ms: int | None = None, until_ms: int | None = None, partitions: Iterable[int] | None = None
    ) -> Iterator[ArchivedRecord]:
        """Every partition's records, merged by timestamp; each partition keeps its offset order."""
        parts = list(partitions) if partitions is not None else self.partitions(topic)
        iters = [self.read_partition(topic, p, since_ms, until_ms) for p in parts]
        # heapq.merge only compares the heads of its inputs, so each input's own order is kept
        # even where timestamps go backwards inside a partition.
        return heapq.merge(*iters, key=lambda r: (r.timestamp_ms, r.partition))

    def count(self, topic: str, since_ms: int | None = None, until_ms: int | None = None) -> int | None:
        """Records in the topic per the manifests (an upper bound with a time range); None if a file has none."""
        total = 0
        for p in self.partitions(topic):
            for f in self.files(topic, p):
                if f.manifest is None:
                    return None
                if f.manifest.overlaps_time(since_ms, until_ms):
                    total += f.manifest.records
        return total
