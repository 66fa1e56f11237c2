"""Avro serde: typed records <-> framed bytes.

Two framings, detected from the first byte when decoding:
- single-object encoding (default, no registry): `C3 01` + 8-byte CRC-64-AVRO fingerprint of the
  writer schema + Avro binary body. The fingerprint is looked up among every version kept in
  `schemas/`, and the body is resolved into the latest version (schema evolution).
- Confluent framing (`kafka.record_framing: confluent`, a schema registry configured): `00` +
  4-byte big-endian schema id + body; schemas are registered under their full record name
  (RecordNameStrategy), so registry-aware tools decode the topics without our code.

Every role reads both. A reader resolves any writer schema it can obtain into its own latest
version: from `schemas/` by fingerprint, else from the registry (by id, or by fingerprint for a
newer writer's single-object records: `astraflow.schema_registry`). A writer schema that cannot
be obtained raises `UnknownSchemaError`, one that cannot be resolved `IncompatibleSchemaError`;
both name the schema, and the roles dead-letter the record with that reason.

Every failure raises a specific `SerdeError` subclass whose message says what to fix.
"""

from __future__ import annotations

import io
import struct
from typing import TYPE_CHECKING, Any, Literal, TypeVar

from fastavro import parse_schema, schemaless_reader
from fastavro._read_common import SchemaResolutionError
from fastavro.validation import validate

from astraflow.avro_encoder import Encoder, compile_encoder
from astraflow.errors import (
    CorruptRecordError,
    IncompatibleSchemaError,
    RecordTooLargeError,
    SchemaValidationError,
    UnknownSchemaError,
)
from astraflow.records import RECORD_TYPES, Record
from astraflow.schema_catalog import SchemaCatalog, SchemaVersion, _strip_logical_types, default_catalog
from astraflow.schema_registry import SchemaRegistry, schema_fingerprint, shared

if TYPE_CHECKING:
    from astraflow.config import KafkaSettings

SINGLE_OBJECT_MAGIC = b"\xc3\x01"
CONFLUENT_MAGIC = 0
DEFAULT_MAX_RECORD_BYTES = 8 * 1024 * 1024

R = TypeVar("R", bound=Record)
Framing = Literal["single_object", "confluent"]


class AvroSerde:
    """Encodes and decodes AstraFlow records; one instance per process is enough (thread-safe reads)."""

    def __init__(
        self,
        catalog: SchemaCatalog | None = None,
        *,
        registry_url: str | None = None,
        registry_config: dict[str, str] | None = None,
        registry_client: Any = None,
        registry: SchemaRegistry | None = None,
        framing: Framing | None = None,
        max_record_bytes: int = DEFAULT_MAX_RECORD_BYTES,
    ) -> None:
        self.catalog = catalog or default_catalog()
        self.max_record_bytes = max_record_bytes
        if registry is None and (registry_url or registry_client is not None):
            # A client to share (mock:// stores are per client), else a new one for the URL.
            registry = SchemaRegistry(registry_url or "mock://shared", registry_config, registry_client)
        self.registry = registry
        self.framing: Framing = framing or ("confluent" if registry is not None else "single_object")
        if self.framing == "confluent" and registry is None:
            raise ValueError("Confluent framing needs a schema registry; set kafka.schema_registry_url")
        self._registry_schemas: dict[int, SchemaVersion] = {}  # id -> writer schema
        self._fingerprints: dict[bytes, SchemaVersion] = {}  # registry-served writers by fingerprint
        self._encoders: dict[str, tuple[bytes, Encoder]] = {}  # fullname -> (framing header, compiled writer)

    @classmethod
    def for_kafka(cls, kafka: KafkaSettings, catalog: SchemaCatalog | None = None, **kwargs: Any) -> AvroSerde:
        """The serde a role uses on this cluster: with a registry configured, it waits for the
        registry (start-up is delayed, with a message, never skipped), registers every schema
        version this role ships, and writes the framing `kafka.record_framing` selects."""
        if not kafka.schema_registry_url:
            return cls(catalog, **kwargs)
        registry = shared(kafka.schema_registry_url, kafka.schema_registry_config)
        serde = cls(catalog, registry=registry, framing=kafka.record_framing, **kwargs)
        serde.register_schemas(wait_s=kafka.schema_registry_wait_s)
        return serde

    def register_schemas(self, wait_s: float = 60.0) -> None:
        """Registers every version of every record in the catalog, with its declared rule."""
        from astraflow.schema_compat import load_rules

        if self.registry is None:
            return
        self.registry.wait(wait_s)
        try:
            rules = load_rules(self.catalog.directory)
        except Exception:  # a catalog without compatibility.json (tests' fixtures): no rule set
            rules = {}
        for name in self.catalog.names():
            self.registry.register_history(name, [v.raw for v in self.catalog.versions(name)], rules.get(name))

    # ---- typed API -----------------------------------------------------------------------------

    def dumps(self, record: Record) -> bytes:
        """Encodes a typed record with the latest version of its schema."""
        return self.encode(record.SCHEMA, record.to_avro())

    def loads(self, data: bytes, expect: type[R] | None = None) -> R:
        """Decodes bytes into the typed record their schema names (checked against `expect`)."""
        fullname, datum = self.decode(data)
        cls = RECORD_TYPES.get(fullname)
        if cls is None:
            raise UnknownSchemaError(f"record type {fullname!r} has no Python class in astraflow.records")
        if expect is not None and cls is not expect:
            raise SchemaValidationError(f"expected a {expect.SCHEMA} record but got {fullname}; check the topic")
        try:
            return cls.from_avro(datum)  # type: ignore[return-value]
        except (KeyError, ValueError, TypeError) as exc:
            raise SchemaValidationError(f"{fullname} record decoded but is not usable: {exc!r}") from exc

    # ---- dict API ------------------------------------------------------------------------------

    def encode(self, fullname: str, datum: dict[str, Any]) -> bytes:
        """Encodes a dict with the latest version of `fullname` (its compiled encoder, see avro_encoder)."""
        enc = self._encoders.get(fullname)
        if enc is None:
            enc = self._encoder(fullname)
        header, write = enc
        out = [header]
        try:
            write(datum, out.append)
        except Exception as exc:  # a value of the wrong type or range; explain with fastavro's validate()
            raise SchemaValidationError(_explain_invalid(self.catalog.latest(fullname), datum, exc)) from exc
        data = b"".join(out)
        if len(data) > self.max_record_bytes:
            raise RecordTooLargeError(
                f"{fullname} record is {len(data):,} bytes, over the {self.max_record_bytes:,}-byte limit; "
                "send large payloads through the weight store (claim-check) or raise max_record_bytes "
                "together with the topic's max.message.bytes"
            )
        return data

    def _encoder(self, fullname: str) -> tuple[bytes, Encoder]:
        sv = self.catalog.latest(fullname)
        if self.framing == "confluent":
            header = struct.pack(">bI", CONFLUENT_MAGIC, self.registry.register(sv.fullname, sv.raw))  # type: ignore[union-attr]
        else:
            header = SINGLE_OBJECT_MAGIC + sv.fingerprint
        enc = self._encoders[fullname] = (header, compile_encoder(sv.parsed))
        return enc

    def decode(self, data: bytes | None) -> tuple[str, dict[str, Any]]:
        """Decodes framed bytes into (schema full name, dict in the latest schema version)."""
        if data is None:
            raise CorruptRecordError("record has no value (a tombstone?); expected a framed Avro record")
        if len(data) > self.max_record_bytes:
            raise RecordTooLargeError(
                f"record is {len(data):,} bytes, over the {self.max_record_bytes:,}-byte limit of this consumer"
            )
        if data[:2] == SINGLE_OBJECT_MAGIC:
            if len(data) < 10:
                raise CorruptRecordError(f"record of {len(data)} bytes is too short for a single-object header")
            writer = self._writer_by_fingerprint(bytes(data[2:10]))
            start = 10
        elif len(data) >= 5 and data[0] == CONFLUENT_MAGIC:
            (schema_id,) = struct.unpack(">I", data[1:5])
            writer = self._registry_writer(schema_id)
            start = 5
        else:
            raise CorruptRecordError(
                f"record does not start with an Avro single-object (c3 01) or Confluent (00) header "
                f"(first bytes: {bytes(data[:4]).hex() or 'none'}); was it written by an AstraFlow producer?"
            )
        reader = self.catalog.latest(writer.fullname)
        bio = io.BytesIO(data)
        bio.seek(start)
        try:
            if writer is reader:
                datum = schemaless_reader(bio, writer.parsed, None)
            else:
                datum = schemaless_reader(bio, writer.parsed, reader.parsed)
        except SchemaResolutionError as exc:
            raise IncompatibleSchemaError(
                f"writer schema {_label(writer)} cannot be resolved to this reader's {_label(reader)} ({exc}); "
                "the writer broke the record's compatibility rule (schemas/compatibility.json)"
            ) from exc
        except Exception as exc:  # truncated or garbage body: fastavro raises EOFError, ValueError, ...
            raise CorruptRecordError(
                f"{_label(writer)} body cannot be decoded ({type(exc).__name__}: {exc}); "
                "the bytes are corrupt or truncated"
            ) from exc
        if bio.tell() != len(data):
            raise CorruptRecordError(
                f"{writer.fullname} record has {len(data) - bio.tell()} trailing bytes after its body; corrupt"
            )
        return writer.fullname, datum

    # ---- writer schemas from the registry ----------------------------------------------------------

    def _writer_by_fingerprint(self, fp: bytes) -> SchemaVersion:
        try:
            return self.catalog.by_fingerprint(fp)
        except UnknownSchemaError as exc:
            sv = self._fingerprints.get(fp)
            if sv is not None:
                return sv
            hit = self.registry.schema_by_fingerprint(fp, self.catalog.names()) if self.registry is not None else None
            if hit is None:
                where = f" nor in the schema registry at {self.registry.url}" if self.registry is not None else ""
                raise UnknownSchemaError(f"{exc}{where}") from None
            sv = self._fingerprints[fp] = self._served(hit[0], hit[1])
            return sv

    def _registry_writer(self, schema_id: int) -> SchemaVersion:
        sv = self._registry_schemas.get(schema_id)
        if sv is not None:
            return sv
        if self.registry is None:
            raise UnknownSchemaError(
                f"record uses Confluent framing (schema id {schema_id}) but no schema registry is configured; "
                "set kafka.schema_registry_url"
            )
        sv = self._registry_schemas[schema_id] = self._served(schema_id, self.registry.schema_by_id(schema_id))
        return sv

    def _served(self, schema_id: int, raw: dict[str, Any]) -> SchemaVersion:
        """A writer schema the registry served: one we ship, or one resolved into our latest of its name."""
        fp = schema_fingerprint(raw)
        try:
            return self.catalog.by_fingerprint(fp)
        except UnknownSchemaError:
            pass
        name = raw.get("name", "?") if isinstance(raw, dict) else "?"
        name = name if "." in name else f"{raw.get('namespace', '')}.{name}".lstrip(".")
        try:
            latest = self.catalog.latest(name)
        except UnknownSchemaError:
            raise UnknownSchemaError(
                f"registry schema id {schema_id} is a {name!r} record, a type this role does not know"
            ) from None
        try:
            parsed = parse_schema(_strip_logical_types(raw), named_schemas={})
        except Exception as exc:
            raise UnknownSchemaError(f"registry schema id {schema_id} ({name}) does not parse: {exc}") from exc
        return SchemaVersion(name, -schema_id, latest.path, raw, parsed, fp)


def _label(sv: SchemaVersion) -> str:
    """`astraflow.Task v2`, or for a version served by the registry, its id and fingerprint."""
    if sv.version > 0:
        return f"{sv.fullname} v{sv.version}"
    return f"{sv.fullname} (registry id {-sv.version}, fingerprint {sv.fingerprint.hex()})"


def _explain_invalid(sv: SchemaVersion, datum: Any, exc: Exception) -> str:
    try:
        validate(datum, sv.parsed, raise_errors=True)
    except Exception as verr:
        detail = str(verr)
    else:
        detail = f"{type(exc).__name__}: {exc}"
    return f"record does not match schema {sv.fullname} v{sv.version} ({sv.path.name}): {detail}"
