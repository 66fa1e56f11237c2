"""Wire format of weight deltas and snapshots: framed blocks, header, tensor records, trailer.

A delta (or a snapshot) is a stream of self-delimiting blocks, all little-endian::

    block   := "AW" kind:u8 format:u8 body_len:u64 body crc32(body):u32
    stream  := HEADER TENSOR* TRAILER

    HEADER  body: "AFWD" stream:u8 (0 delta, 1 snapshot) base_version:i64 version:i64
                  base_checksum:32B chunk_elems:u32
    TRAILER body: n_tensor_blocks:u32 n_tensors:u32 n_changed:u64 checksum:32B
    TENSOR  body: name_len:u16 name:utf8 op:u8 dtype:u8 ndim:u8 shape:u64*ndim
                  base_crc:u32 new_crc:u32 n_changed:u64 n_chunks:u32 chunk*

    op DELTA  (0): chunk := index:u32 n:u32 n_big:u32 gap_width:u8 mag_width:u8 frame_len:u32
                            zstd-frame (gap planes | big flags | sign bits | magnitude planes)
    op FULL   (1): chunk := index:u32 n:u32 codec:u8 (0 raw, 1 zstd byte planes) comp_len:u32 bytes
    op REMOVE (2): no chunks (shape is the removed tensor's, new_crc is 0)

A tensor is cut into chunks of ``chunk_elems`` elements (chunk ``index`` covers elements
``[index * chunk_elems, ...)``); DELTA lists only chunks that changed and a tensor that did not
change at all has no TENSOR block. Checksums are explained in `astraflow.weights.bits`; the
body crc32 of every block catches transport corruption before anything is decoded.
"""

from __future__ import annotations

import struct
import zlib
from collections.abc import Iterator
from dataclasses import dataclass

from astraflow.errors import DeltaChecksumError, DeltaFormatError
from astraflow.weights.bits import DTYPE_BY_CODE, TensorMeta

FORMAT_VERSION = 1
BLOCK_MAGIC = b"AW"
STREAM_MAGIC = b"AFWD"
KIND_HEADER, KIND_TENSOR, KIND_TRAILER = 1, 2, 3
STREAM_DELTA, STREAM_SNAPSHOT = 0, 1
OP_DELTA, OP_FULL, OP_REMOVE = 0, 1, 2
FULL_RAW, FULL_ZSTD_PLANES = 0, 1

_FRAME = struct.Struct("<2sBBQ")  # magic, kind, format version, body length
_CRC = struct.Struct("<I")
_HEADER = struct.Struct("<4sBqq32sI")
_TRAILER = struct.Struct("<IIQ32s")
_TENSOR_TAIL = struct.Struct("<IIQI")  # base_crc, new_crc, n_changed, n_chunks
DELTA_CHUNK = struct.Struct("<IIIBBI")  # index, n_changed, n_big, gap_width, mag_width, frame_len
FULL_CHUNK = struct.Struct("<IIBI")  # index, n_elems, codec, comp_len


def frame(kind: int, body: bytes) -> bytes:
    """Wrap a block body with its frame and crc32."""
    return b"".join(
        (_FRAME.pack(BLOCK_MAGIC, kind, FORMAT_VERSION, len(body)), body, _CRC.pack(zlib.crc32(body)))
    )


def unframe(block: bytes | memoryview) -> tuple[int, memoryview]:
    """Check a block's frame and crc32; return (kind, body)."""
    mv = memoryview(block)
    if len(mv) < _FRAME.size + _CRC.size:
        raise DeltaFormatError(
            f"truncated block ({len(mv)} bytes); the delta is incomplete, fetch a snapshot"
        )
    magic, kind, version, n = _FRAME.unpack_from(mv)
    if magic != BLOCK_MAGIC:
        raise DeltaFormatError(
            f"bad block magic {bytes(magic)!r}: these bytes are not an AstraFlow weight delta"
        )
    if version != FORMAT_VERSION:
        raise DeltaFormatError(
            f"weight format version {version} is not supported (this build reads {FORMAT_VERSION})"
        )
    if len(mv) != _FRAME.size + n + _CRC.size:
        raise DeltaFormatError(f"block length {len(mv)} does not match its frame ({n} body bytes)")
    body = mv[_FRAME.size : _FRAME.size + n]
    (crc,) = _CRC.unpack_from(mv, _FRAME.size + n)
    if zlib.crc32(body) != crc:
        raise DeltaChecksumError(
            "a delta block failed its crc32: it was corrupted in transit; fetch a snapshot"
        )
    return kind, body


def split_blocks(data: bytes | memoryview) -> Iterator[memoryview]:
    """Cut a concatenated stream into blocks (zero-copy); frames are checked by `unframe`."""
    mv = memoryview(data)
    pos = 0
    while pos < len(mv):
        if len(mv) - pos < _FRAME.size:
            raise DeltaFormatError("truncated stream: a block frame is cut short; fetch a snapshot")
        (_, _, _, n) = _FRAME.unpack_from(mv, pos)
        end = pos + _FRAME.size + n + _CRC.size
        if end > len(mv):
            raise DeltaFormatError("truncated stream: the last block is cut short; fetch a snapshot")
        yield mv[pos:end]
        pos = end


@dataclass(frozen=True)
class StreamHeader:
    """First block of a stream: which version it turns which base into."""

    stream: int  # STREAM_DELTA or STREAM_SNAPSHOT
    base_version: int  # version the delta applies to (-1 for a snapshot)
    version: int  # version it produces
    base_checksum: bytes  # StateManifest.checksum() of the base (of the empty manifest for a snapshot)
    chunk_elems: int  # elements per chunk

    def to_block(self) -> bytes:
        body = _HEADER.pack(
            STREAM_MAGIC, self.stream, self.base_version, self.version, self.base_checksum, self.chunk_elems
        )
        return frame(KIND_HEADER, body)

    @classmethod
    def parse(cls, body: memoryview) -> StreamHeader:
        if len(body) != _HEADER.size:
            raise DeltaFormatError("malformed stream header")
        magic, stream, base, version, checksum, chunk = _HEADER.unpack(body)
        if magic != STREAM_MAGIC or stream not in (STREAM_DELTA, STREAM_SNAPSHOT) or chunk <= 0:
            raise DeltaFormatError("malformed stream header: not an AstraFlow weight delta or snapshot")
        return cls(stream, base, version, checksum, chunk)

    @classmethod
    def of_first_block(cls, block: bytes | memoryview | None) -> StreamHeader:
        """The header of a stream from its first block (None: the stream is empty)."""
        if block is None:
            raise DeltaFormatError("empty delta")
        kind, body = unframe(block)
        if kind != KIND_HEADER:
            raise DeltaFormatError("a delta must start with its header block")
        return cls.parse(body)


@dataclass(frozen=True)
class StreamTrailer:
    """Last block of a stream: what the result must look like."""

    n_tensor_blocks: int  # TENSOR blocks in the stream (catches dropped blocks)
    n_tensors: int  # tensors in the resulting version
    n_changed: int  # changed elements over all DELTA blocks
    checksum: bytes  # StateManifest.checksum() of the resulting version

    def to_block(self) -> bytes:
        return frame(
            KIND_TRAILER, _TRAILER.pack(self.n_tensor_blocks, self.n_tensors, self.n_changed, self.checksum)
        )

    @classmethod
    def parse(cls, body: memoryview) -> StreamTrailer:
        if len(body) != _TRAILER.size:
            raise DeltaFormatError("malformed stream trailer")
        return cls(*_TRAILER.unpack(body))


@dataclass(frozen=True)
class TensorRecord:
    """Fixed part of a TENSOR block; the chunks follow at `chunks_offset` of the body."""

    name: str  # state-dict key
    op: int  # OP_DELTA, OP_FULL or OP_REMOVE
    meta: TensorMeta  # dtype and shape (of the new tensor; of the removed one for OP_REMOVE)
    base_crc: int  # crc32 of the base tensor (0 when there is none)
    new_crc: int  # crc32 of the resulting tensor (0 for OP_REMOVE)
    n_changed: int  # changed elements (DELTA) or elements (FULL)
    n_chunks: int  # chunk records that follow
    chunks_offset: int  # where they start in the body

    def pack_head(self) -> bytes:
        raw = self.name.encode()
        if len(raw) > 0xFFFF:
            raise DeltaFormatError(f"tensor name too long ({len(raw)} bytes, max 65535)")
        shape = self.meta.shape
        return b"".join(
            (
                struct.pack(
                    f"<H{len(raw)}sBBB{len(shape)}Q",
                    len(raw),
                    raw,
                    self.op,
                    self.meta.dtype.code,
                    len(shape),
                    *shape,
                ),
                _TENSOR_TAIL.pack(self.base_crc, self.new_crc, self.n_changed, self.n_chunks),
            )
        )

    @classmethod
    def parse(cls, body: memoryview) -> TensorRecord:
        try:
            (n,) = struct.unpack_from("<H", body)
            name = bytes(body[2 : 2 + n]).decode()
            op, code, ndim = struct.unpack_from("<BBB", body, 2 + n)
            pos = 5 + n
            shape = struct.unpack_from(f"<{ndim}Q", body, pos)
            pos += 8 * ndim
            base_crc, new_crc, n_changed, n_chunks = _TENSOR_TAIL.unpack_from(body, pos)
        except (struct.error, UnicodeDecodeError) as exc:
            raise DeltaFormatError(f"malformed tensor block: {exc}") from exc
        dtype = DTYPE_BY_CODE.get(code)
        if dtype is None or op not in (OP_DELTA, OP_FULL, OP_REMOVE):
            raise DeltaFormatError(f"tensor block {name!r} has unknown dtype code {code} or op {op}")
        meta = TensorMeta(dtype, tuple(shape))
        return cls(name, op, meta, base_crc, new_crc, n_changed, n_chunks, pos + _TENSOR_TAIL.size)
