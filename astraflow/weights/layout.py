"""The layout of the model a follower serves: which tensors, of which shapes and dtypes.

A weight payload names its own tensors, shapes and dtypes, and a checksum that only proves the
payload is what its writer meant. So a follower also checks every tensor record against the
model it serves, BEFORE decoding it (a shape of 2**40 elements is refused before anything is
allocated): the name must be a tensor of the model, the shape must be the model's, the dtype
the model's or, for floating tensors, one of the published dtypes (bf16, fp16, fp32: the backend
casts); a version may not remove a tensor; and a snapshot must cover every tensor (a tied alias,
such as an output head sharing the embeddings' storage, is covered by any name of its group).
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Any

from astraflow.errors import WeightsError
from astraflow.weights.bits import TensorMeta, bit_view, is_torch
from astraflow.weights.format import OP_REMOVE, TensorRecord

FLOAT_DTYPES = frozenset({"bfloat16", "float16", "float32"})  # what a publisher may send for a float tensor


class WeightLayoutError(WeightsError):
    """Raised when a weight payload does not fit the served model: an unknown tensor name, another
    shape or dtype, a removed tensor, or a snapshot missing tensors. Check that the trainer and
    the node load the same model."""


@dataclass(frozen=True)
class ModelLayout:
    """Tensors of the served model and its tied groups."""

    tensors: Mapping[str, TensorMeta]  # name -> dtype and shape in the model
    groups: tuple[tuple[str, ...], ...]  # names sharing one storage (a single name when not tied)

    @classmethod
    def of(cls, state: Mapping[str, Any]) -> ModelLayout:
        """The layout of a state dict (torch tensors or numpy arrays)."""
        tensors: dict[str, TensorMeta] = {}
        groups: dict[Any, list[str]] = {}
        for name, value in state.items():
            meta, _ = bit_view(value)
            tensors[name] = meta
            if is_torch(value) and value.numel():
                ident: Any = (value.data_ptr(), tuple(value.shape), tuple(value.stride()))
            else:
                ident = name
            groups.setdefault(ident, []).append(name)
        return cls(tensors, tuple(tuple(g) for g in groups.values()))

    @property
    def nbytes(self) -> int:
        """Bytes of one copy of every tensor, at the widest published dtype."""
        return sum(m.numel * max(m.dtype.itemsize, 4) for m in self.tensors.values())

    def check_record(self, record: TensorRecord) -> None:
        """Raise `WeightLayoutError` unless `record` may change this model (see the module doc)."""
        want = self.tensors.get(record.name)
        if want is None:
            raise WeightLayoutError(f"tensor {record.name[:200]!r} is not a tensor of the served model")
        if record.op == OP_REMOVE:
            raise WeightLayoutError(f"the version removes tensor {record.name!r} of the served model")
        got = record.meta
        if got.shape != want.shape:
            raise WeightLayoutError(
                f"tensor {record.name!r} has shape {list(got.shape)[:8]} but the served model's is {list(want.shape)}"
            )
        same_kind = got.dtype == want.dtype or (got.dtype.name in FLOAT_DTYPES and want.dtype.name in FLOAT_DTYPES)
        if not same_kind:
            raise WeightLayoutError(
                f"tensor {record.name!r} is {got.dtype.name} but the served model holds {want.dtype.name}"
            )

    def check_complete(self, names: Iterable[str]) -> None:
        """Raise `WeightLayoutError` if a snapshot holding `names` leaves a tensor group out."""
        have = set(names)
        missing = [g[0] for g in self.groups if not have.intersection(g)]
        if missing:
            raise WeightLayoutError(
                f"the snapshot lacks {len(missing)} tensors of the served model (e.g. {missing[:3]})"
            )


__all__ = ["FLOAT_DTYPES", "ModelLayout", "WeightLayoutError"]
