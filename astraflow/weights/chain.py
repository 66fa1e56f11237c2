"""Receiver side of weight publication: current weights + version, advanced delta by delta.

An inference worker keeps one `WeightChain`. It starts from a snapshot, then applies each
published delta in order. Whatever arrives, the chain never holds wrong weights:

- a delta for a version it already has -> ``STALE``, nothing done;
- a delta whose base is not the current version (a version was missed) -> ``SNAPSHOT_NEEDED``;
- a delta that fails any check (corrupt bytes, wrong base checksum, tensor crc32, version
  sha256) -> rolled back exactly, ``SNAPSHOT_NEEDED`` with the error attached;
- a payload that does not fit the served model (`layout`: tensor names, shapes, dtypes; a
  snapshot must cover every tensor) or would decode to more than `max_state_bytes` ->
  refused before the offending tensor is decoded, ``SNAPSHOT_NEEDED`` with the error;
- with `require_finite` (every follower), a payload that gives NaN or infinite weights -> refused (a delta rolled back), ``SNAPSHOT_NEEDED``
  with the error;
- otherwise ``APPLIED`` and `version` moves on.

Deltas are patched into the chain's own buffers in place (no second copy of the weights); see
`astraflow.weights.transaction` for how the rollback stays exact. `lend()` hands the current
tensors to a reader that keeps them (an inference engine loads them later, from another
thread): no copy then; a later delta that changes a lent tensor decodes it into a fresh one
instead of patching it, so what was lent never changes. Not thread-safe otherwise: a reader
of `state` must not use it while `apply_delta` runs.
"""

from __future__ import annotations

import enum
import itertools
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from types import MappingProxyType
from typing import Any

import numpy as np

from astraflow.errors import WeightsError
from astraflow.weights.bits import StateManifest, is_torch
from astraflow.weights.delta import SparseDelta
from astraflow.weights.format import OP_FULL, StreamHeader, TensorRecord, split_blocks
from astraflow.weights.layout import ModelLayout, WeightLayoutError
from astraflow.weights.snapshot import load_snapshot
from astraflow.weights.transaction import apply_blocks, check_finite_tensors


class ApplyStatus(enum.Enum):
    """Outcome of `WeightChain.apply_delta` / `load_snapshot`."""

    APPLIED = "applied"  # the chain moved to the new version
    STALE = "stale"  # the chain already has this version or a newer one; nothing changed
    SNAPSHOT_NEEDED = "snapshot_needed"  # cannot advance by deltas; weights unchanged
    REFUSED = "refused"  # the record itself breaks a rule (a version number reused or going back); unchanged


@dataclass(frozen=True)
class ApplyResult:
    """What one call did."""

    status: ApplyStatus  # see ApplyStatus
    version: int | None  # the chain's version after the call (None: no weights yet)
    reason: str = ""  # why, when not APPLIED
    error: WeightsError | None = None  # the verification error behind SNAPSHOT_NEEDED, if any


def _owned_copy(value: Any) -> Any:
    if is_torch(value):
        return value.detach().to("cpu", copy=True).contiguous()
    return np.array(value, copy=True, order="C")


class WeightChain:
    """Current weights and version of one receiver; see the module docstring."""

    def __init__(self, layout: ModelLayout | None = None, max_state_bytes: int | None = None,
                 require_finite: bool = False) -> None:
        self.require_finite = require_finite  # refuse versions with NaN / infinity (followers: on)
        self._state: dict[str, Any] = {}  # name -> tensor, owned (contiguous CPU)
        self._manifest = StateManifest()  # verified manifest of _state
        self._version: int | None = None  # None until a snapshot is loaded
        self.layout = layout  # the served model's tensors; None: any layout (bounded by max_state_bytes)
        self.max_state_bytes = max_state_bytes  # most bytes of new tensors one payload may decode to
        self._lent: set[str] = set()  # names whose current tensor `lend` handed out: never patched in place

    @classmethod
    def from_state(cls, state: Mapping[str, Any], version: int, layout: ModelLayout | None = None,
                   max_state_bytes: int | None = None) -> WeightChain:
        """Start from weights already in memory (copied, so the caller keeps its own)."""
        chain = cls(layout, max_state_bytes)
        chain._state = {name: _owned_copy(v) for name, v in state.items()}
        chain._manifest = StateManifest.of(chain._state)
        chain._version = version
        return chain

    @property
    def version(self) -> int | None:
        """The version held, or None before the first snapshot."""
        return self._version

    @property
    def checksum(self) -> bytes:
        """sha256 naming the version held (equal to the publisher's manifest checksum)."""
        return self._manifest.checksum()

    @property
    def state(self) -> Mapping[str, Any]:
        """Read-only view of the weights. The tensors are patched in place by `apply_delta`:
        copy them if you need them to stay fixed."""
        return MappingProxyType(self._state)

    def lend(self) -> dict[str, Any]:
        """The current tensors, not copied, for a reader that may keep them (an engine that loads
        them asynchronously): the chain never writes into them again (a delta that changes one
        gives the chain a new tensor). Costs a copy of each changed tensor per delta applied
        after it, instead of a copy of the whole state per version."""
        self._lent = set(self._state)
        return dict(self._state)

    def _admit(self) -> Callable[[TensorRecord], None]:
        """Checks each tensor record before it is decoded: the model's layout, and the byte budget."""
        left = [self.max_state_bytes]

        def admit(record: TensorRecord) -> None:
            if self.layout is not None:
                self.layout.check_record(record)
            if record.op == OP_FULL and left[0] is not None:
                left[0] -= record.meta.numel * record.meta.dtype.itemsize
                if left[0] < 0:
                    raise WeightLayoutError(
                        f"the payload decodes to more than {self.max_state_bytes:,} bytes of tensors "
                        "(weights.max_state_bytes)"
                    )

        return admit

    def load_snapshot(self, data: bytes | memoryview | Iterable[bytes]) -> ApplyResult:
        """Replace the weights with a snapshot; on any error keep the old ones."""
        try:
            snap = load_snapshot(data, admit=self._admit())
            if self.layout is not None:
                self.layout.check_complete(snap.state)
            if self.require_finite:
                check_finite_tensors(snap.state, list(snap.state))
        except WeightsError as exc:
            return ApplyResult(ApplyStatus.SNAPSHOT_NEEDED, self._version, f"snapshot rejected: {exc}", exc)
        self._state, self._manifest, self._version = dict(snap.state), snap.manifest, snap.version
        self._lent = set()  # all new tensors
        return ApplyResult(ApplyStatus.APPLIED, self._version)

    def apply_delta(
        self, version: int, delta: SparseDelta | bytes | memoryview | Iterable[bytes]
    ) -> ApplyResult:
        """Advance to `version` by applying `delta` (all or nothing); see the module docstring."""
        if self._version is None:
            return ApplyResult(ApplyStatus.SNAPSHOT_NEEDED, None, "no weights yet: load a snapshot first")
        blocks: Iterable[bytes | memoryview]
        if isinstance(delta, SparseDelta):
            blocks = delta.blocks
        elif isinstance(delta, bytes | bytearray | memoryview):
            blocks = split_blocks(delta)
        else:
            blocks = delta
        it = iter(blocks)
        try:
            first = next(it, None)
            header = StreamHeader.of_first_block(first)
        except WeightsError as exc:
            return self._need_snapshot(f"delta for version {version} is unreadable: {exc}", exc)
        if header.version != version:
            return self._need_snapshot(f"delta says it produces version {header.version}, expected {version}")
        if version <= self._version:
            return ApplyResult(ApplyStatus.STALE, self._version, f"already at version {self._version}")
        if header.base_version != self._version:
            return self._need_snapshot(
                f"missing versions: have {self._version}, delta goes {header.base_version} -> {version}"
            )
        lent = {name: self._state[name] for name in self._lent if name in self._state}
        try:
            applied = apply_blocks(
                self._state, itertools.chain([first], it), self._manifest, inplace=True, admit=self._admit(),
                finite=self.require_finite, keep=self._lent,
            )
        except WeightsError as exc:
            return self._need_snapshot(f"delta {header.base_version} -> {version} rejected: {exc}", exc)
        # still lent: the tensors the delta did not replace
        self._lent = {name for name, t in lent.items() if self._state.get(name) is t}
        self._manifest, self._version = applied.manifest, version
        return ApplyResult(ApplyStatus.APPLIED, version)

    def _need_snapshot(self, reason: str, error: WeightsError | None = None) -> ApplyResult:
        return ApplyResult(ApplyStatus.SNAPSHOT_NEEDED, self._version, reason, error)
