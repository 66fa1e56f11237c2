"""Avro serde: typed records <-> framed bytes.

Two framings, detected from the first byte when decoding:
- single-object encoding (default, no registry): `C3 01` + 8-byte CRC-64-AVRO fingerprint of the
  writer schema + Avro binary body. The fingerprint is looked up among every version kept in
  `schemas/`, and the body is resolved into the latest version (schema evolution).
- Confluent framing (when a Schema Registry URL is configured): `00` + 4-byte big-endian schema
  id + body; schemas are registered under their full record name (RecordNameStrategy).

Every failure raises a specific `SerdeError` subclass whose message says what to fix.
"""

from __future__ import annotations

import io
import json
import struct
from typing import Any, TypeVar

from fastavro import parse_schema, schemaless_reader
from fastavro.schema import fingerprint, to_parsing_canonical_form
from fastavro.validation import validate

from astraflow.avro_encoder import Encoder, compile_encoder
from astraflow.errors import (
    CorruptRecordError,
    RecordTooLargeError,
    SchemaValidationError,
    SerdeError,
    UnknownSchemaError,
)
from astraflow.records import RECORD_TYPES, Record
from astraflow.schema_catalog import SchemaCatalog, SchemaVersion, _strip_logical_types, default_catalog

SINGLE_OBJECT_MAGIC = b"\xc3\x01"
CONFLUENT_MAGIC = 0
DEFAULT_MAX_RECORD_BYTES = 8 * 1024 * 1024

R = TypeVar("R", bound=Record)


class AvroSerde:
    """Encodes and decodes AstraFlow records; one instance per process is enough (thread-safe reads)."""

    def __init__(
        self,
        catalog: SchemaCatalog | None = None,
        *,
        registry_url: str | None = None,
        registry_config: dict[str, str] | None = None,
        registry_client: Any = None,
        max_record_bytes: int = DEFAULT_MAX_RECORD_BYTES,
    ) -> None:
        self.catalog = catalog or default_catalog()
        self.max_record_bytes = max_record_bytes
        self._registry = registry_client  # a SchemaRegistryClient to share (mock:// stores are per client)
        self._registry_ids: dict[str, int] = {}  # fullname -> id of our latest version
        self._registry_schemas: dict[int, SchemaVersion] = {}  # id -> writer schema
        self._encoders: dict[str, tuple[bytes, Encoder]] = {}  # fullname -> (framing header, compiled writer)
        if registry_url and registry_client is None:
            from confluent_kafka.schema_registry import SchemaRegistryClient

            # new_client() gives the in-process registry for mock:// URLs (tests) and a real client otherwise.
            self._registry = SchemaRegistryClient.new_client({"url": registry_url, **(registry_config or {})})

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
        if self._registry is not None:
            header = struct.pack(">bI", CONFLUENT_MAGIC, self._registry_id(sv))
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
            writer = self.catalog.by_fingerprint(bytes(data[2:10]))
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
        except Exception as exc:  # truncated or garbage body: fastavro raises EOFError, ValueError, ...
            raise CorruptRecordError(
                f"{writer.fullname} v{writer.version} body cannot be decoded ({type(exc).__name__}: {exc}); "
                "the bytes are corrupt or truncated"
            ) from exc
        if bio.tell() != len(data):
            raise CorruptRecordError(
                f"{writer.fullname} record has {len(data) - bio.tell()} trailing bytes after its body; corrupt"
            )
        return writer.fullname, datum

    # ---- schema registry -----------------------------------------------------------------------

    def _registry_id(self, sv: SchemaVersion) -> int:
        sid = self._registry_ids.get(sv.fullname)
        if sid is None:
            from confluent_kafka.schema_registry import Schema

            try:
                sid = self._registry.register_schema(sv.fullname, Schema(sv.schema_str, "AVRO"))  # type: ignore[union-attr]
            except Exception as exc:
                raise SerdeError(f"cannot register {sv.fullname} in the schema registry: {exc}") from exc
            self._registry_ids[sv.fullname] = sid
            self._registry_schemas[sid] = sv
        return sid

    def _registry_writer(self, schema_id: int) -> SchemaVersion:
        sv = self._registry_schemas.get(schema_id)
        if sv is not None:
            return sv
        if self._registry is None:
            raise UnknownSchemaError(
                f"record uses Confluent framing (schema id {schema_id}) but no schema registry is configured; "
                "set kafka.schema_registry_url"
            )
        try:
            schema = self._registry.get_schema(schema_id)
        except Exception as exc:
            raise UnknownSchemaError(f"schema id {schema_id} not found in the registry: {exc}") from exc
        raw = json.loads(schema.schema_str)
        fp = bytes.fromhex(fingerprint(to_parsing_canonical_form(raw), "CRC-64-AVRO"))
        try:
            sv = self.catalog.by_fingerprint(fp)
        except UnknownSchemaError:
            # A version we do not ship: still decodable, resolved into our latest of that name.
            parsed = parse_schema(_strip_logical_types(raw), named_schemas={})
            name = raw["name"] if "." in raw["name"] else f"{raw.get('namespace', '')}.{raw['name']}".lstrip(".")
            self.catalog.latest(name)
            sv = SchemaVersion(name, -schema_id, self.catalog.latest(name).path, raw, parsed, fp)
        self._registry_schemas[schema_id] = sv
        return sv


def _explain_invalid(sv: SchemaVersion, datum: Any, exc: Exception) -> str:
    try:
        validate(datum, sv.parsed, raise_errors=True)
    except Exception as verr:
        detail = str(verr)
    else:
        detail = f"{type(exc).__name__}: {exc}"
    return f"record does not match schema {sv.fullname} v{sv.version} ({sv.path.name}): {detail}"
