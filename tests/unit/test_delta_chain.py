"""Unit tests of the receiver side: WeightChain over real Adam updates, snapshots, fallbacks."""

from __future__ import annotations

import os
from collections.abc import Callable, Iterator, Mapping

import numpy as np
import pytest
import torch

from astraflow.errors import DeltaBaseMismatchError, DeltaChecksumError, WeightsError
from astraflow.weights import (
    ApplyStatus,
    SparseDelta,
    StateManifest,
    WeightChain,
    encode,
    iter_encode,
    load_snapshot,
    snapshot,
)
from astraflow.weights.format import TensorRecord, frame, unframe

pytestmark = pytest.mark.unit


def bits(x: torch.Tensor | np.ndarray) -> bytes:
    if isinstance(x, np.ndarray):
        return x.tobytes() + str(x.dtype).encode()
    return x.contiguous().reshape(-1).view(torch.uint8).numpy().tobytes() + str((x.shape, x.dtype)).encode()


def assert_same(a: dict, b: dict) -> None:
    assert a.keys() == b.keys()
    for name in a:
        assert bits(a[name]) == bits(b[name]), name


def frozen(state: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    return {k: v.clone() for k, v in state.items()}


@pytest.fixture
def trainer() -> Iterator[Iterator[dict[str, torch.Tensor]]]:
    """A tiny model trained with Adam (lr 1e-5) in fp32, yielding its bf16 publication per step."""
    before = os.environ.get("TORCHINDUCTOR_CACHE_DIR")  # set by torch.optim's dynamo import

    def run() -> Iterator[dict[str, torch.Tensor]]:
        torch.manual_seed(0)
        model = torch.nn.Sequential(
            torch.nn.Linear(64, 128), torch.nn.GELU(), torch.nn.LayerNorm(128), torch.nn.Linear(128, 16)
        )
        opt = torch.optim.Adam(model.parameters(), lr=1e-5)
        while True:
            yield {k: v.detach().to(torch.bfloat16) for k, v in model.state_dict().items()}
            x = torch.randn(32, 64)
            opt.zero_grad()
            torch.nn.functional.cross_entropy(model(x), torch.randint(0, 16, (32,))).backward()
            opt.step()

    yield run()
    if before is None:
        os.environ.pop("TORCHINDUCTOR_CACHE_DIR", None)
    else:
        os.environ["TORCHINDUCTOR_CACHE_DIR"] = before


def publish(trainer: Iterator[dict], n: int) -> tuple[list[dict], list[SparseDelta]]:
    """Versions 0..n and the deltas v-1 -> v, as a publisher with a cached manifest makes them."""
    versions = [next(trainer)]
    deltas: list[SparseDelta] = []
    manifest = StateManifest.of(versions[0])
    for v in range(1, n + 1):
        versions.append(next(trainer))
        delta = encode(versions[v - 1], versions[v], base_version=v - 1, version=v, base_manifest=manifest)
        deltas.append(delta)
        manifest = delta.manifest
    return versions, deltas


def test_chain_of_20_deltas_reproduces_the_trainer_bit_for_bit(trainer: Iterator[dict]) -> None:
    versions, deltas = publish(trainer, 20)
    chain = WeightChain()
    assert chain.load_snapshot(snapshot(versions[0], 0)).status is ApplyStatus.APPLIED
    for v, delta in enumerate(deltas, start=1):
        assert delta.trailer.n_changed > 0
        result = chain.apply_delta(v, delta.to_bytes())
        assert result.status is ApplyStatus.APPLIED, result.reason
        assert chain.version == v
        assert_same(dict(chain.state), versions[v])
        assert chain.checksum == StateManifest.of(versions[v]).checksum()


def test_stale_and_missing_versions(trainer: Iterator[dict]) -> None:
    versions, deltas = publish(trainer, 3)
    chain = WeightChain.from_state(versions[0], 0)
    assert chain.apply_delta(1, deltas[0]).status is ApplyStatus.APPLIED
    again = chain.apply_delta(1, deltas[0])
    assert again.status is ApplyStatus.STALE and chain.version == 1
    gap = chain.apply_delta(3, deltas[2])  # version 2 never arrived
    assert gap.status is ApplyStatus.SNAPSHOT_NEEDED and "missing versions" in gap.reason
    assert chain.version == 1
    assert_same(dict(chain.state), versions[1])
    assert chain.load_snapshot(snapshot(versions[2], 2)).status is ApplyStatus.APPLIED
    assert chain.apply_delta(3, deltas[2]).status is ApplyStatus.APPLIED
    assert_same(dict(chain.state), versions[3])


def test_empty_chain_asks_for_a_snapshot(trainer: Iterator[dict]) -> None:
    _, deltas = publish(trainer, 1)
    result = WeightChain().apply_delta(1, deltas[0])
    assert result.status is ApplyStatus.SNAPSHOT_NEEDED and result.version is None


def _retamper(delta: SparseDelta, index: int, edit: Callable[[bytearray], bytes]) -> list[bytes]:
    """Change block `index` behind a valid frame crc, as a codec bug or a bad relay would."""
    blocks = list(delta.blocks)
    kind, body = unframe(blocks[index])
    blocks[index] = frame(kind, edit(bytearray(body)))
    return blocks


def _flip_last_byte(body: bytearray) -> bytes:
    body[-2] ^= 0x10
    return bytes(body)


def _wrong_tensor_crc(body: bytearray) -> bytes:
    record = TensorRecord.parse(memoryview(bytes(body)))
    body[record.chunks_offset - 16] ^= 0xFF  # new_crc:u32 precedes n_changed:u64, n_chunks:u32
    return bytes(body)


@pytest.mark.parametrize(
    "damage", ["bytes", "last_tensor", "tensor_crc", "trailer_checksum", "truncated", "version"]
)
def test_a_bad_delta_never_leaves_wrong_weights(trainer: Iterator[dict], damage: str) -> None:
    versions, deltas = publish(trainer, 2)
    chain = WeightChain.from_state(versions[0], 0)
    assert chain.apply_delta(1, deltas[0]).status is ApplyStatus.APPLIED
    delta = deltas[1]
    assert delta.trailer.n_tensor_blocks >= 2  # so the damage comes after other tensors were applied
    if damage == "bytes":
        data = bytearray(delta.to_bytes())
        data[len(data) // 3] ^= 0xFF
        bad = bytes(data)
    elif damage == "last_tensor":
        bad = _retamper(delta, len(delta.blocks) - 2, _flip_last_byte)
    elif damage == "tensor_crc":  # decodes fine, then fails its crc32: undone in place
        bad = _retamper(delta, len(delta.blocks) - 2, _wrong_tensor_crc)
    elif damage == "trailer_checksum":
        bad = _retamper(delta, len(delta.blocks) - 1, _flip_last_byte)
    elif damage == "truncated":
        bad = iter(delta.blocks[:-1])  # a stream that stops before its trailer
    else:
        bad = delta
    result = chain.apply_delta(3 if damage == "version" else 2, bad)
    assert result.status is ApplyStatus.SNAPSHOT_NEEDED, damage
    assert chain.version == 1
    assert_same(dict(chain.state), versions[1])  # rolled back exactly, in place
    assert chain.checksum == StateManifest.of(versions[1]).checksum()
    # The fallback path: a snapshot of version 2, then deltas again.
    assert chain.load_snapshot(snapshot(versions[2], 2)).status is ApplyStatus.APPLIED
    assert_same(dict(chain.state), versions[2])


def test_checksum_failure_reports_the_error(trainer: Iterator[dict]) -> None:
    versions, deltas = publish(trainer, 1)
    chain = WeightChain.from_state(versions[0], 0)
    result = chain.apply_delta(1, _retamper(deltas[0], len(deltas[0].blocks) - 1, _flip_last_byte))
    assert isinstance(result.error, DeltaChecksumError)


def test_delta_for_other_weights_with_the_same_version_number(trainer: Iterator[dict]) -> None:
    versions, deltas = publish(trainer, 1)
    other = frozen(versions[0])
    first = next(iter(other))
    other[first].view(torch.int16).view(-1)[0] += 1
    chain = WeightChain.from_state(other, 0)
    result = chain.apply_delta(1, deltas[0])
    assert result.status is ApplyStatus.SNAPSHOT_NEEDED
    assert isinstance(result.error, DeltaBaseMismatchError)
    assert_same(dict(chain.state), other)


def test_streamed_blocks_into_the_chain(trainer: Iterator[dict]) -> None:
    v0, v1 = next(trainer), next(trainer)
    chain = WeightChain.from_state(v0, 0)
    result = chain.apply_delta(1, iter_encode(v0, v1, base_version=0, version=1))
    assert result.status is ApplyStatus.APPLIED
    assert_same(dict(chain.state), v1)


def test_chain_owns_its_weights(trainer: Iterator[dict]) -> None:
    versions, deltas = publish(trainer, 1)
    source = frozen(versions[0])
    chain = WeightChain.from_state(source, 0)
    chain.apply_delta(1, deltas[0])
    assert_same(source, versions[0])  # the caller's tensors were copied, not patched


@pytest.mark.parametrize("compress", [True, False])
def test_snapshot_round_trip_all_dtypes(compress: bool) -> None:
    gen = torch.Generator().manual_seed(0)
    state = {
        "bf16": torch.randn(333, 7, generator=gen).to(torch.bfloat16),
        "fp16": torch.randn(1000, generator=gen).half(),
        "fp32": torch.tensor([float("nan"), float("-inf"), -0.0, 1e-45]),
        "i64": torch.arange(10),
        "empty": torch.zeros(0, 4),
        "scalar": torch.tensor(3.0),
    }
    data = snapshot(state, 7, compress=compress)
    snap = load_snapshot(data)
    assert snap.version == 7
    assert_same(snap.state, state)
    assert snap.manifest.checksum() == StateManifest.of(state).checksum()
    if compress:
        assert len(data) < sum(t.numel() * t.element_size() for t in state.values())


def test_corrupted_snapshot_is_refused_and_old_weights_kept(trainer: Iterator[dict]) -> None:
    v0, v1 = next(trainer), next(trainer)
    chain = WeightChain.from_state(v0, 0)
    data = bytearray(snapshot(v1, 1))
    data[len(data) // 2] ^= 0x01
    with pytest.raises(WeightsError):
        load_snapshot(bytes(data))
    result = chain.load_snapshot(bytes(data))
    assert result.status is ApplyStatus.SNAPSHOT_NEEDED and chain.version == 0
    assert_same(dict(chain.state), v0)


def test_a_delta_is_not_a_snapshot(trainer: Iterator[dict]) -> None:
    v0 = next(trainer)
    with pytest.raises(WeightsError, match="not a snapshot"):
        load_snapshot(encode({}, v0).to_bytes())


def test_lent_weights_never_change_and_only_changed_tensors_are_copied(trainer: Iterator[dict]) -> None:
    """What `lend` hands an engine keeps its version's bits through later deltas, good or bad; the
    chain copies a lent tensor only when a delta changes it, and patches the others in place."""
    versions, deltas = publish(trainer, 3)
    chain = WeightChain()
    chain.load_snapshot(snapshot(versions[0], 0))
    lent0 = chain.lend()
    assert all(lent0[k] is chain.state[k] for k in lent0)  # not a copy
    assert chain.apply_delta(1, deltas[0]).status is ApplyStatus.APPLIED
    assert_same(lent0, versions[0])
    assert_same(dict(chain.state), versions[1])
    for k in lent0:  # a new tensor exactly where the delta changed one
        assert (chain.state[k] is lent0[k]) == (bits(versions[0][k]) == bits(versions[1][k])), k
    assert any(chain.state[k] is not lent0[k] for k in lent0)
    held = dict(chain.state)
    assert chain.apply_delta(2, deltas[1]).status is ApplyStatus.APPLIED
    copied_again = {k for k in held if chain.state[k] is not held[k]}
    assert copied_again <= {k for k in held if held[k] is lent0[k]}  # only tensors still lent to the engine
    assert_same(lent0, versions[0])
    assert_same(dict(chain.state), versions[2])
    lent2 = chain.lend()
    bad = _retamper(deltas[2], len(deltas[2].blocks) - 1, _flip_last_byte)  # fails after every tensor was applied
    assert chain.apply_delta(3, bad).status is ApplyStatus.SNAPSHOT_NEEDED
    assert all(chain.state[k] is lent2[k] for k in lent2)  # the rollback restored the lent objects
    assert_same(lent2, versions[2])
    assert chain.apply_delta(3, deltas[2]).status is ApplyStatus.APPLIED
    assert_same(lent2, versions[2])
    assert_same(lent0, versions[0])
    assert_same(dict(chain.state), versions[3])
