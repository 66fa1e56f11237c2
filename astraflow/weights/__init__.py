"""Weight publication: lossless sparse deltas, snapshots and the receiver's version chain.

The trainer publishes each policy version as a `SparseDelta` against the previous one
(`encode` / `iter_encode`); receivers keep a `WeightChain` that applies them in order and
asks for a full `snapshot` whenever a version is missing or fails its checksum. Everything is
exact on bit patterns. Format and figures: docs/weights.md.
"""

from astraflow.weights.bits import StateManifest
from astraflow.weights.chain import ApplyResult, ApplyStatus, WeightChain
from astraflow.weights.delta import SparseDelta, apply, apply_stream, encode, iter_encode
from astraflow.weights.snapshot import Snapshot, iter_snapshot, load_snapshot, snapshot

__all__ = [
    "ApplyResult",
    "ApplyStatus",
    "Snapshot",
    "SparseDelta",
    "StateManifest",
    "WeightChain",
    "apply",
    "apply_stream",
    "encode",
    "iter_encode",
    "iter_snapshot",
    "load_snapshot",
    "snapshot",
]
