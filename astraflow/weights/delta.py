"""Lossless sparse deltas between two versions of a state dict.

``encode(prev, new)`` writes what changed from `prev` to `new` and ``apply(prev, delta)``
rebuilds `new` bit for bit. Both take state dicts of torch tensors or numpy arrays (bf16, fp16,
fp32 and the other dtypes in `astraflow.weights.bits`) and compare BIT PATTERNS, not values, so
NaN payloads, infinities and -0.0 round-trip exactly.

Streaming: ``iter_encode`` yields one framed block per changed tensor (plus a header and a
trailer) and ``apply_stream`` consumes such an iterator, so neither side holds more than one
tensor's encoded bytes at a time. The wire format is documented in `astraflow.weights.format`
and docs/weights.md; the per-element coding in `astraflow.weights.codec`.

Layout changes are not errors: a tensor that is new in `new`, or whose dtype or shape changed,
is sent whole (op FULL) and a tensor missing from `new` is removed (op REMOVE). A tensor whose
bits did not change gets no block at all.

Verification: the header records the base version's checksum, so applying to any other base
raises `DeltaBaseMismatchError` before anything is touched; every tensor and the resulting
version are checked against their crc32 / sha256 (`DeltaChecksumError` on mismatch), and a
failed apply leaves `prev` exactly as it was.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator, Mapping
from dataclasses import dataclass, field
from typing import Any

from astraflow.errors import DeltaFormatError
from astraflow.weights.bits import StateManifest, TensorEntry, TensorMeta, bit_view, tensor_crc
from astraflow.weights.codec import DEFAULT_CHUNK_ELEMS, DEFAULT_LEVEL, ChunkEncoder
from astraflow.weights.format import (
    KIND_TENSOR,
    OP_DELTA,
    OP_FULL,
    OP_REMOVE,
    STREAM_DELTA,
    StreamHeader,
    StreamTrailer,
    TensorRecord,
    frame,
    split_blocks,
    unframe,
)
from astraflow.weights.transaction import apply_blocks

StateDict = Mapping[str, Any]


@dataclass(frozen=True)
class SparseDelta:
    """An encoded delta: framed blocks, header first, trailer last."""

    blocks: tuple[bytes | memoryview, ...]  # the wire blocks, ready to send one by one or concatenated
    header: StreamHeader  # base version/checksum and target version
    trailer: StreamTrailer  # counts and checksum of the resulting version
    manifest: StateManifest | None = field(default=None, compare=False)  # of `new`, when encoded here

    @property
    def nbytes(self) -> int:
        """Size on the wire."""
        return sum(len(b) for b in self.blocks)

    def to_bytes(self) -> bytes:
        return b"".join(self.blocks)

    @classmethod
    def from_bytes(cls, data: bytes | memoryview) -> SparseDelta:
        """Split and check the frames of a concatenated delta (tensor bodies are decoded on apply).
        The blocks are views into `data` when it is `bytes` (immutable: no copy), else copies."""
        blocks = tuple(split_blocks(data) if isinstance(data, bytes) else (bytes(b) for b in split_blocks(data)))
        if len(blocks) < 2:
            raise DeltaFormatError("a delta needs at least a header and a trailer block")
        header = StreamHeader.of_first_block(blocks[0])
        _, tail = unframe(blocks[-1])
        return cls(blocks, header, StreamTrailer.parse(tail))


def iter_encode(
    prev: StateDict,
    new: StateDict,
    *,
    base_version: int = 0,
    version: int = 1,
    base_manifest: StateManifest | None = None,
    out_manifest: StateManifest | None = None,
    chunk_elems: int = DEFAULT_CHUNK_ELEMS,
    level: int = DEFAULT_LEVEL,
) -> Iterator[bytes]:
    """Yield the blocks of the delta `prev` -> `new`, one tensor at a time.

    `base_manifest` (the manifest of `prev`, e.g. kept from the previous call) saves one crc32
    pass over `prev`. `out_manifest`, if given, is filled with the manifest of `new` so the
    next call can pass it as `base_manifest`.
    """
    base = base_manifest if base_manifest is not None else StateManifest.of(prev)
    result = out_manifest if out_manifest is not None else StateManifest()
    result.clear()
    yield StreamHeader(STREAM_DELTA, base_version, version, base.checksum(), chunk_elems).to_block()
    coder = ChunkEncoder(chunk_elems, level)
    n_blocks = n_changed = 0
    for name, value in new.items():
        meta, bits = bit_view(value)
        old = base.get(name)
        if old is not None and old.meta == meta and name in prev:
            _, old_bits = bit_view(prev[name])
            chunks, k, crc = coder.encode(old_bits, bits)
            result[name] = TensorEntry(meta, crc)
            if k == 0:
                continue
            record = TensorRecord(name, OP_DELTA, meta, old.crc, crc, k, len(chunks), 0)
            n_changed += k
        else:
            chunks = coder.encode_full(bits)
            crc = tensor_crc(bits)
            result[name] = TensorEntry(meta, crc)
            record = TensorRecord(name, OP_FULL, meta, old.crc if old else 0, crc, bits.size, len(chunks), 0)
        n_blocks += 1
        yield frame(KIND_TENSOR, b"".join([record.pack_head(), *chunks]))
    for name, old in base.items():
        if name not in new:
            n_blocks += 1
            record = TensorRecord(name, OP_REMOVE, old.meta, old.crc, 0, 0, 0, 0)
            yield frame(KIND_TENSOR, record.pack_head())
    yield StreamTrailer(n_blocks, len(result), n_changed, result.checksum()).to_block()


def encode(
    prev: StateDict,
    new: StateDict,
    *,
    base_version: int = 0,
    version: int = 1,
    base_manifest: StateManifest | None = None,
    chunk_elems: int = DEFAULT_CHUNK_ELEMS,
    level: int = DEFAULT_LEVEL,
) -> SparseDelta:
    """Encode the delta `prev` -> `new` in memory; see `iter_encode` for the arguments."""
    manifest = StateManifest()
    blocks = tuple(
        iter_encode(
            prev,
            new,
            base_version=base_version,
            version=version,
            base_manifest=base_manifest,
            out_manifest=manifest,
            chunk_elems=chunk_elems,
            level=level,
        )
    )
    header = StreamHeader.parse(unframe(blocks[0])[1])
    trailer = StreamTrailer.parse(unframe(blocks[-1])[1])
    return SparseDelta(blocks, header, trailer, manifest)


def _blocks_of(delta: SparseDelta | bytes | memoryview | Iterable[bytes]) -> Iterable[bytes | memoryview]:
    if isinstance(delta, SparseDelta):
        return delta.blocks
    if isinstance(delta, bytes | bytearray | memoryview):
        return split_blocks(delta)
    return delta


def apply(
    prev: StateDict,
    delta: SparseDelta | bytes | memoryview | Iterable[bytes],
    *,
    base_manifest: StateManifest | None = None,
) -> dict[str, Any]:
    """Return the new state dict; `prev` is not modified.

    Changed tensors are fresh copies; unchanged tensors are the very objects of `prev` (copy
    them if you mean to mutate them). `delta` may be a `SparseDelta`, its bytes, or an iterable
    of blocks as yielded by `iter_encode`. Raises `DeltaBaseMismatchError` if `prev` is not the
    delta's base, `DeltaChecksumError` / `DeltaFormatError` if the delta is corrupt.
    """
    state = dict(prev)
    base = base_manifest if base_manifest is not None else StateManifest.of(prev)
    apply_blocks(state, _blocks_of(delta), base, inplace=False)
    return state


def apply_stream(
    prev: StateDict, blocks: Iterable[bytes], *, base_manifest: StateManifest | None = None
) -> dict[str, Any]:
    """`apply` for an iterator of blocks (kept for symmetry with `iter_encode`)."""
    return apply(prev, blocks, base_manifest=base_manifest)


__all__ = ["SparseDelta", "TensorMeta", "apply", "apply_stream", "encode", "iter_encode"]
