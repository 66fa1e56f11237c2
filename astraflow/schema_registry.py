"""A Confluent-API schema registry as AstraFlow's serde uses it (Apicurio's ccompat API, Confluent's).

Roles register every version of every record type on start, under the record's full name
(RecordNameStrategy), oldest first, and set each subject's compatibility rule to the one
`schemas/compatibility.json` declares, so the registry refuses what the gate in `make check`
refuses. A reader then obtains any writer's schema from the registry: by schema id (Confluent
framing) or, for single-object records from a version its own `schemas/` lacks (a newer role),
by fingerprint: it lists the versions registered under its record names and fingerprints them.

A registry that does not answer delays start-up (`wait`, with a message every few seconds) and
never lets a record out half-framed: encoders are built only from ids the registry gave.
"""

from __future__ import annotations

import json
import logging
import threading
import time
from collections.abc import Callable, Iterable
from typing import Any

from fastavro.schema import fingerprint, to_parsing_canonical_form

from astraflow.errors import SchemaRegistryError, UnknownSchemaError

log = logging.getLogger(__name__)


def schema_fingerprint(raw: dict[str, Any]) -> bytes:
    """CRC-64-AVRO of the parsing canonical form: the 8 bytes single-object encoding carries."""
    return bytes.fromhex(fingerprint(to_parsing_canonical_form(raw), "CRC-64-AVRO"))


class SchemaRegistry:
    """One registry client per process and URL (`shared`), with what it has learnt cached."""

    def __init__(self, url: str, config: dict[str, str] | None = None, client: Any = None,
                 refresh_s: float = 2.0) -> None:
        from confluent_kafka.schema_registry import SchemaRegistryClient

        self.url = url
        # new_client() gives the in-process registry for mock:// URLs (tests) and a real client otherwise.
        # Few, short client retries: `wait` and the callers retry with their own deadlines and messages.
        conf = {"url": url, "max.retries": 1, "retries.wait.ms": 200, "retries.max.wait.ms": 1000, **(config or {})}
        self.client = client or SchemaRegistryClient.new_client(conf)
        self.refresh_s = refresh_s  # at most one scan for unknown fingerprints per this many seconds
        self._lock = threading.Lock()
        self._ids: dict[bytes, int] = {}  # fingerprint -> id, of schemas registered or seen here
        self._by_id: dict[int, dict[str, Any]] = {}  # id -> schema JSON
        self._by_fp: dict[bytes, tuple[int, dict[str, Any]]] = {}  # fingerprint -> (id, schema JSON)
        self._seen_versions: set[tuple[str, int]] = set()  # (subject, version) already fingerprinted
        self._ruled: set[str] = set()  # subjects whose rule this process has set
        self._scanned_at = 0.0

    # ---- start-up ------------------------------------------------------------------------------

    def wait(self, timeout_s: float, echo: Callable[[str], Any] = log.warning) -> None:
        """Returns once the registry answers; raises SchemaRegistryError after `timeout_s`."""
        deadline = time.monotonic() + timeout_s
        said = 0.0
        while True:
            try:
                self.client.get_subjects()
                return
            except Exception as exc:  # connection refused, DNS, HTTP 5xx: all mean "not yet"
                now = time.monotonic()
                if now >= deadline:
                    raise SchemaRegistryError(
                        f"the schema registry at {self.url} did not answer within {timeout_s:.0f}s ({exc}); "
                        "start one with `astraflow registry up`, or fix kafka.schema_registry_url"
                    ) from exc
                if now - said >= 5.0:
                    echo(f"waiting for the schema registry at {self.url} ({exc}); start-up continues once it answers "
                         f"(`astraflow registry up` starts a local one); giving up in {deadline - now:.0f}s")
                    said = now
                time.sleep(0.5)

    def register(self, fullname: str, raw: dict[str, Any]) -> int:
        """Registers one schema under its record's subject; returns its id (cached)."""
        fp = schema_fingerprint(raw)
        with self._lock:
            sid = self._ids.get(fp)
        if sid is not None:
            return sid
        from confluent_kafka.schema_registry import Schema
        from confluent_kafka.schema_registry.error import SchemaRegistryError as ClientError

        try:
            sid = self.client.register_schema(fullname, Schema(json.dumps(raw), "AVRO"))
        except ClientError as exc:
            raise SchemaRegistryError(
                f"the schema registry at {self.url} refuses {fullname} (fingerprint {fp.hex()}): "
                f"{exc.error_message} (HTTP {exc.http_status_code}); check it with the gate "
                "(tests/unit/test_schema_compat.py) against the subject's rule"
            ) from exc
        except Exception as exc:
            raise SchemaRegistryError(f"cannot register {fullname} in the schema registry at {self.url}: {exc}") from exc
        with self._lock:
            self._ids[fp] = sid
            self._by_id[sid] = raw
            self._by_fp[fp] = (sid, raw)
        return sid

    def register_history(self, fullname: str, history: Iterable[dict[str, Any]], rule: str | None) -> list[int]:
        """Registers a record's versions oldest first, setting the subject's rule after the first."""
        ids = []
        for i, raw in enumerate(history):
            ids.append(self.register(fullname, raw))
            if i == 0 and rule and fullname not in self._ruled and not self.url.startswith("mock://"):  # mock: no rules
                try:
                    self.client.set_compatibility(subject_name=fullname, level=rule)
                    self._ruled.add(fullname)
                except Exception as exc:  # a registry without per-subject rules: the gate still holds
                    log.warning("schema registry %s: cannot set %s's compatibility to %s: %s", self.url, fullname, rule, exc)
        return ids

    # ---- reading -------------------------------------------------------------------------------

    def schema_by_id(self, schema_id: int) -> dict[str, Any]:
        """The writer schema a Confluent-framed record names; UnknownSchemaError if the registry has none."""
        with self._lock:
            raw = self._by_id.get(schema_id)
        if raw is not None:
            return raw
        try:
            schema = self.client.get_schema(schema_id)
        except Exception as exc:
            raise UnknownSchemaError(
                f"schema id {schema_id} is not in the schema registry at {self.url} ({exc}); the record's writer "
                "did not register it there, or this role points at another registry"
            ) from exc
        raw = json.loads(schema.schema_str)
        with self._lock:
            self._by_id[schema_id] = raw
            self._by_fp[schema_fingerprint(raw)] = (schema_id, raw)
        return raw

    def schema_by_fingerprint(self, fp: bytes, subjects: Iterable[str]) -> tuple[int, dict[str, Any]] | None:
        """The registered schema with this fingerprint among `subjects`' versions, or None.

        Scans at most once per `refresh_s`, so a stream of garbage fingerprints cannot flood the
        registry; a real newer writer registered its schema before its first record, so one scan
        finds it."""
        with self._lock:
            hit = self._by_fp.get(fp)
            if hit is not None or time.monotonic() - self._scanned_at < self.refresh_s:
                return hit
            self._scanned_at = time.monotonic()
        for subject in subjects:
            try:
                versions = self.client.get_versions(subject)
            except Exception:  # no such subject (yet)
                continue
            for v in versions:
                if (subject, v) in self._seen_versions:
                    continue
                reg = self.client.get_version(subject, v)
                raw = json.loads(reg.schema.schema_str)
                with self._lock:
                    self._by_fp[schema_fingerprint(raw)] = (reg.schema_id, raw)
                    self._by_id[reg.schema_id] = raw
                    self._seen_versions.add((subject, v))
        with self._lock:
            return self._by_fp.get(fp)


_SHARED: dict[str, SchemaRegistry] = {}
_SHARED_LOCK = threading.Lock()


def shared(url: str, config: dict[str, str] | None = None) -> SchemaRegistry:
    """The process's registry client for `url` (what it learnt is shared by every serde)."""
    with _SHARED_LOCK:
        reg = _SHARED.get(url)
        if reg is None:
            reg = _SHARED[url] = SchemaRegistry(url, config)
        return reg
