"""Unit tests of the delta codec's dense chunks (every element changed, as an fp32 Adam step does):
the shortcut writes the very bytes of the general path, decodes bit-exactly and refuses what
the general path refuses."""

from __future__ import annotations

import numpy as np
import pytest
from backports import zstd

from astraflow.errors import DeltaFormatError
from astraflow.weights import apply, encode
from astraflow.weights.codec import ChunkEncoder, decode_delta_chunk, iter_delta_chunks

pytestmark = pytest.mark.unit

UINT = {2: np.uint16, 4: np.uint32}


def changed_everywhere(rng: np.random.Generator, n: int, itemsize: int, one_ulp: float) -> tuple[np.ndarray, np.ndarray]:
    """Two bit arrays that differ in every element: a share `one_ulp` by one ulp either way, the
    rest by anything (sign crossings and wrap-arounds included)."""
    dt = UINT[itemsize]
    old = rng.integers(0, np.iinfo(dt).max, n, dtype=dt, endpoint=True)
    step = rng.integers(2, np.iinfo(dt).max, n, dtype=dt, endpoint=True)  # never 0 or 1: a change
    small = rng.random(n) < one_ulp
    step[small] = np.where(rng.random(int(small.sum())) < 0.5, 1, np.iinfo(dt).max).astype(dt)  # +1 / -1
    return old, old + step  # wraps


@pytest.mark.parametrize("itemsize", [2, 4])
@pytest.mark.parametrize("one_ulp", [0.0, 0.85, 1.0])
def test_dense_chunks_are_the_bytes_of_the_general_path(itemsize: int, one_ulp: float) -> None:
    old, new = changed_everywhere(np.random.default_rng(3), 5000, itemsize, one_ulp)
    coder = ChunkEncoder()
    dense = coder._encode_chunk(7, None, old, new)
    assert dense == coder._encode_chunk(7, np.arange(new.size), old, new)
    records, k, _ = coder.encode(old, new)
    assert records == [coder._encode_chunk(0, np.arange(new.size), old, new)] and k == new.size
    (head, frame), = iter_delta_chunks(memoryview(dense), 0, 1)
    idx, diff = decode_delta_chunk(head, frame, itemsize, new.size)
    out = old.copy()
    out[idx] += diff
    assert out.tobytes() == new.tobytes()


@pytest.mark.parametrize("dtype", [np.float32, np.float16])
def test_dense_sparse_and_unchanged_chunks_of_one_tensor_round_trip(dtype: type) -> None:
    rng = np.random.default_rng(5)
    itemsize = np.dtype(dtype).itemsize
    old, new = changed_everywhere(rng, 4000, itemsize, 0.8)
    new[1000:2000] = old[1000:2000]  # the second chunk unchanged
    new[2000:3000] = old[2000:3000]
    new[2000:3000:7] += 1  # the third sparse; first and last dense
    prev = {"w": old.view(dtype).reshape(40, 100)}
    state = {"w": new.view(dtype).reshape(40, 100)}
    delta = encode(prev, state, chunk_elems=1000)
    assert delta.trailer.n_changed == int((old != new).sum())
    assert apply(prev, delta)["w"].tobytes() == state["w"].tobytes()
    assert apply(prev, delta.to_bytes())["w"].tobytes() == state["w"].tobytes()


def _chunk(k: int, n_big: int, gaps: bytes, flags: bytes, signs: bytes, mags: bytes) -> tuple[tuple[int, ...], memoryview]:
    payload = zstd.ZstdCompressor(level=1).compress(gaps + flags + signs + mags, zstd.ZstdCompressor.FLUSH_FRAME)
    return (0, k, n_big, 1, 1, len(payload)), memoryview(payload)


def test_dense_chunks_with_inconsistent_streams_are_refused() -> None:
    k = 16  # a chunk of 16 elements, all changed
    flags, signs, mags = b"\xff\xff", b"\x00\x00", bytes(k)
    head, frame = _chunk(k, k, bytes(k), flags, signs, mags)
    idx, diff = decode_delta_chunk(head, frame, 4, k)
    assert idx == slice(None) and diff.tolist() == [2] * k  # |d| - 2 = 0 for each: d = +2
    gap = bytearray(k)
    gap[5] = 1  # a gap in a chunk that changes every element points past its end
    with pytest.raises(DeltaFormatError, match="past the end"):
        decode_delta_chunk(*_chunk(k, k, bytes(gap), flags, signs, mags), 4, k)
    with pytest.raises(DeltaFormatError, match="flags do not match"):  # one flag unset, yet all k counted big
        decode_delta_chunk(*_chunk(k, k, bytes(k), b"\xff\xfe", signs, mags), 4, k)
    with pytest.raises(DeltaFormatError, match="flags do not match"):  # all set, one fewer counted
        decode_delta_chunk(*_chunk(k, k - 1, bytes(k), flags, signs, mags[:-1]), 4, k)
