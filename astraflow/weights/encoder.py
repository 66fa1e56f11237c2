"""Encoding policy versions (pure): state dicts in, payloads and PolicyVersion manifests out.

`VersionEncoder` turns successive state dicts into payloads in the published dtype: every
version a lossless sparse delta against the previous one (the first version of an encoder, which
has no previous one, a full snapshot), and, every `snapshot_every` versions and on request, also
a full snapshot of the same version, published beside the stream (`Publication.beside`): a
follower that holds the previous version applies the delta and never reads the snapshot; a
joining or recovering one loads the snapshot. Both carry the same state checksum: a version
number names one set of weights, whichever payload brought it. It refuses weights that are not finite
(`NonFiniteWeightsError`), so such a version is never published. `astraflow.weights.publish`
sends what it produces.
"""

from __future__ import annotations

import zlib
from collections.abc import Mapping
from dataclasses import dataclass, replace
from typing import Any

from astraflow.errors import WeightsError
from astraflow.records import PolicyVersion, WeightChunk, WeightKind
from astraflow.weights.bits import StateManifest
from astraflow.weights.delta import encode
from astraflow.weights.snapshot import snapshot as snapshot_bytes
from astraflow.weights.store import sha256_hex

DTYPES = ("bfloat16", "float16", "float32")


class NonFiniteWeightsError(WeightsError):
    """Raised when weights to publish hold NaN or infinity (in the published dtype: a float16
    overflow counts); nothing is published. Lower the learning rate or publish in bfloat16."""


@dataclass(frozen=True)
class PublishSettings:
    """How versions are encoded and where their payloads travel."""

    dtype: str = "bfloat16"  # published dtype (the trainer keeps its own fp32 master weights)
    snapshot_every: int = 20  # a snapshot after this many versions (deltas in between)
    chunk_bytes: int = 1024 * 1024 - 64 * 1024  # in-band chunk size, below the topic's max.message.bytes
    inband_max_bytes: int = 64 * 1024 * 1024  # larger payloads go to the store (when one is set)
    max_version_step: int = 1  # declared in every manifest: a delta moves at most this many versions

    def __post_init__(self) -> None:
        if self.dtype not in DTYPES:
            raise WeightsError(f"publish dtype {self.dtype!r} is not one of {', '.join(DTYPES)}")
        if self.snapshot_every < 1 or self.chunk_bytes < 1024 or self.max_version_step < 1:
            raise WeightsError("snapshot_every and max_version_step must be >= 1 and chunk_bytes >= 1024")


def published_state(state: Mapping[str, Any], dtype: str = "bfloat16") -> dict[str, Any]:
    """CPU copies of `state` in `dtype`; tied aliases (the same storage under a second name, e.g.
    ``lm_head.weight`` tied to the embeddings) are dropped, so load with ``strict=False``."""
    import torch

    target = getattr(torch, dtype)
    out: dict[str, Any] = {}
    seen: set[tuple[int, tuple[int, ...], tuple[int, ...]]] = set()
    for name, t in state.items():
        ident = (t.data_ptr(), tuple(t.shape), tuple(t.stride()))
        if t.numel() and ident in seen:
            continue
        seen.add(ident)
        cast = t.detach().to(device="cpu", dtype=target if t.is_floating_point() else t.dtype, copy=True)
        out[name] = cast.contiguous()
    return out


def check_finite(state: Mapping[str, Any]) -> None:
    """Raise NonFiniteWeightsError naming the first floating tensor that holds NaN or infinity."""
    import torch

    for name, t in state.items():
        if t.is_floating_point() and t.numel() and not bool(torch.isfinite(t).all()):
            raise NonFiniteWeightsError(f"weights {name!r} hold NaN or infinity; this version is not published")


def split_chunks(policy: str, version: int, payload: bytes, chunk_bytes: int) -> list[WeightChunk]:
    """Cut a payload into WeightChunks with a crc32 each (at least one chunk)."""
    n = max(1, -(-len(payload) // chunk_bytes))
    parts = [payload[i * chunk_bytes : (i + 1) * chunk_bytes] for i in range(n)]
    return [WeightChunk(policy, version, i, n, p, zlib.crc32(p)) for i, p in enumerate(parts)]


@dataclass
class Publication:
    """One encoded version, before it is sent."""

    manifest: PolicyVersion  # uri, snapshot offsets and num_chunks are filled in by the publisher
    payload: bytes  # what the stream carries: the delta (a snapshot for an encoder's first version)
    state: dict[str, Any]  # the published weights of this version (dtype of the settings)
    beside: tuple[PolicyVersion, bytes] | None = None  # a full snapshot of the same version, for joiners


class VersionEncoder:
    """Pure: state dicts in, `Publication`s out; remembers the previous published version."""

    def __init__(
        self, policy: str, settings: PublishSettings = PublishSettings(), next_version: int = 0
    ) -> None:
        self.policy = policy
        self.settings = settings
        self.next_version = next_version  # number the next publication gets
        self._prev: dict[str, Any] | None = None  # last published state (None: next is a snapshot)
        self._prev_manifest: StateManifest | None = None
        self._since_snapshot = 0  # versions published since the last snapshot

    @property
    def state(self) -> dict[str, Any] | None:
        """The last published weights, or None before the first (or after `reset`)."""
        return self._prev

    def reset(self) -> None:
        """Forget the previous version (e.g. a send failed), so the next publication is a snapshot."""
        self._prev = self._prev_manifest = None

    def encode(
        self,
        state: Mapping[str, Any],
        *,
        trainer_step: int = 0,
        trained_samples: int = 0,
        snapshot: bool = False,
        prepared: bool = False,
    ) -> Publication:
        """Encode `state` (any dtype, any device) as the next version; NonFiniteWeightsError (and
        no change to the encoder) if a published tensor is not finite. `prepared`: `state` is
        already what `published_state` returns in the settings' dtype and `check_finite` passed
        (the trainer's checkpointed copy): it is kept as is, not copied and checked again, so the
        caller must not change it afterwards."""
        version = self.next_version
        if prepared:
            new = dict(state)
            for name, t in new.items():
                if t.is_floating_point() and str(t.dtype).removeprefix("torch.") != self.settings.dtype:
                    raise WeightsError(f"prepared weights {name!r} are {t.dtype}, not the published {self.settings.dtype}")
                if t.device.type != "cpu" or not t.is_contiguous():
                    raise WeightsError(f"prepared weights {name!r} are not a contiguous CPU tensor")
        else:
            new = published_state(state, self.settings.dtype)
            check_finite(new)
        due = snapshot or self._prev is None or self._since_snapshot + 1 >= self.settings.snapshot_every
        record = payload = manifest = None
        if self._prev is not None:
            assert self._prev_manifest is not None
            delta = encode(
                self._prev, new, base_version=version - 1, version=version, base_manifest=self._prev_manifest
            )
            payload, manifest = delta.to_bytes(), delta.manifest or StateManifest.of(new)
            record = self._record(version, WeightKind.DELTA, version - 1, payload, manifest, trainer_step, trained_samples)
        beside = None
        if due:
            snap, snap_manifest = snapshot_bytes(new, version), StateManifest.of(new)
            if manifest is not None and snap_manifest.checksum() != manifest.checksum():
                raise WeightsError(f"version {version}: its delta and its snapshot name different weights")
            manifest = snap_manifest
            beside = (self._record(version, WeightKind.SNAPSHOT, None, snap, manifest, trainer_step, trained_samples), snap)
            if record is None:  # nothing to delta against: the stream carries the snapshot too
                record, payload = replace(beside[0]), snap
        assert record is not None and payload is not None and manifest is not None
        self._prev, self._prev_manifest = new, manifest
        self._since_snapshot = 0 if due else self._since_snapshot + 1
        self.next_version = version + 1
        return Publication(record, payload, new, beside)

    def _record(self, version: int, kind: WeightKind, base: int | None, payload: bytes, manifest: StateManifest,
                trainer_step: int, trained_samples: int) -> PolicyVersion:
        return PolicyVersion(
            policy=self.policy,
            version=version,
            kind=kind,
            base_version=base,
            dtype=self.settings.dtype,
            num_chunks=0,
            payload_bytes=len(payload),
            sha256=sha256_hex(payload),
            state_checksum=manifest.checksum().hex(),
            trainer_step=trainer_step,
            trained_samples=trained_samples,
        )
