"""Where archive files live: a local directory, or any fsspec URI (s3://, gs://, memory://, ...).

Writing is always: stage the whole file locally, make it durable, then publish it atomically.
- Local directory: the staging file sits in the target directory under a hidden `.…part` name;
  it is fsynced, renamed into place (`os.replace`, atomic on POSIX) and the directory is fsynced,
  so after a crash a file is either complete under its final name or not there at all.
- fsspec URI: the staging file is a local temporary file. Object stores (s3, gs, az, memory)
  make one upload visible all at once, so it goes straight to its final name; other
  filesystems get an upload to a `.part` name followed by a move.
Listing ignores hidden and `.part` names, so readers never see a file being written.
"""

from __future__ import annotations

import contextlib
import os
import tempfile
from pathlib import Path
from typing import Any

from astraflow.archive.errors import ArchiveError

OBJECT_STORES = {"s3", "s3a", "gs", "gcs", "az", "abfs", "abfss", "adl", "memory", "oss"}


def _fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def is_uri(location: str) -> bool:
    return "://" in location and not location.startswith("file://")


class ArchiveStore:
    """Relative paths (`topic/p0000/name.avro`) under one archive root."""

    def __init__(self, location: str | Path) -> None:
        self.location = str(location)

    @staticmethod
    def open(location: str | Path, create: bool = False) -> ArchiveStore:
        """A local store for paths and file:// URIs, an fsspec store otherwise."""
        loc = str(location)
        if loc.startswith("file://"):
            loc = loc[len("file://") :]
        if is_uri(loc):
            return FsspecStore(loc, create=create)
        return LocalStore(Path(loc), create=create)

    # Subclasses implement these.
    def listdir(self, rel: str) -> list[str]:
        raise NotImplementedError

    def read_bytes(self, rel: str) -> bytes:
        raise NotImplementedError

    def exists(self, rel: str) -> bool:
        raise NotImplementedError

    def delete(self, rel: str) -> None:
        raise NotImplementedError

    def rename(self, rel: str, new_rel: str) -> None:
        raise NotImplementedError

    def staging_file(self, rel_dir: str, name: str) -> Path:
        """A local path to write a file that `publish` will later move to `rel_dir/name`."""
        raise NotImplementedError

    def publish(self, staged: Path, rel: str) -> None:
        """Makes a fully written, already fsynced staging file visible under `rel`, atomically."""
        raise NotImplementedError

    def put_bytes(self, rel: str, data: bytes) -> None:
        """Writes small content (a manifest) durably and atomically."""
        raise NotImplementedError

    def describe(self, rel: str = "") -> str:
        return f"{self.location.rstrip('/')}/{rel}" if rel else self.location


class LocalStore(ArchiveStore):
    """A directory on this machine (or a mounted network filesystem that honours fsync)."""

    def __init__(self, root: Path, create: bool = False) -> None:
        super().__init__(root)
        self.root = root
        if create:
            root.mkdir(parents=True, exist_ok=True)
        elif not root.is_dir():
            raise ArchiveError(f"archive directory {root} does not exist; check the path, or archive into it first")

    def listdir(self, rel: str) -> list[str]:
        path = self.root / rel
        if not path.is_dir():
            return []
        return sorted(n for n in os.listdir(path) if not n.startswith("."))

    def read_bytes(self, rel: str) -> bytes:
        return (self.root / rel).read_bytes()

    def exists(self, rel: str) -> bool:
        return (self.root / rel).exists()

    def delete(self, rel: str) -> None:
        with contextlib.suppress(FileNotFoundError):
            (self.root / rel).unlink()

    def rename(self, rel: str, new_rel: str) -> None:
        os.replace(self.root / rel, self.root / new_rel)

    def staging_file(self, rel_dir: str, name: str) -> Path:
        d = self.root / rel_dir
        d.mkdir(parents=True, exist_ok=True)
        return d / f".{name}.part"

    def stale_staging(self, rel_dir: str) -> list[Path]:
        """Staging files a crashed writer left behind."""
        d = self.root / rel_dir
        return sorted(d.glob(".*.part")) if d.is_dir() else []

    def publish(self, staged: Path, rel: str) -> None:
        target = self.root / rel
        os.replace(staged, target)
        _fsync_dir(target.parent)

    def put_bytes(self, rel: str, data: bytes) -> None:
        target = self.root / rel
        target.parent.mkdir(parents=True, exist_ok=True)
        tmp = target.parent / f".{target.name}.part"
        with open(tmp, "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, target)
        _fsync_dir(target.parent)


class FsspecStore(ArchiveStore):
    """Any fsspec filesystem; files are staged in a local temporary directory."""

    def __init__(self, uri: str, create: bool = False) -> None:
        super().__init__(uri)
        try:
            import fsspec

            self.fs: Any
            self.fs, self.root = fsspec.core.url_to_fs(uri)
        except (ImportError, ValueError) as exc:
            raise ArchiveError(f"cannot open archive URI {uri}: {exc}; install the fsspec backend for it") from exc
        self.protocol = uri.split("://", 1)[0]
        self.atomic_put = self.protocol in OBJECT_STORES
        if create:
            self.fs.makedirs(self.root, exist_ok=True)
        elif not self.fs.exists(self.root):
            raise ArchiveError(f"archive {uri} does not exist; check the URI, or archive into it first")
        self._tmp = tempfile.TemporaryDirectory(prefix="af-archive-")

    def _p(self, rel: str) -> str:
        return f"{self.root.rstrip('/')}/{rel}" if rel else self.root

    def listdir(self, rel: str) -> list[str]:
        path = self._p(rel)
        try:
            entries = self.fs.ls(path, detail=False)
        except FileNotFoundError:
            return []
        names = {str(e).rstrip("/").rsplit("/", 1)[-1] for e in entries}
        return sorted(n for n in names if n and not n.startswith(".") and not n.endswith(".part"))

    def read_bytes(self, rel: str) -> bytes:
        return self.fs.cat_file(self._p(rel))

    def exists(self, rel: str) -> bool:
        return self.fs.exists(self._p(rel))

    def delete(self, rel: str) -> None:
        with contextlib.suppress(FileNotFoundError):
            self.fs.rm_file(self._p(rel))

    def rename(self, rel: str, new_rel: str) -> None:
        self.fs.mv(self._p(rel), self._p(new_rel))

    def staging_file(self, rel_dir: str, name: str) -> Path:
        d = Path(self._tmp.name) / rel_dir
        d.mkdir(parents=True, exist_ok=True)
        return d / f".{name}.part"

    def publish(self, staged: Path, rel: str) -> None:
        target = self._p(rel)
        self.fs.makedirs(target.rsplit("/", 1)[0], exist_ok=True)
        if self.atomic_put:
            self.fs.put_file(str(staged), target)
        else:
            self.fs.put_file(str(staged), target + ".part")
            self.fs.mv(target + ".part", target)
        staged.unlink()

    def put_bytes(self, rel: str, data: bytes) -> None:
        target = self._p(rel)
        self.fs.makedirs(target.rsplit("/", 1)[0], exist_ok=True)
        if self.atomic_put:
            self.fs.pipe_file(target, data)
        else:
            self.fs.pipe_file(target + ".part", data)
            self.fs.mv(target + ".part", target)
