"""The archive file format: standard Avro object container files of wrapper records.

Why a wrapper and not the records' own schema: a topic holds records written under several
schema versions (and, in the DLQ, bytes that are not Avro at all). Each container record is an
`astraflow.archive.ArchivedRecord` that keeps the Kafka value *byte for byte* (single-object
framing and fingerprint included) next to its key, headers, topic, partition, offset and
timestamp. So replay re-publishes identical bytes, every schema version stays decodable through
its fingerprint, and any Avro tool (fastavro, Apache avro, Spark) can open the files.

The files are plain Avro containers (magic `Obj\\x01`, metadata with `avro.schema` and
`avro.codec`, 16-byte sync marker, then blocks of `count, size, data, sync`) written here rather
than through fastavro's writer so that the writer knows each block's byte range and checksum for
the manifest. Blocks are zstandard frames with the zstd content checksum turned on, so a
corrupted block is detected even without its manifest.
"""

from __future__ import annotations

import hashlib
import io
import json
import os
from dataclasses import dataclass, field
from typing import Any, BinaryIO

from fastavro import parse_schema, schemaless_reader, schemaless_writer

try:  # Python 3.14 ships zstd; before that fastavro uses the backport too.
    from compression import zstd  # type: ignore[import-not-found]
except ImportError:  # pragma: no cover - depends on the Python version
    from backports import zstd

MAGIC = b"Obj\x01"
SYNC_SIZE = 16
CODEC = "zstandard"
FORMAT_VERSION = "1"

ARCHIVED_RECORD_SCHEMA: dict[str, Any] = {
    "type": "record",
    "name": "ArchivedRecord",
    "namespace": "astraflow.archive",
    "doc": "One Kafka record as it was in its topic. `value` holds the original bytes (Avro single-object "
    "framing and schema fingerprint included), so replay publishes identical bytes and every schema "
    "version stays decodable.",
    "fields": [
        {"name": "topic", "type": "string"},
        {"name": "partition", "type": "int"},
        {"name": "offset", "type": "long"},
        {"name": "timestamp", "type": "long", "doc": "Kafka record timestamp, ms since the epoch."},
        {"name": "timestamp_type", "type": "int", "doc": "0 not available, 1 CreateTime, 2 LogAppendTime."},
        {"name": "key", "type": ["null", "bytes"], "default": None},
        {"name": "value", "type": ["null", "bytes"], "default": None, "doc": "null for tombstones."},
        {
            "name": "headers",
            "type": {
                "type": "array",
                "items": {
                    "type": "record",
                    "name": "Header",
                    "fields": [{"name": "key", "type": "string"}, {"name": "value", "type": ["null", "bytes"]}],
                },
            },
            "default": [],
            "doc": "Kafka headers in their original order (keys may repeat).",
        },
    ],
}
PARSED_SCHEMA = parse_schema(ARCHIVED_RECORD_SCHEMA, named_schemas={})


@dataclass(slots=True)
class ArchivedRecord:
    """A Kafka record with its coordinates; `value` and `key` are the original bytes."""

    topic: str
    partition: int
    offset: int
    timestamp_ms: int
    value: bytes | None
    key: bytes | None = None
    headers: list[tuple[str, bytes | None]] = field(default_factory=list)
    timestamp_type: int = 1  # 0 not available, 1 CreateTime, 2 LogAppendTime

    @classmethod
    def from_message(cls, msg: Any) -> ArchivedRecord:
        """From a confluent-kafka Message."""
        ts_type, ts = msg.timestamp()
        return cls(
            topic=msg.topic(),
            partition=msg.partition(),
            offset=msg.offset(),
            timestamp_ms=ts,
            value=msg.value(),
            key=msg.key(),
            headers=[(k, v) for k, v in (msg.headers() or [])],
            timestamp_type=ts_type,
        )

    def to_avro(self) -> dict[str, Any]:
        return {
            "topic": self.topic,
            "partition": self.partition,
            "offset": self.offset,
            "timestamp": self.timestamp_ms,
            "timestamp_type": self.timestamp_type,
            "key": self.key,
            "value": self.value,
            "headers": [{"key": k, "value": v} for k, v in self.headers],
        }

    @classmethod
    def from_avro(cls, d: dict[str, Any]) -> ArchivedRecord:
        return cls(
            topic=d["topic"],
            partition=d["partition"],
            offset=d["offset"],
            timestamp_ms=d["timestamp"],
            value=d["value"],
            key=d["key"],
            headers=[(h["key"], h["value"]) for h in d["headers"]],
            timestamp_type=d["timestamp_type"],
        )


# ---- Avro binary primitives ---------------------------------------------------------------------


def encode_long(n: int) -> bytes:
    """Avro long: zig-zag, then base-128 varint."""
    z = (n << 1) ^ (n >> 63)
    out = bytearray()
    while z & ~0x7F:
        out.append((z & 0x7F) | 0x80)
        z >>= 7
    out.append(z)
    return bytes(out)


def decode_long(data: bytes | memoryview, pos: int) -> tuple[int, int]:
    """Reads an Avro long at `pos`; returns (value, next position). Raises ValueError if truncated."""
    shift = 0
    z = 0
    while True:
        if pos >= len(data):
            raise ValueError("truncated varint")
        b = data[pos]
        pos += 1
        z |= (b & 0x7F) << shift
        if not b & 0x80:
            break
        shift += 7
        if shift > 63:
            raise ValueError("varint longer than 10 bytes")
    return (z >> 1) ^ -(z & 1), pos


def encode_header(metadata: dict[str, bytes], sync: bytes) -> bytes:
    out = bytearray(MAGIC)
    out += encode_long(len(metadata))
    for k, v in metadata.items():
        kb = k.encode()
        out += encode_long(len(kb)) + kb + encode_long(len(v)) + v
    out += encode_long(0)
    out += sync
    return bytes(out)


@dataclass(frozen=True, slots=True)
class Header:
    """A parsed container header."""

    metadata: dict[str, bytes]
    sync: bytes
    size: int  # bytes up to and including the sync marker: where block 0 starts

    @property
    def codec(self) -> str:
        return self.metadata.get("avro.codec", b"null").decode()

    def schema(self) -> dict[str, Any]:
        return json.loads(self.metadata["avro.schema"])


def decode_header(data: bytes) -> Header:
    """Parses the container header; raises ValueError on anything malformed."""
    if data[:4] != MAGIC:
        raise ValueError(f"not an Avro container file (starts with {bytes(data[:4])!r}, expected {MAGIC!r})")
    pos = 4
    meta: dict[str, bytes] = {}
    while True:
        n, pos = decode_long(data, pos)
        if n == 0:
            break
        if n < 0:  # a negative count is followed by the block's byte size
            n = -n
            _, pos = decode_long(data, pos)
        for _ in range(n):
            klen, pos = decode_long(data, pos)
            key = bytes(data[pos : pos + klen]).decode()
            pos += klen
            vlen, pos = decode_long(data, pos)
            meta[key] = bytes(data[pos : pos + vlen])
            pos += vlen
            if pos > len(data):
                raise ValueError("header metadata runs past the end of the file")
    sync = bytes(data[pos : pos + SYNC_SIZE])
    if len(sync) != SYNC_SIZE:
        raise ValueError("header is truncated before its sync marker")
    return Header(meta, sync, pos + SYNC_SIZE)


# ---- blocks ------------------------------------------------------------------------------------


def compress(data: bytes, level: int = 3) -> bytes:
    p = zstd.CompressionParameter
    return zstd.compress(data, options={p.compression_level: level, p.checksum_flag: 1})


def decompress(data: bytes, codec: str) -> bytes:
    if codec == "null":
        return data
    if codec == "zstandard":
        return zstd.decompress(data)
    if codec == "deflate":
        import zlib

        return zlib.decompress(data, -15)
    raise ValueError(f"codec {codec!r} is not supported by the archive reader (use zstandard, deflate or null)")


def encode_records(records: list[ArchivedRecord]) -> bytes:
    buf = io.BytesIO()
    for r in records:
        schemaless_writer(buf, PARSED_SCHEMA, r.to_avro())
    return buf.getvalue()


def decode_records(raw: bytes, count: int, writer_schema: Any = None) -> list[ArchivedRecord]:
    """Decodes `count` wrapper records from a block's uncompressed bytes; ValueError if they do not fit."""
    bio = io.BytesIO(raw)
    schema = writer_schema or PARSED_SCHEMA
    reader = None if writer_schema is None else PARSED_SCHEMA
    try:
        out = [ArchivedRecord.from_avro(schemaless_reader(bio, schema, reader)) for _ in range(count)]
    except Exception as exc:  # fastavro raises EOFError, ValueError, IndexError... on garbage
        raise ValueError(f"records do not decode ({type(exc).__name__}: {exc})") from exc
    if bio.tell() != len(raw):
        raise ValueError(f"{len(raw) - bio.tell()} bytes left over after {count} records")
    return out


def iter_varint_block_header(data: bytes, pos: int) -> tuple[int, int, int]:
    """(record count, data size, position of data) of the block starting at `pos`."""
    count, pos = decode_long(data, pos)
    size, pos = decode_long(data, pos)
    if count < 0 or size < 0:
        raise ValueError(f"negative block count ({count}) or size ({size})")
    return count, size, pos


class ContainerWriter:
    """Writes an Avro container to a binary file object, one block per `write_block` call."""

    def __init__(self, fo: BinaryIO, metadata: dict[str, str], level: int = 3) -> None:
        self.fo = fo
        self.level = level
        self.sync = os.urandom(SYNC_SIZE)
        meta = {
            "avro.schema": json.dumps(ARCHIVED_RECORD_SCHEMA).encode(),
            "avro.codec": CODEC.encode(),
            "astraflow.archive.format": FORMAT_VERSION.encode(),
            **{k: v.encode() for k, v in metadata.items()},
        }
        header = encode_header(meta, self.sync)
        fo.write(header)
        self.sha256 = hashlib.sha256(header)  # of the whole file, for the manifest
        self.position = len(header)  # bytes written so far

    def write_block(self, records: list[ArchivedRecord]) -> tuple[int, int, bytes]:
        """Writes one block; returns (byte offset, byte size, the block's bytes for checksums)."""
        data = compress(encode_records(records), self.level)
        blob = encode_long(len(records)) + encode_long(len(data)) + data + self.sync
        self.fo.write(blob)
        self.sha256.update(blob)
        start = self.position
        self.position += len(blob)
        return start, len(blob), blob
