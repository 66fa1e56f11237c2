"""All-or-nothing application of a block stream (delta or snapshot) to a state dict.

`apply_blocks` is the one place that decodes TENSOR blocks into weights. It checks the base
checksum before touching anything, verifies every tensor's crc32 as it goes and the version
checksum at the end, and on ANY failure (corrupt bytes, wrong base, truncated stream, even
KeyboardInterrupt) rolls the state dict back to exactly what it was:

- in place (`inplace=True`, used by `WeightChain`): DELTA chunks are added into the existing
  buffers and, on failure, subtracted again; bit-pattern arithmetic wraps, so the undo is
  exact. The undo log only keeps the compressed blocks, never a copy of the weights.
- copy mode: changed tensors are decoded into fresh arrays; the old objects are untouched.
  In place, the tensors named in `keep` (others still read them: an engine that loads weights
  later) are copied too, and only when the stream changes them.
"""

from __future__ import annotations

import struct
from collections.abc import Callable, Collection, Iterable, Iterator, MutableMapping
from dataclasses import dataclass
from typing import Any

from astraflow.errors import DeltaBaseMismatchError, DeltaChecksumError, DeltaFormatError
from astraflow.weights.bits import (
    StateManifest,
    TensorEntry,
    bit_view,
    from_bits,
    is_torch,
    shares_storage,
    tensor_crc,
)
from astraflow.weights.codec import apply_delta_chunks, decode_full, undo_delta_chunks
from astraflow.weights.format import (
    KIND_TENSOR,
    KIND_TRAILER,
    OP_DELTA,
    OP_FULL,
    StreamHeader,
    StreamTrailer,
    TensorRecord,
    unframe,
)

_MISSING = object()


class NonFiniteWeightsRefused(DeltaFormatError):
    """A payload that passes its checksums but gives NaN or infinite weights: refused, rolled back
    (a version with them would make a node serve garbage log-probabilities)."""


_FINITE_CHUNK = 1 << 22  # elements checked at once: the mask stays 4 MiB, not one byte per weight


def all_finite(value: Any) -> bool:
    """Whether a floating tensor (torch or numpy) holds only finite values (others: True)."""
    if is_torch(value):
        import torch

        if not value.is_floating_point() or value.numel() == 0:
            return True
        flat = value.reshape(-1)
        return all(bool(torch.isfinite(flat[i : i + _FINITE_CHUNK]).all()) for i in range(0, flat.numel(), _FINITE_CHUNK))
    import numpy as np

    arr = np.asarray(value)
    return not np.issubdtype(arr.dtype, np.floating) or bool(np.isfinite(arr).all())


def check_finite_tensors(state: Any, names: Iterable[str]) -> None:
    """Raise NonFiniteWeightsRefused naming the first of `names` in `state` that is not finite."""
    for name in names:
        if name in state and not all_finite(state[name]):
            raise NonFiniteWeightsRefused(f"tensor {name!r} holds NaN or infinity: the version is refused")


@dataclass(frozen=True)
class AppliedStream:
    """What `apply_blocks` read and produced."""

    header: StreamHeader  # the stream's header
    trailer: StreamTrailer  # the stream's trailer
    manifest: StateManifest  # manifest of the resulting state (verified against trailer.checksum)


def apply_blocks(
    state: MutableMapping[str, Any],
    blocks: Iterable[bytes | memoryview],
    base: StateManifest,
    *,
    inplace: bool,
    prefer_torch: bool | None = None,
    admit: Callable[[TensorRecord], None] | None = None,
    finite: bool = False,
    keep: Collection[str] = (),
) -> AppliedStream:
    """Apply a stream to `state` (whose manifest is `base`), all or nothing.

    `finite`: also refuse (and roll back) a stream that leaves NaN or infinity in a tensor it
    touched (a follower's rule; the codec itself is exact on any bit pattern).

    New tensor objects are torch tensors if `prefer_torch` (default: if any tensor in `state`
    is one, or `state` is empty) and numpy arrays otherwise (torch anyway for bf16 / fp8).
    `admit`, if given, sees every tensor record before it is decoded and raises a
    `WeightsError` to refuse it (a follower checks names, shapes and sizes against its model).
    `keep`: with `inplace`, names of tensors never to patch in place (a changed one is decoded
    into a copy that replaces it in `state`; the old object keeps its bits).
    """
    if prefer_torch is None:
        prefer_torch = not state or any(is_torch(v) for v in state.values())
    undo: list[Callable[[], None]] = []
    try:
        return _apply(state, iter(blocks), base, inplace, prefer_torch, undo, admit, finite, keep)
    except (struct.error, ValueError, IndexError, OverflowError) as exc:
        _rollback(undo)
        raise DeltaFormatError(f"the delta is malformed ({exc}); fetch a snapshot") from exc
    except BaseException:
        _rollback(undo)
        raise


def _rollback(undo: list[Callable[[], None]]) -> None:
    for step in reversed(undo):
        step()


def _apply(
    state: MutableMapping[str, Any],
    blocks: Iterator[bytes | memoryview],
    base: StateManifest,
    inplace: bool,
    prefer_torch: bool,
    undo: list[Callable[[], None]],
    admit: Callable[[TensorRecord], None] | None,
    finite: bool = False,
    keep: Collection[str] = (),
) -> AppliedStream:
    header = StreamHeader.of_first_block(next(blocks, None))
    if header.base_checksum != base.checksum():
        raise DeltaBaseMismatchError(
            f"delta {header.base_version} -> {header.version} was encoded against other weights than "
            "these (base checksum differs); apply it to its base version or load a snapshot"
        )
    manifest = StateManifest(base)
    n_blocks = 0
    touched: list[str] = []
    for block in blocks:
        kind, body = unframe(block)
        if kind == KIND_TRAILER:
            trailer = StreamTrailer.parse(body)
            break
        if kind != KIND_TENSOR:
            raise DeltaFormatError(f"unexpected block kind {kind} inside a delta stream")
        n_blocks += 1
        record = TensorRecord.parse(body)
        if admit is not None:
            admit(record)
        _apply_record(state, manifest, record, body, header.chunk_elems, inplace and record.name not in keep,
                      prefer_torch, undo)
        touched.append(record.name)
    else:
        raise DeltaFormatError(
            "the delta stream ended without its trailer: it is truncated; fetch a snapshot"
        )
    if next(blocks, None) is not None:
        raise DeltaFormatError("blocks follow the delta trailer")
    if trailer.n_tensor_blocks != n_blocks:
        raise DeltaChecksumError(
            f"the delta lost tensor blocks ({n_blocks} of {trailer.n_tensor_blocks}); fetch a snapshot"
        )
    if manifest.checksum() != trailer.checksum:
        raise DeltaChecksumError(
            f"version {header.version} does not match its checksum after applying; fetch a snapshot"
        )
    if finite:  # a signed, well-formed version may still be poison
        check_finite_tensors(state, touched)
    return AppliedStream(header, trailer, manifest)


def _replace(state: MutableMapping[str, Any], name: str, value: Any, undo: list[Callable[[], None]]) -> None:
    old = state.get(name, _MISSING)

    def restore() -> None:
        if old is _MISSING:
            state.pop(name, None)
        else:
            state[name] = old

    undo.append(restore)
    if value is _MISSING:
        del state[name]
    else:
        state[name] = value


def _apply_record(
    state: MutableMapping[str, Any],
    manifest: StateManifest,
    record: TensorRecord,
    body: memoryview,
    chunk_elems: int,
    inplace: bool,
    prefer_torch: bool,
    undo: list[Callable[[], None]],
) -> None:
    name = record.name
    entry = manifest.get(name)
    if record.op == OP_FULL:
        bits = decode_full(
            body,
            record.chunks_offset,
            record.n_chunks,
            record.meta.numel,
            record.meta.dtype.itemsize,
            chunk_elems,
        )
        crc = tensor_crc(bits)
        if crc != record.new_crc:
            raise DeltaChecksumError(
                f"tensor {name!r} does not match its crc32 after decoding; fetch a snapshot"
            )
        like_torch = is_torch(state[name]) if name in state else prefer_torch
        _replace(state, name, from_bits(bits, record.meta, like_torch=like_torch), undo)
        manifest[name] = TensorEntry(record.meta, crc)
        return
    if entry is None or name not in state or entry.crc != record.base_crc or entry.meta != record.meta:
        raise DeltaBaseMismatchError(
            f"tensor {name!r} in these weights is not the one the delta was encoded against "
            "(missing, or dtype/shape/crc32 differ); load a snapshot"
        )
    if record.op != OP_DELTA:  # OP_REMOVE
        _replace(state, name, _MISSING, undo)
        del manifest[name]
        return
    current = state[name]
    meta, bits = bit_view(current)
    if meta != record.meta:
        raise DeltaBaseMismatchError(
            f"tensor {name!r} has dtype/shape {meta}, the delta expects {record.meta}"
        )
    if inplace and not shares_storage(current, bits):
        raise DeltaFormatError(
            f"tensor {name!r} is not a contiguous CPU tensor, so it cannot be patched in place"
        )
    if not inplace:
        bits = bits.copy()
    offset, n_chunks = record.chunks_offset, record.n_chunks
    progress = [0]
    try:
        crc = apply_delta_chunks(bits, body, offset, n_chunks, chunk_elems, progress)
        if crc != record.new_crc:
            raise DeltaChecksumError(
                f"tensor {name!r} does not match its crc32 after applying the delta; fetch a snapshot"
            )
    except BaseException:
        if inplace:
            undo_delta_chunks(bits, body, offset, progress[0], chunk_elems)
        raise
    if inplace:
        undo.append(lambda: undo_delta_chunks(bits, body, offset, n_chunks, chunk_elems))
    else:
        _replace(state, name, from_bits(bits, meta, like_torch=is_torch(current)), undo)
    manifest[name] = TensorEntry(meta, crc)
