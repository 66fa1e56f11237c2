"""An attacker's toolbox: records built and sent with plain fastavro and confluent-kafka only.

Nothing here uses AstraFlow's producer, serde or signing code: the attacker knows the public
schemas (they are in the repository) and reaches the broker, as anyone on the default local
cluster does. `send` writes one record with whatever headers the attacker chooses (a copied
signature, a made-up one, none); `capture` reads a topic's raw records (bytes and headers) as
an eavesdropper would, to replay them later.
"""

from __future__ import annotations

import io
import json
import time
from pathlib import Path
from typing import Any

from confluent_kafka import Consumer, Producer, TopicPartition
from fastavro import parse_schema, schemaless_writer
from fastavro.schema import fingerprint, to_parsing_canonical_form

SCHEMAS = Path(__file__).resolve().parents[2] / "schemas"


def _latest(folder: str) -> dict[str, Any]:
    files = sorted((SCHEMAS / folder).glob("v*.avsc"), key=lambda p: int(p.stem[1:]))
    return json.loads(files[-1].read_text())


def encode(folder: str, record: dict[str, Any]) -> bytes:
    """Avro single-object encoding of `record` with the newest schema in schemas/<folder>/."""
    raw = _latest(folder)
    parsed = parse_schema(raw)
    fp = bytes.fromhex(fingerprint(to_parsing_canonical_form(parsed), "CRC-64-AVRO"))
    out = io.BytesIO()
    out.write(b"\xc3\x01" + fp)
    schemaless_writer(out, parsed, record)
    return out.getvalue()


def defaults(folder: str, **fields: Any) -> dict[str, Any]:
    """A record of schemas/<folder> with every field the attacker does not care about at its default."""
    out = {}
    for f in _latest(folder)["fields"]:
        if "default" in f:
            out[f["name"]] = f["default"]
    out.update(fields)
    return out


class Outsider:
    """A client of the cluster that is not an AstraFlow role."""

    def __init__(self, bootstrap: str) -> None:
        self.bootstrap = bootstrap
        self.producer = Producer({"bootstrap.servers": bootstrap, "message.max.bytes": 16 * 1024 * 1024})

    def send(self, topic: str, value: bytes | None, key: bytes | str | None,
             headers: list[tuple[str, bytes]] | None = None, partition: int | None = None) -> None:
        kw = {} if partition is None else {"partition": partition}
        errors: list[str] = []
        self.producer.produce(topic, value, key, headers=headers or [],
                              on_delivery=lambda err, _m: errors.append(err.str()) if err else None, **kw)
        assert self.producer.flush(30) == 0
        assert not errors, errors

    def capture(self, topic: str, partition: int = 0, timeout_s: float = 30.0) -> list[tuple[bytes | None, bytes | None, list]]:
        """(key, value, headers) of every committed record of one partition, in order."""
        c = Consumer({"bootstrap.servers": self.bootstrap, "group.id": f"eve-{time.monotonic_ns()}",
                      "enable.auto.commit": False, "isolation.level": "read_committed",
                      "enable.partition.eof": True})
        try:
            _, high = c.get_watermark_offsets(TopicPartition(topic, partition), timeout=10)
            c.assign([TopicPartition(topic, partition, 0)])
            out, deadline = [], time.monotonic() + timeout_s
            while time.monotonic() < deadline:
                msg = c.poll(0.5)
                if msg is not None and msg.error() is None:
                    out.append((msg.key(), msg.value(), list(msg.headers() or [])))
                if c.position([TopicPartition(topic, partition)])[0].offset >= high:
                    break
            return out
        finally:
            c.close()


def forged_signature() -> list[tuple[str, bytes]]:
    """An `af-sig` header of the right shape, made up: no key the experiment trusts signed it."""
    return [("af-sig", b"v1:" + b"0" * 16 + b":" + str(int(time.time() * 1000)).encode() + b":" + b"ab" * 64)]
