"""What a weight follower refuses before it applies anything: the rules for records it did not write.

A PolicyVersion manifest is a claim by whoever wrote to the weights topic. The follower checks:

- the manifest itself: a known dtype, a sha256 and state checksum that are hex digests, a
  payload size within `weights.max_payload_bytes`, chunk counts that fit that size, and a delta
  that names a base older than itself (`check_manifest`);
- its place in history (`VersionLedger`): a version number means one set of weights, so a
  manifest that reuses an applied version with another hash is refused, and so is one that
  appears later in the log than an applied version with a number not above it (the numbers
  only grow);
- where a claim-checked payload lives: only under `weights.allowed_uri_prefixes`, compared
  after normalising the path (no `..`, no fsspec chaining with `::`), and read with a bound
  (`fetch_bounded`); the payload's sha256 is checked as it is for in-band chunks.

Everything else (checksums of chunks, payloads and versions, bounded decompression, the
model's layout) is checked while the payload is decoded; see `WeightFollower`.
"""

from __future__ import annotations

import collections
import posixpath
import re
from collections.abc import Sequence
from dataclasses import dataclass, field
from urllib.parse import unquote, urlsplit

from astraflow.config import WeightFollowSettings
from astraflow.errors import WeightsError
from astraflow.records import PolicyVersion, WeightKind
from astraflow.weights.store import fetch_blob

PUBLISHED_DTYPES = ("bfloat16", "float16", "float32")
_HEX64 = re.compile(r"[0-9a-f]{64}")


class WeightRefusedError(WeightsError):
    """Raised when a weight record breaks a follower's rules (a lying or malformed manifest, a
    version number reused or going back, a payload location outside the allowed prefixes, or
    a payload larger than allowed); the follower keeps its last good version."""


@dataclass(frozen=True)
class FollowLimits:
    """The follower's rules, from the `weights` section of the config."""

    allowed_uri_prefixes: tuple[str, ...] = ()  # where claim-checked payloads may be read from
    max_payload_bytes: int = 16 * 1024**3  # largest payload buffered or fetched
    max_state_bytes: int = 64 * 1024**3  # most bytes of tensors one payload may decode to

    @classmethod
    def from_settings(cls, s: WeightFollowSettings) -> FollowLimits:
        return cls(tuple(s.allowed_uri_prefixes), s.max_payload_bytes, s.max_state_bytes)


def _normalised(uri: str) -> tuple[str, str, str] | None:
    """(scheme, authority, normalised path) of a URI, or None if it cannot be compared safely."""
    if "::" in uri or any(ord(c) < 32 for c in uri):
        return None  # fsspec chaining, control characters
    parts = urlsplit(uri)
    if not parts.scheme or parts.query or parts.fragment:
        return None
    path = unquote(parts.path)
    if ".." in path.split("/") or "\\" in path:
        return None
    return parts.scheme.lower(), parts.netloc.lower(), posixpath.normpath(path) if path else ""


def uri_allowed(uri: str, prefixes: Sequence[str]) -> bool:
    """Whether `uri` lies under one of `prefixes` (same scheme and host, path inside the prefix's)."""
    got = _normalised(uri)
    if got is None:
        return False
    for prefix in prefixes:
        want = _normalised(prefix)
        if want is None or want[:2] != got[:2]:
            continue
        base = want[2].rstrip("/")
        if got[2] == base or got[2].startswith(base + "/"):
            return True
    return False


def check_uri(uri: str, limits: FollowLimits) -> None:
    """Raise `WeightRefusedError` unless `uri` is under `weights.allowed_uri_prefixes`."""
    if not uri_allowed(uri, limits.allowed_uri_prefixes):
        raise WeightRefusedError(
            f"payload location {uri[:300]!r} is outside weights.allowed_uri_prefixes "
            f"{list(limits.allowed_uri_prefixes)}; the operator adds the trainer's weight store there"
        )


def fetch_bounded(uri: str, sha256: str | None, limits: FollowLimits, size: int | None = None) -> bytes:
    """Read a claim-checked payload: allowed location, at most `size` (or the limit) bytes, sha256."""
    check_uri(uri, limits)
    bound = min(limits.max_payload_bytes, size if size is not None else limits.max_payload_bytes)
    return fetch_blob(uri, sha256, max_bytes=bound)


def check_manifest(m: PolicyVersion, limits: FollowLimits) -> None:
    """Raise `WeightRefusedError` if the manifest is malformed or announces too much (see the module doc)."""
    problems = []
    if m.version < 0:
        problems.append(f"version {m.version} is negative")
    if m.dtype not in PUBLISHED_DTYPES:
        problems.append(f"dtype {m.dtype[:40]!r} is not one of {', '.join(PUBLISHED_DTYPES)}")
    if not (_HEX64.fullmatch(m.sha256) and _HEX64.fullmatch(m.state_checksum)):
        problems.append("sha256 and state_checksum must be 64 lowercase hex digits")
    if not 0 < m.payload_bytes <= limits.max_payload_bytes:
        problems.append(f"payload_bytes={m.payload_bytes} is not within 1..{limits.max_payload_bytes} "
                        "(weights.max_payload_bytes)")
    if not 0 <= m.num_chunks <= max(1, m.payload_bytes):
        problems.append(f"num_chunks={m.num_chunks} does not fit a payload of {m.payload_bytes} bytes")
    if m.num_chunks == 0 and m.uri is None:
        problems.append("it has neither chunks nor a uri")
    if m.kind == WeightKind.DELTA and (m.base_version is None or not 0 <= m.base_version < m.version):
        problems.append(f"delta base_version={m.base_version} must be below its version {m.version}")
    if problems:
        raise WeightRefusedError(f"manifest of version {m.version} refused: {'; '.join(problems)}")


@dataclass
class VersionLedger:
    """Versions this follower applied: number -> state checksum (the sha256 naming the weights,
    whatever payload carried them), and the newest one."""

    keep: int = 4096  # versions remembered (the oldest are forgotten first)
    applied: collections.OrderedDict[int, str] = field(default_factory=collections.OrderedDict)
    newest: tuple[int, int | None] | None = None  # (version, offset) of the newest applied manifest
    # A snapshot loaded from beside the stream: the stream is read again from about its time, so
    # versions below it may still come by once; they are replays, not a number going back.
    floor: int | None = None

    def same_weights(self, m: PolicyVersion) -> bool:
        """True if `m` is a version applied already (with the same weights); raises
        `WeightRefusedError` if it names other weights under an applied number."""
        known = self.applied.get(m.version)
        if known is not None and known != m.state_checksum:
            raise WeightRefusedError(
                f"version {m.version} was applied with state checksum {known[:12]}..., this manifest "
                f"names {m.state_checksum[:12]}...: a version number must always mean the same weights"
            )
        return known is not None

    def check(self, m: PolicyVersion, offset: int | None) -> bool:
        """True if `m` repeats an applied version (same weights: stale); raises `WeightRefusedError`
        if it reuses a version number for other weights or comes after a newer one; else False."""
        if self.same_weights(m):
            return True
        if self.newest is not None and m.version <= self.newest[0]:
            replay = offset is not None and self.newest[1] is not None and offset <= self.newest[1]
            if replay or (self.floor is not None and m.version < self.floor):
                return True  # read again after a seek back: it was skipped or superseded then, and is now
            raise WeightRefusedError(
                f"version {m.version} comes after version {self.newest[0]} in the log: version numbers only grow"
            )
        return False

    def record(self, m: PolicyVersion, offset: int | None, beside: bool = False) -> None:
        """`beside`: a snapshot read beside the stream (`offset` is then where the stream resumes)."""
        self.applied[m.version] = m.state_checksum
        while len(self.applied) > self.keep:
            self.applied.popitem(last=False)
        if self.newest is None or m.version > self.newest[0]:
            self.newest = (m.version, offset)
            self.floor = m.version if beside else None


__all__ = [
    "FollowLimits",
    "VersionLedger",
    "WeightRefusedError",
    "check_manifest",
    "check_uri",
    "fetch_bounded",
    "uri_allowed",
]
