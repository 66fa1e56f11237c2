"""Claim-check store for weight payloads too large for the weights topic.

The trainer writes a payload here FIRST and only then publishes the PolicyVersion that names
its URI and sha256, so a receiver that sees the record can always fetch the blob. A store is a
local directory or any fsspec URI (``s3://bucket/prefix``, ``gs://...``, ``memory://...``);
receivers need only the URI in the record, never the trainer's configuration; followers read it
through `astraflow.weights.verify.fetch_bounded`, which checks the location against their
allowed prefixes first and bounds the read (`fetch_blob` with `max_bytes`).

Local writes go to a temporary file in the same directory and are renamed into place, so a
crash never leaves a half-written blob under a published name; object stores are atomic per
put already.
"""

from __future__ import annotations

import hashlib
import os
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from astraflow.errors import WeightsError


class WeightStoreError(WeightsError):
    """Raised when a payload cannot be written to or read from the weight store, or when what
    was read does not match the sha256 its PolicyVersion recorded (fall back to a snapshot)."""


def sha256_hex(data: bytes | memoryview) -> str:
    """Hex sha256 of a payload, as recorded in `PolicyVersion.sha256`."""
    return hashlib.sha256(data).hexdigest()


def _is_url(location: str) -> bool:
    return "://" in location


class WeightStore:
    """Writes payloads under a root (a directory or an fsspec URI) and returns their URIs."""

    def __init__(self, root: str | Path, storage_options: Mapping[str, Any] | None = None) -> None:
        self.storage_options = dict(storage_options or {})
        text = str(root)
        if _is_url(text) and not text.startswith("file://"):
            self.root = text.rstrip("/")
            self._local: Path | None = None
        else:
            self._local = Path(text.removeprefix("file://")).expanduser().resolve()
            self.root = self._local.as_uri()

    def uri_for(self, key: str) -> str:
        """The URI a payload stored under `key` (e.g. ``policy/v00000042.snapshot``) gets."""
        return f"{self.root}/{key.lstrip('/')}"

    def put(self, key: str, data: bytes) -> str:
        """Stores `data` under `key` (replacing any older blob) and returns its URI."""
        uri = self.uri_for(key)
        try:
            if self._local is not None:
                path = self._local / key
                path.parent.mkdir(parents=True, exist_ok=True)
                tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
                with open(tmp, "wb") as f:
                    f.write(data)
                    f.flush()
                    os.fsync(f.fileno())
                os.replace(tmp, path)
            else:
                import fsspec

                fs, path = fsspec.core.url_to_fs(uri, **self.storage_options)
                parent = path.rsplit("/", 1)[0]
                if parent:
                    fs.makedirs(parent, exist_ok=True)
                fs.pipe_file(path, data)
        except (OSError, ValueError, ImportError) as exc:
            raise WeightStoreError(
                f"cannot write {len(data):,} bytes to the weight store at {uri}: {exc}"
            ) from exc
        return uri

    def get(self, uri: str, sha256: str | None = None) -> bytes:
        """Reads a blob this (or any) store wrote; see `fetch_blob`."""
        return fetch_blob(uri, sha256, self.storage_options)

    def delete(self, uri: str) -> None:
        """Removes a blob (missing blobs are ignored)."""
        import fsspec

        try:
            fs, path = fsspec.core.url_to_fs(uri, **self.storage_options)
            if fs.exists(path):
                fs.rm_file(path)
        except (OSError, ValueError) as exc:
            raise WeightStoreError(f"cannot delete {uri} from the weight store: {exc}") from exc


_READ_BLOCK = 8 * 1024 * 1024


def fetch_blob(
    uri: str,
    sha256: str | None = None,
    storage_options: Mapping[str, Any] | None = None,
    max_bytes: int | None = None,
) -> bytes:
    """Reads the payload at `uri` (file://, s3://, any fsspec URI) and checks its sha256.

    With `max_bytes`, reads at most that many bytes (plus one, to notice a larger blob).
    Raises `WeightStoreError` if it cannot be read, is larger than `max_bytes` or does not
    match `sha256`. It opens whatever `uri` names: readers of untrusted records go through
    `astraflow.weights.verify.fetch_bounded`.
    """
    import fsspec

    parts: list[bytes] = []
    got = 0
    try:
        with fsspec.open(uri, "rb", **dict(storage_options or {})) as f:
            while max_bytes is None or got <= max_bytes:
                want = _READ_BLOCK if max_bytes is None else min(_READ_BLOCK, max_bytes + 1 - got)
                block = f.read(want)
                if not block:
                    break
                parts.append(block)
                got += len(block)
    except (OSError, ValueError, ImportError) as exc:
        raise WeightStoreError(
            f"cannot read {uri} from the weight store: {exc}; is the store reachable from this machine?"
        ) from exc
    if max_bytes is not None and got > max_bytes:
        raise WeightStoreError(f"{uri} holds more than the {max_bytes:,} bytes announced or allowed "
                               "(weights.max_payload_bytes)")
    data = b"".join(parts)
    if sha256 is not None and sha256_hex(data) != sha256:
        raise WeightStoreError(f"{uri} does not match its recorded sha256 (corrupt, truncated or replaced)")
    return data
