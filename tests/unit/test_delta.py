"""Unit tests of the sparse weight-delta codec: bit-exact round trips, layout changes, errors."""

from __future__ import annotations

import os
from collections.abc import Callable, Iterator

import numpy as np
import pytest
import torch

from astraflow.errors import (
    AstraflowError,
    DeltaBaseMismatchError,
    DeltaChecksumError,
    DeltaFormatError,
    WeightsError,
)
from astraflow.weights import SparseDelta, StateManifest, apply, apply_stream, encode, iter_encode
from astraflow.weights.format import (
    KIND_TENSOR,
    OP_DELTA,
    OP_FULL,
    OP_REMOVE,
    TensorRecord,
    frame,
    unframe,
)

pytestmark = pytest.mark.unit

FLOAT_DTYPES = [torch.bfloat16, torch.float16, torch.float32]
INT_OF = {torch.bfloat16: torch.int16, torch.float16: torch.int16, torch.float32: torch.int32}


def bits(x: torch.Tensor | np.ndarray) -> bytes:
    """The raw bit pattern of a tensor, for exact comparison (NaN == NaN here)."""
    if isinstance(x, np.ndarray):
        return x.tobytes()
    return (
        x.contiguous().reshape(-1).view(torch.uint8).numpy().tobytes()
        + str(tuple(x.shape)).encode()
        + str(x.dtype).encode()
    )


def assert_same(a: dict, b: dict) -> None:
    assert a.keys() == b.keys()
    for name in a:
        assert bits(a[name]) == bits(b[name]), name


def random_bits(shape: tuple[int, ...], dtype: torch.dtype, gen: torch.Generator) -> torch.Tensor:
    """Every bit pattern is possible: NaNs with payloads, infinities, subnormals, -0.0."""
    idt = INT_OF[dtype]
    info = torch.iinfo(idt)
    raw = torch.randint(info.min, info.max, shape, dtype=torch.int64, generator=gen).to(idt)
    return raw.view(dtype)


def specials(dtype: torch.dtype) -> torch.Tensor:
    vals = torch.tensor([0.0, -0.0, float("inf"), float("-inf"), float("nan"), 1.0, -1.0], dtype=dtype)
    nan_payload = torch.tensor([-1], dtype=INT_OF[dtype]).view(dtype)  # all-ones NaN
    tiny = torch.tensor([1], dtype=INT_OF[dtype]).view(dtype)  # smallest subnormal
    return torch.cat([vals, nan_payload, tiny, -tiny])


@pytest.mark.parametrize("dtype", FLOAT_DTYPES)
def test_round_trip_is_bit_exact_on_random_bit_patterns(dtype: torch.dtype) -> None:
    gen = torch.Generator().manual_seed(1)
    prev = {"w": random_bits((300, 70), dtype, gen), "s": specials(dtype)}
    new = {k: v.clone() for k, v in prev.items()}
    w = new["w"].view(INT_OF[dtype]).view(-1)
    pick = torch.randperm(w.numel(), generator=gen)
    w[pick[:2000]] += 1  # one-ulp steps, wrapping at the integer edges
    w[pick[2000:2500]] -= 3
    w[pick[2500:3000]] = torch.randint(-100, 100, (500,), generator=gen).to(w.dtype)  # sign crossings
    w[pick[3000:3100]] = random_bits((100,), dtype, gen).view(w.dtype)
    new["s"] = new["s"].flip(0)  # NaN <-> inf <-> -0.0 swaps
    delta = encode(prev, new)
    assert_same(apply(prev, delta), new)
    assert_same(apply(prev, delta.to_bytes()), new)
    parsed = SparseDelta.from_bytes(delta.to_bytes())
    assert parsed.header == delta.header and parsed.trailer == delta.trailer
    assert_same(apply(prev, parsed), new)
    assert delta.trailer.n_changed == sum(
        int((prev[k].view(INT_OF[dtype]) != new[k].view(INT_OF[dtype])).sum()) for k in prev
    )


@pytest.mark.parametrize("dtype", [np.float16, np.float32, np.float64, np.int64, np.int8, np.bool_])
def test_numpy_arrays_round_trip_and_stay_numpy(dtype: type) -> None:
    rng = np.random.default_rng(0)
    raw = rng.integers(0, 256, size=4096 * np.dtype(dtype).itemsize, dtype=np.uint8)
    if dtype is np.bool_:
        raw = raw & 1
    prev = {"a": raw.view(dtype).reshape(64, -1)}
    new_raw = raw.copy()
    new_raw[rng.choice(raw.size, 300, replace=False)] ^= 1
    new = {"a": new_raw.view(dtype).reshape(64, -1)}
    out = apply(prev, encode(prev, new))
    assert isinstance(out["a"], np.ndarray) and out["a"].dtype == np.dtype(dtype)
    assert_same(out, new)


@pytest.fixture
def torch_optim_env() -> Iterator[None]:
    """torch.optim imports torch._dynamo, which sets TORCHINDUCTOR_CACHE_DIR; undo that after
    (the leak guard in conftest.py fails tests that change the environment)."""
    before = os.environ.get("TORCHINDUCTOR_CACHE_DIR")
    yield
    if before is None:
        os.environ.pop("TORCHINDUCTOR_CACHE_DIR", None)
    else:
        os.environ["TORCHINDUCTOR_CACHE_DIR"] = before


@pytest.mark.usefixtures("torch_optim_env")
def test_real_adam_updates_published_in_bf16_round_trip_compactly() -> None:
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(256, 512), torch.nn.Tanh(), torch.nn.Linear(512, 256))
    opt = torch.optim.Adam(model.parameters(), lr=1e-5)
    x, y = torch.randn(64, 256), torch.randn(64, 256)
    prev = {k: v.detach().to(torch.bfloat16) for k, v in model.state_dict().items()}
    total_changed = total_bytes = 0
    for _ in range(4):
        opt.zero_grad()
        torch.nn.functional.mse_loss(model(x), y).backward()
        opt.step()
        new = {k: v.detach().to(torch.bfloat16) for k, v in model.state_dict().items()}
        delta = encode(prev, new)
        assert_same(apply(prev, delta), new)
        total_changed += delta.trailer.n_changed
        total_bytes += delta.nbytes
        prev = new
    assert total_changed > 0
    assert total_bytes / total_changed < 1.5  # the target; the 6-byte reference is 4x larger


def test_unchanged_weights_give_an_empty_delta() -> None:
    state = {"a": torch.randn(100, 10).to(torch.bfloat16), "b": torch.randn(3)}
    delta = encode(state, state)
    assert delta.trailer.n_tensor_blocks == 0 and delta.trailer.n_changed == 0
    assert len(delta.blocks) == 2  # header and trailer only
    out = apply(state, delta)
    assert out["a"] is state["a"]  # unchanged tensors are shared, not copied


def _records(delta: SparseDelta) -> dict[str, TensorRecord]:
    out = {}
    for block in delta.blocks[1:-1]:
        _, body = unframe(block)
        record = TensorRecord.parse(body)
        out[record.name] = record
    return out


def test_added_removed_reshaped_and_retyped_tensors_are_sent_whole() -> None:
    prev = {
        "keep": torch.randn(50).to(torch.bfloat16),
        "gone": torch.randn(5),
        "reshaped": torch.randn(4, 6),
        "retyped": torch.randn(10).half(),
    }
    new = {
        "keep": prev["keep"].clone(),
        "reshaped": prev["reshaped"].reshape(6, 4).clone(),
        "retyped": prev["retyped"].float(),
        "added": torch.randn(7, 3).to(torch.bfloat16),
    }
    new["keep"][0] += 1
    delta = encode(prev, new)
    ops = {name: r.op for name, r in _records(delta).items()}
    assert ops == {
        "keep": OP_DELTA,
        "reshaped": OP_FULL,
        "retyped": OP_FULL,
        "added": OP_FULL,
        "gone": OP_REMOVE,
    }
    assert_same(apply(prev, delta), new)


def test_empty_and_scalar_tensors() -> None:
    prev = {"empty": torch.zeros(0, 3), "scalar": torch.tensor(1.5), "e2": torch.zeros(0).to(torch.bfloat16)}
    new = {
        "empty": torch.zeros(0, 3),
        "scalar": torch.tensor(-0.0),
        "e2": torch.zeros(0, 2).to(torch.bfloat16),
    }
    assert_same(apply(prev, encode(prev, new)), new)
    assert_same(apply({}, encode({}, new)), new)


@pytest.mark.parametrize("chunk_elems", [1, 7, 64, 1 << 20])
def test_chunk_boundaries_and_wide_gaps(chunk_elems: int) -> None:
    n = (1 << 17) + 5
    prev = {"w": torch.zeros(n, dtype=torch.float32)}
    new = {"w": prev["w"].clone()}
    new["w"][[0, 1, 6, 7, 63, 64, 65, 70_000, n - 1]] = torch.tensor([1.0, -2.0, 3e38, -1e-45, 5, 6, 7, 8, 9])
    delta = encode(prev, new, chunk_elems=chunk_elems)
    assert_same(apply(prev, delta), new)


def test_streaming_encode_yields_one_block_per_changed_tensor() -> None:
    prev = {f"t{i}": torch.randn(1000).to(torch.bfloat16) for i in range(5)}
    new = {k: v.clone() for k, v in prev.items()}
    for name in ("t1", "t3"):
        new[name].view(torch.int16)[::10] += 1
    manifest = StateManifest()
    blocks = iter_encode(prev, new, base_version=4, version=5, out_manifest=manifest)
    first = next(blocks)  # lazy: the header comes before any tensor is encoded
    rest = list(blocks)
    assert len(rest) == 3  # t1, t3, trailer
    assert_same(apply_stream(prev, iter([first, *rest])), new)
    assert manifest.checksum() == StateManifest.of(new).checksum()


def test_apply_leaves_prev_untouched() -> None:
    prev = {"w": torch.randn(1000).to(torch.bfloat16)}
    before = bits(prev["w"])
    new = {"w": prev["w"] * 2}
    apply(prev, encode(prev, new))
    assert bits(prev["w"]) == before


def test_wrong_base_is_refused() -> None:
    prev = {"w": torch.randn(100)}
    other = {"w": prev["w"].clone()}
    other["w"][5] += 1
    delta = encode(prev, {"w": prev["w"] + 1})
    with pytest.raises(DeltaBaseMismatchError):
        apply(other, delta)


def _tamper(delta: SparseDelta, block: int, edit: Callable[[bytearray], bytes]) -> list[bytes]:
    """Re-frame block `block` with `edit(body)`: passes the block crc, so deeper checks must catch it."""
    blocks = list(delta.blocks)
    kind, body = unframe(blocks[block])
    blocks[block] = frame(kind, edit(bytearray(body)))
    return blocks


def _small_delta() -> tuple[dict, dict, SparseDelta]:
    gen = torch.Generator().manual_seed(3)
    prev = {"a": torch.randn(5000, generator=gen).to(torch.bfloat16), "b": torch.randn(3000, generator=gen)}
    new = {"a": prev["a"].clone(), "b": prev["b"].clone()}
    new["a"].view(torch.int16)[::7] += 1
    new["b"].view(torch.int32)[::5] -= 9
    return prev, new, encode(prev, new)


def test_corrupted_bytes_fail_the_block_checksum() -> None:
    prev, _, delta = _small_delta()
    data = bytearray(delta.to_bytes())
    data[len(data) // 2] ^= 0x40
    with pytest.raises(DeltaChecksumError):
        apply(prev, bytes(data))


def test_corruption_behind_a_valid_frame_is_caught() -> None:
    prev, _, delta = _small_delta()

    def flip_payload(body: bytearray) -> bytes:
        body[-3] ^= 0x01  # inside the last zstd frame
        return bytes(body)

    def wrong_crc(body: bytearray) -> bytes:
        record = TensorRecord.parse(memoryview(bytes(body)))
        pos = record.chunks_offset - 16  # new_crc:u32 sits before n_changed:u64 and n_chunks:u32
        body[pos] ^= 0xFF
        assert TensorRecord.parse(memoryview(bytes(body))).new_crc != record.new_crc
        return bytes(body)

    for edit in (flip_payload, wrong_crc):
        with pytest.raises(WeightsError):
            apply(prev, _tamper(delta, 1, edit))
    with pytest.raises(DeltaChecksumError):
        apply(prev, _tamper(delta, 1, wrong_crc))


def test_truncated_and_reordered_streams_are_refused() -> None:
    prev, _, delta = _small_delta()
    blocks = list(delta.blocks)
    with pytest.raises(DeltaFormatError, match="truncated"):
        apply(prev, blocks[:-1])  # trailer lost
    with pytest.raises(DeltaChecksumError, match="lost tensor blocks"):
        apply(prev, [blocks[0], blocks[2], blocks[3]])  # a tensor block lost
    with pytest.raises(DeltaFormatError):
        apply(prev, blocks[1:])  # header lost
    with pytest.raises(DeltaFormatError):
        apply(prev, delta.to_bytes()[:-5])
    with pytest.raises(DeltaFormatError, match="magic"):
        apply(prev, b"PK\x03\x04" + bytes(40))


def test_unsupported_values_say_what_to_do() -> None:
    with pytest.raises(DeltaFormatError, match="not supported"):
        encode({}, {"c": torch.zeros(3, dtype=torch.complex64)})
    with pytest.raises(DeltaFormatError, match="torch tensor or numpy array"):
        encode({}, {"l": [1.0, 2.0]})


def test_errors_share_the_astraflow_root() -> None:
    for cls in (DeltaFormatError, DeltaChecksumError, DeltaBaseMismatchError):
        assert issubclass(cls, WeightsError) and issubclass(cls, AstraflowError)
        assert cls.__doc__


def test_tensor_block_kind_is_checked() -> None:
    prev, _, delta = _small_delta()
    blocks = list(delta.blocks)
    blocks.insert(1, frame(KIND_TENSOR + 10, b""))
    with pytest.raises(DeltaFormatError, match="unexpected block kind"):
        apply(prev, blocks)
