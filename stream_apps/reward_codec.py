"""The reward app's short path: score a trajectory without decoding or re-encoding its token arrays.

The scored record is the trajectory's record with four fields changed (`reward`,
`reward_components`, `lineage`, and `metadata` when the reward leaves notes), and Avro binary is the concatenation of the fields in schema
order. The Trajectory schema puts every field the reward app changes after the token data:

    head: trajectory_id ... group_size, segments, tool_calls, final_answer, reference, status, error
    tail: reward, reward_components, timings, node, lineage, metadata, created_at, temperature

So a trajectory written with the latest Trajectory schema (single-object framing) is read in
three parts: the fields before `segments` and those after it (up to `error`) with fastavro, and
between them the segments array stepped over by its lengths (every field of a segment is a
string or bytes: a length and that many bytes), so the token arrays are neither copied nor
decoded (fastavro's own skipping reads them into memory: no faster than decoding); then the
tail in full. The scored record is the original bytes of the framing and the head, followed by
the tail encoded again with the new values: its bytes are the ones
`AvroSerde.dumps(with_reward(...))` gives (`tests/unit/test_stream_apps.py` checks it).

Only for reward strategies that say they do not read the segments (`reads_segments = False`
on the strategy class: exact match, numeric, tool use, weighted of those); any other strategy,
an older schema version or a registry framing takes the full decode. The segments of a record
read this way are `NotDecoded`, which raises if anything reads them, so a strategy that
declared wrongly fails (to the DLQ with its name) instead of scoring an empty trajectory. The
token data is still parsed as Avro (a truncated or corrupt record is refused here) but not
checked further: curate decodes every trajectory in full and dead-letters what it cannot use.
"""

from __future__ import annotations

import io
from dataclasses import dataclass
from typing import Any

from fastavro import parse_schema, schemaless_reader

from astraflow.avro_encoder import compile_encoder
from astraflow.dataflow.rewards import note_metadata
from astraflow.errors import AstraflowError, CorruptRecordError, RecordTooLargeError, SchemaValidationError
from astraflow.records import StrategyRef, Trajectory
from astraflow.schema_catalog import _strip_logical_types
from astraflow.serde import SINGLE_OBJECT_MAGIC, AvroSerde

FIRST_TAIL_FIELD = "reward"  # the head ends before it; every field the reward app writes is in the tail
CHANGED = ("reward", "reward_components", "lineage", "metadata")  # metadata: the reward's notes


class NotDecoded(list):  # type: ignore[type-arg]
    """The segments of a trajectory read without them: any read raises."""

    def _refuse(self, *_: Any) -> Any:
        raise AstraflowError("this trajectory was read without its segments (the reward strategy declared "
                             "reads_segments = False but reads them)")

    __iter__: Any = _refuse
    __len__: Any = _refuse
    __getitem__: Any = _refuse
    __bool__: Any = _refuse
    __contains__: Any = _refuse

    def __repr__(self) -> str:
        return "NotDecoded()"


@dataclass(slots=True)
class Unscored:
    """A trajectory read without its segments, with what `RewardCodec.scored` needs to write its copy."""

    trajectory: Trajectory
    cut: int  # offset of the tail in the record's bytes
    tail: dict[str, Any]  # the tail's fields as decoded


class RewardCodec:
    """Reads a trajectory without its segments and writes its scored copy by splicing (module doc)."""

    def __init__(self, serde: AvroSerde) -> None:
        sv = serde.catalog.latest(Trajectory.SCHEMA)
        self.max_record_bytes = serde.max_record_bytes
        self.header = SINGLE_OBJECT_MAGIC + sv.fingerprint
        raw = _strip_logical_types(sv.raw)
        names = [f["name"] for f in raw["fields"]]
        cut = names.index(FIRST_TAIL_FIELD)
        if "segments" not in names[:cut] or any(c not in names[cut:] for c in CHANGED):
            raise AstraflowError(f"{sv.path}: the reward fields must follow the segments for the short path")
        at = names.index("segments")
        seg_fields = raw["fields"][at]["type"]["items"]["fields"]
        if any(f["type"] not in ("string", "bytes") for f in seg_fields):
            raise AstraflowError(f"{sv.path}: the short path steps over segments made of strings and bytes only")
        self._seg_fields = len(seg_fields)
        ns = raw.get("namespace", "astraflow")

        def part(name: str, fields: list[Any]) -> Any:
            return parse_schema({"type": "record", "name": name, "namespace": ns, "fields": fields}, named_schemas={})

        self._before = part("TrajectoryBefore", raw["fields"][:at])
        self._after = part("TrajectoryAfter", raw["fields"][at + 1:cut])
        self._tail = part("TrajectoryTail", raw["fields"][cut:])
        self._write_tail = compile_encoder(self._tail)

    def applies(self, data: bytes | None) -> bool:
        """Whether `data` is a trajectory of the latest schema in single-object framing (else: full decode)."""
        return data is not None and data[:10] == self.header

    def read(self, data: bytes) -> Unscored:
        """The trajectory without its segments, the offset where its tail starts, and the tail as decoded."""
        if len(data) > self.max_record_bytes:
            raise RecordTooLargeError(
                f"record is {len(data):,} bytes, over the {self.max_record_bytes:,}-byte limit of this consumer")
        bio = io.BytesIO(data)
        bio.seek(10)
        try:
            before = schemaless_reader(bio, self._before, None)
            bio.seek(_skip_segments(data, bio.tell(), self._seg_fields))
            after = schemaless_reader(bio, self._after, None)
            cut = bio.tell()
            tail = schemaless_reader(bio, self._tail, None)
        except Exception as exc:  # truncated or garbage body
            raise CorruptRecordError(
                f"{Trajectory.SCHEMA} body cannot be decoded ({type(exc).__name__}: {exc}); the bytes are corrupt "
                "or truncated") from exc
        if bio.tell() != len(data):
            raise CorruptRecordError(
                f"{Trajectory.SCHEMA} record has {len(data) - bio.tell()} trailing bytes after its body; corrupt")
        try:
            traj = Trajectory.from_avro({**before, "segments": (), **after, **tail})
        except (KeyError, ValueError, TypeError) as exc:
            raise SchemaValidationError(f"{Trajectory.SCHEMA} record decoded but is not usable: {exc!r}") from exc
        traj.segments = NotDecoded()
        return Unscored(traj, cut, tail)

    def scored(self, data: bytes, read: Unscored, reward: float, components: dict[str, float],
               ref: StrategyRef | None, notes: dict[str, str] | None = None) -> bytes:
        """The bytes of the scored copy: `data` up to its tail, then the tail with the new reward fields
        (and the reward's notes in its metadata, as `with_reward` writes them)."""
        cut, tail = read.cut, read.tail
        new = {**tail, "reward": reward, "reward_components": dict(components),
               "lineage": [*tail["lineage"], ref.to_avro()] if ref is not None else tail["lineage"],
               "metadata": note_metadata(tail["metadata"], notes or {})}
        out: list[Any] = [memoryview(data)[:cut]]  # copied once, by the join
        try:
            self._write_tail(new, out.append)
        except Exception as exc:  # a component value of the wrong type
            raise SchemaValidationError(f"scored {Trajectory.SCHEMA} record does not encode: {exc!r}") from exc
        body = b"".join(out)
        if len(body) > self.max_record_bytes:
            raise RecordTooLargeError(
                f"{Trajectory.SCHEMA} record is {len(body):,} bytes, over the {self.max_record_bytes:,}-byte limit")
        return body


def _varint(data: bytes, pos: int) -> tuple[int, int]:
    """The zigzag-decoded Avro long at `pos` and the position after it."""
    shift = z = 0
    while True:
        b = data[pos]  # IndexError past the end: a truncated record
        pos += 1
        z |= (b & 0x7F) << shift
        if b < 0x80:
            return (z >> 1) ^ -(z & 1), pos
        shift += 7
        if shift > 63:
            raise ValueError("varint longer than 10 bytes")


def _skip_segments(data: bytes, pos: int, fields: int) -> int:
    """The position after the Avro array of segments at `pos` (records of `fields` strings or bytes)."""
    end = len(data)
    while True:
        count, pos = _varint(data, pos)
        if count == 0:
            return pos
        if count < 0:  # a block with its size in bytes: step over it whole
            size, pos = _varint(data, pos)
            if size < 0:
                raise ValueError(f"negative block size {size}")
            pos += size
        else:
            for _ in range(count * fields):  # a length (zigzag varint, inlined) and that many bytes
                z = data[pos]
                pos += 1
                if z >= 0x80:
                    z &= 0x7F
                    shift = 7
                    while True:
                        b = data[pos]
                        pos += 1
                        z |= (b & 0x7F) << shift
                        if b < 0x80:
                            break
                        shift += 7
                        if shift > 63:
                            raise ValueError("varint longer than 10 bytes")
                if z & 1:
                    raise ValueError("negative length")
                pos += z >> 1
        if pos > end:
            raise ValueError("segments run past the end of the record")
