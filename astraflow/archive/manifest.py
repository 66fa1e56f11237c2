"""Per-file manifests and the archive's naming scheme.

Layout under the archive root (a local directory or an fsspec URI):

    <topic>/p<partition:04d>/<first offset:020d>-<last offset:020d>.avro
    <topic>/p<partition:04d>/<first offset:020d>-<last offset:020d>.manifest.json

Zero-padded offsets make names sort in offset order. The manifest, written after its data file
is durable, says what the file holds: offset and time ranges, record counts, the schema
fingerprints seen (with their record names and versions), and each block's byte range, record
range and CRC-32, so a reader can verify a block and skip a corrupted one precisely. A data file
whose manifest is missing (a crash between the two renames) is complete; the archive app
rebuilds its manifest on start.
"""

from __future__ import annotations

import json
import re
from dataclasses import asdict, dataclass, field
from typing import Any

from astraflow.archive.format import FORMAT_VERSION, ArchivedRecord
from astraflow.errors import UnknownSchemaError
from astraflow.schema_catalog import SchemaCatalog

DATA_RE = re.compile(r"^(\d{20})-(\d{20})\.avro$")
MANIFEST_SUFFIX = ".manifest.json"
PARTITION_RE = re.compile(r"^p(\d{4,})$")


def partition_dir(topic: str, partition: int) -> str:
    return f"{topic}/p{partition:04d}"


def data_name(first: int, last: int) -> str:
    return f"{first:020d}-{last:020d}.avro"


def manifest_name(data_file: str) -> str:
    return data_file[: -len(".avro")] + MANIFEST_SUFFIX


def schema_tag(value: bytes | None, catalog: SchemaCatalog | None) -> tuple[str, str | None, int | None]:
    """(tag, record name, version) of a Kafka value: its single-object fingerprint in hex, or
    `confluent:<id>`, `tombstone`, `raw` for values that are not single-object Avro."""
    if value is None:
        return "tombstone", None, None
    if value[:2] == b"\xc3\x01" and len(value) >= 10:
        fp = bytes(value[2:10])
        if catalog is not None:
            try:
                sv = catalog.by_fingerprint(fp)
                return fp.hex(), sv.fullname, sv.version
            except UnknownSchemaError:
                pass
        return fp.hex(), None, None
    if len(value) >= 5 and value[0] == 0:
        return f"confluent:{int.from_bytes(value[1:5], 'big')}", None, None
    return "raw", None, None


@dataclass(slots=True)
class BlockInfo:
    """Where one block lies in its file and what it holds."""

    byte_offset: int  # start of the block (its count varint)
    byte_size: int  # through the trailing sync marker
    records: int
    first_offset: int  # Kafka offset of the block's first record
    last_offset: int
    crc32: int  # zlib.crc32 of the block's bytes (count, size, data, sync)


@dataclass(slots=True)
class SchemaCount:
    """How many records of a file carry one schema tag."""

    records: int
    name: str | None = None  # record full name, when the fingerprint is in the catalog
    version: int | None = None


@dataclass(slots=True)
class Manifest:
    """What one archive file holds."""

    file: str  # data file name, relative to its partition directory
    topic: str
    partition: int
    first_offset: int
    last_offset: int
    records: int  # fewer than the offset span on compacted or transactional topics
    min_timestamp_ms: int
    max_timestamp_ms: int
    first_timestamp_ms: int  # of the first record; timestamps need not be monotonic
    last_timestamp_ms: int
    bytes: int  # size of the data file
    sha256: str
    codec: str
    schemas: dict[str, SchemaCount] = field(default_factory=dict)  # schema tag -> count
    blocks: list[BlockInfo] = field(default_factory=list)
    created_at_ms: int = 0
    writer: str = ""  # host and pid that wrote the file
    rebuilt: bool = False  # True when rebuilt from the data file after a crash
    format: str = f"astraflow-archive/{FORMAT_VERSION}"

    def to_json(self) -> str:
        return json.dumps(asdict(self), indent=1, sort_keys=True)

    @classmethod
    def from_json(cls, text: str | bytes) -> Manifest:
        d: dict[str, Any] = json.loads(text)
        d["schemas"] = {k: SchemaCount(**v) for k, v in d.get("schemas", {}).items()}
        d["blocks"] = [BlockInfo(**b) for b in d.get("blocks", [])]
        known = set(cls.__dataclass_fields__)
        return cls(**{k: v for k, v in d.items() if k in known})

    def overlaps_time(self, since_ms: int | None, until_ms: int | None) -> bool:
        if since_ms is not None and self.max_timestamp_ms < since_ms:
            return False
        return not (until_ms is not None and self.min_timestamp_ms > until_ms)


class ManifestBuilder:
    """Accumulates a manifest's statistics while a file is written (or re-read)."""

    def __init__(self, topic: str, partition: int, catalog: SchemaCatalog | None) -> None:
        self.topic = topic
        self.partition = partition
        self.catalog = catalog
        self.records = 0
        self.first: ArchivedRecord | None = None
        self.last: ArchivedRecord | None = None
        self.min_ts = 0
        self.max_ts = 0
        self.schemas: dict[str, SchemaCount] = {}
        self.blocks: list[BlockInfo] = []
        self._cache: dict[bytes, tuple[str, str | None, int | None]] = {}  # fingerprint -> tag

    def add(self, rec: ArchivedRecord) -> None:
        if self.first is None:
            self.first = rec
            self.min_ts = self.max_ts = rec.timestamp_ms
        self.last = rec
        self.records += 1
        self.min_ts = min(self.min_ts, rec.timestamp_ms)
        self.max_ts = max(self.max_ts, rec.timestamp_ms)
        head = bytes(rec.value[:10]) if rec.value is not None else b""
        tag = self._cache.get(head)
        if tag is None:
            tag = schema_tag(rec.value, self.catalog)
            if rec.value is not None:
                self._cache[head] = tag
        sc = self.schemas.get(tag[0])
        if sc is None:
            self.schemas[tag[0]] = SchemaCount(1, tag[1], tag[2])
        else:
            sc.records += 1

    def build(self, *, file: str, size: int, sha256: str, codec: str, created_at_ms: int, writer: str,
              rebuilt: bool = False) -> Manifest:
        assert self.first is not None and self.last is not None, "a manifest needs at least one record"
        return Manifest(
            file=file,
            topic=self.topic,
            partition=self.partition,
            first_offset=self.first.offset,
            last_offset=self.last.offset,
            records=self.records,
            min_timestamp_ms=self.min_ts,
            max_timestamp_ms=self.max_ts,
            first_timestamp_ms=self.first.timestamp_ms,
            last_timestamp_ms=self.last.timestamp_ms,
            bytes=size,
            sha256=sha256,
            codec=codec,
            schemas=self.schemas,
            blocks=self.blocks,
            created_at_ms=created_at_ms,
            writer=writer,
            rebuilt=rebuilt,
        )
