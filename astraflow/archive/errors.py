"""Errors of the archive, replay and inspect tools (all derive from `AstraflowError`)."""

from __future__ import annotations

from astraflow.errors import AstraflowError


class ArchiveError(AstraflowError):
    """Raised when an archive cannot be written, listed or read (missing directory, bad URI,
    a store that refuses a write)."""


class ArchiveCorruptError(ArchiveError):
    """Raised when an archive file fails a check (bad header, block checksum, sync marker,
    undecodable block). The message names the file, the block and its byte position; read with
    `skip_corrupt=True` to skip that block, report it, and keep reading the rest of the file."""

    def __init__(self, message: str, *, file: str, block: int | None = None, byte_offset: int | None = None) -> None:
        super().__init__(message)
        self.file = file  # path of the archive file, relative to the archive root
        self.block = block  # 0-based block index, None for the file header
        self.byte_offset = byte_offset  # where the bad block starts in the file


class FilterError(ArchiveError):
    """Raised when a `--filter` expression uses syntax outside the allowed subset, or names a
    field the records do not have."""


class ReplayError(ArchiveError):
    """Raised when a replay cannot start or finish: unknown source, missing target topic,
    conflicting options, records Kafka refused."""
