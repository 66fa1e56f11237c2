"""The catalog of every Avro schema version kept in `schemas/`.

Layout: `schemas/<record>/v<N>.avsc`, one self-contained file per shipped version (named
sub-types are defined inline, so each file parses on its own with any Avro library). Versions
are never deleted: old logs decode through the fingerprint of the version that wrote them.

Internally the serde works on copies with logical types stripped, so timestamps stay integer
milliseconds; this changes nothing on the wire (the parsing canonical form, and therefore the
fingerprint, ignores logical types).
"""

from __future__ import annotations

import json
import os
import re
from dataclasses import dataclass
from functools import lru_cache
from pathlib import Path
from typing import Any

from fastavro import parse_schema
from fastavro.schema import fingerprint, to_parsing_canonical_form

from astraflow.errors import ConfigError, UnknownSchemaError

_VERSION_FILE = re.compile(r"^v(\d+)\.avsc$")


def default_schemas_dir() -> Path:
    """`$ASTRAFLOW_SCHEMAS_DIR`, else the `schemas/` folder of the source tree."""
    env = os.environ.get("ASTRAFLOW_SCHEMAS_DIR")
    if env:
        return Path(env)
    return Path(__file__).resolve().parent.parent / "schemas"


def _strip_logical_types(node: Any) -> Any:
    if isinstance(node, dict):
        return {k: _strip_logical_types(v) for k, v in node.items() if k != "logicalType"}
    if isinstance(node, list):
        return [_strip_logical_types(v) for v in node]
    return node


@dataclass(frozen=True, slots=True)
class SchemaVersion:
    """One shipped version of one record schema."""

    fullname: str  # e.g. astraflow.Trajectory
    version: int  # N of vN.avsc
    path: Path  # the .avsc file
    raw: dict[str, Any]  # JSON as written in the file
    parsed: Any  # fastavro parsed schema (logical types stripped)
    fingerprint: bytes  # CRC-64-AVRO of the canonical form, 8 bytes little-endian

    @property
    def schema_str(self) -> str:
        return json.dumps(self.raw)


class SchemaCatalog:
    """All schema versions, indexed by full name and by fingerprint."""

    def __init__(self, versions: list[SchemaVersion], directory: Path | None = None) -> None:
        self.directory = directory  # where the versions were read from (compatibility.json lives there)
        self._by_fp: dict[bytes, SchemaVersion] = {}
        self._by_name: dict[str, list[SchemaVersion]] = {}
        for v in versions:
            self._by_fp[v.fingerprint] = v
            self._by_name.setdefault(v.fullname, []).append(v)
        for vs in self._by_name.values():
            vs.sort(key=lambda v: v.version)

    @classmethod
    def load(cls, directory: Path | None = None) -> SchemaCatalog:
        """Reads every `<record>/v<N>.avsc` under `directory` (default: the repo's `schemas/`)."""
        directory = directory or default_schemas_dir()
        if not directory.is_dir():
            raise ConfigError(
                f"schema directory {directory} not found; set ASTRAFLOW_SCHEMAS_DIR to the repo's schemas/ folder"
            )
        versions = []
        for path in sorted(directory.glob("*/v*.avsc")):
            m = _VERSION_FILE.match(path.name)
            if not m:
                continue
            versions.append(parse_version_file(path, int(m.group(1))))
        if not versions:
            raise ConfigError(f"no schemas (*/v<N>.avsc) found under {directory}")
        return cls(versions, directory)

    def latest(self, fullname: str) -> SchemaVersion:
        try:
            return self._by_name[fullname][-1]
        except KeyError:
            known = ", ".join(sorted(self._by_name))
            raise UnknownSchemaError(f"no schema named {fullname!r}; known: {known}") from None

    def versions(self, fullname: str) -> list[SchemaVersion]:
        self.latest(fullname)
        return list(self._by_name[fullname])

    def by_fingerprint(self, fp: bytes) -> SchemaVersion:
        try:
            return self._by_fp[fp]
        except KeyError:
            raise UnknownSchemaError(
                f"schema fingerprint {fp.hex()} is not among the {len(self._by_fp)} versions in schemas/; "
                "the record was written by a newer AstraFlow or another producer: upgrade, or add its .avsc"
            ) from None

    def names(self) -> list[str]:
        return sorted(self._by_name)

    def all_versions(self) -> list[SchemaVersion]:
        return [v for vs in self._by_name.values() for v in vs]


def parse_version_file(path: Path, version: int) -> SchemaVersion:
    """Parses one .avsc file into a `SchemaVersion`."""
    try:
        raw = json.loads(path.read_text())
        fp_hex = fingerprint(to_parsing_canonical_form(raw), "CRC-64-AVRO")
        parsed = parse_schema(_strip_logical_types(raw), named_schemas={})
    except Exception as exc:  # a broken .avsc is a config problem, whatever the library raised
        raise ConfigError(f"cannot parse schema file {path}: {exc}") from exc
    fullname = raw["name"] if "." in raw["name"] else f"{raw.get('namespace', '')}.{raw['name']}".lstrip(".")
    return SchemaVersion(fullname, version, path, raw, parsed, bytes.fromhex(fp_hex))


@lru_cache(maxsize=4)
def default_catalog(directory: str | None = None) -> SchemaCatalog:
    """The process-wide catalog (cached: schemas do not change while a process runs)."""
    return SchemaCatalog.load(Path(directory) if directory else None)
