"""The compiled encoder writes exactly fastavro's bytes, and refuses what fastavro's validate refuses."""

import io

import numpy as np
import pytest
from fastavro import parse_schema, schemaless_reader, schemaless_writer

from astraflow.avro_encoder import compile_encoder
from astraflow.errors import SchemaValidationError
from astraflow.records import (
    Control,
    DeadLetter,
    GroupDropped,
    Metric,
    PolicyVersion,
    PromptStats,
    StrategyRef,
    ToolCall,
    TrainedSamples,
    TrainSample,
    TrajectoryStatus,
    WeightChunk,
    WeightKind,
)
from astraflow.serde import AvroSerde
from astraflow.testing import make_task, make_trajectory


def _fastavro_bytes(parsed, datum) -> bytes:
    buf = io.BytesIO()
    schemaless_writer(buf, parsed, datum)
    return buf.getvalue()


def _compiled_bytes(parsed, datum) -> bytes:
    out: list[bytes] = []
    compile_encoder(parsed)(datum, out.append)
    return b"".join(out)


def _rich_trajectory():
    t = make_trajectory(9000, reward=-0.25, version=70_000)  # token arrays over the varint table
    t.tool_calls = [ToolCall(1, "calc", '{"x": "2+2"}', "4", 0.5), ToolCall(2, "ßearch", "{}", "", 1e-9, "timeout")]
    t.final_answer = "4 ✓"
    t.reference = None
    t.status = TrajectoryStatus.TRUNCATED
    t.error = "x" * 20_000  # a string whose length needs a multi-byte varint
    t.reward_components = {"format": 1.0, "answer": -3.5e300}
    t.lineage = [StrategyRef("curate", "advantage", "grpo", 2**31 - 1), StrategyRef("reward", "r", "n", -(2**31))]
    t.metadata = {"": "", "k": "v" * 300}
    t.created_at = -1
    t.temperature = 0.5  # exact in float32
    return t


RECORDS = [
    make_trajectory(4096),
    _rich_trajectory(),
    make_task(3),
    TrainSample("s", "t", "g", "p", "pol", np.arange(5), np.ones(5, np.uint8), np.zeros(5), np.zeros(5), 0.5, 1.0, 3,
                lineage=[StrategyRef("a", "b", "c", 1)]),
    PolicyVersion("pol", 2, WeightKind.DELTA, "bfloat16", 3, 2**40, "ab", "cd", 10, 640, base_version=1,
                  uri="s3://x", metadata={"a": "b"}),
    WeightChunk("pol", 2, 0, 3, b"\x00\x01" * 5000, 2**32 - 1),
    Control("curate", "advantage", "grpo", 2, {"eps": "1e-6"}),
    PromptStats("p", "d", "pol", 1, 4, 0.5, 0.4, 0.5, 0.5, 30.0, 0, 2),
    Metric("rollouts_per_s", float("inf"), "raas", "node-1", {"region": "eu"}),
    DeadLetter(b"\x00junk", "af.x.rollouts", 1, 42, "CorruptRecordError", "bad", "reward", original_key=None),
    DeadLetter(None, "t", -1, -(2**63), "E", "", "c", original_key=b"", strategy="s", headers={"h": "1"}),
    GroupDropped("g", "t", "p", "pol", ["t/0", "t/1"], "curate", "filter.zero_variance", "zv", "all equal"),
    TrainedSamples("pol", 3, 7, "trainer-0", [], [], part=0, parts=1),
]


@pytest.mark.parametrize("record", RECORDS, ids=lambda r: type(r).__name__)
def test_same_bytes_as_fastavro(record) -> None:
    parsed = AvroSerde().catalog.latest(record.SCHEMA).parsed
    datum = record.to_avro()
    data = _compiled_bytes(parsed, datum)
    assert data == _fastavro_bytes(parsed, datum)
    assert schemaless_reader(io.BytesIO(data), parsed, None).keys() == datum.keys()


@pytest.mark.parametrize("record", [_rich_trajectory(), make_task(2)], ids=lambda r: type(r).__name__)
def test_every_field_comes_back_where_it_was(record) -> None:
    serde = AvroSerde()
    back = serde.loads(serde.dumps(record), type(record))
    assert back.to_avro() == record.to_avro()
    assert back == record


def test_fields_left_out_take_their_schema_defaults_like_fastavro() -> None:
    parsed = AvroSerde().catalog.latest("astraflow.Task").parsed
    datum = make_task(1).to_avro()
    for name in ("reference", "metadata", "lineage"):
        del datum[name]
    assert _compiled_bytes(parsed, datum) == _fastavro_bytes(parsed, datum)


@pytest.mark.parametrize(
    ("field", "value"),
    [
        ("n_samples", "four"),  # a string for an int
        ("n_samples", 2.0),  # a float for an int
        ("n_samples", 2**31),  # out of an int's range
        ("n_samples", None),
        ("prompt", b"bytes"),  # bytes for a string
        ("prompt", 5),
        ("reference", 5),  # neither null nor a string
        ("policies", "policy"),  # a string for an array
        ("policies", [1]),
        ("metadata", {"k": 1}),  # a map value of the wrong type
        ("metadata", {1: "v"}),  # a key that is not a string
        ("created_at", 2**63),  # out of a long's range
    ],
)
def test_wrong_values_are_refused_naming_the_field(field, value) -> None:
    datum = make_task(1).to_avro()
    datum[field] = value
    with pytest.raises(SchemaValidationError, match=field):
        AvroSerde().encode("astraflow.Task", datum)


def test_wrong_nested_values_are_refused() -> None:
    serde = AvroSerde()
    for mutate in (
        lambda d: d["segments"][0].__setitem__("token_ids", np.zeros(3, np.int32)),  # an array, not bytes
        lambda d: d.__setitem__("status", "DONE"),  # not an enum symbol
        lambda d: d["timings"].__setitem__("generate_s", "1s"),
        lambda d: d.__setitem__("reward", "high"),
        lambda d: d["segments"][1].pop("role"),  # a field without a default
    ):
        datum = make_trajectory(64).to_avro()
        mutate(datum)
        with pytest.raises(SchemaValidationError, match="Trajectory"):
            serde.encode("astraflow.Trajectory", datum)


def test_schemas_it_cannot_encode_are_refused_when_compiled() -> None:
    schema = parse_schema({"type": "record", "name": "U", "fields": [{"name": "u", "type": ["int", "string"]}]})
    with pytest.raises(ValueError, match="union"):
        compile_encoder(schema)
    schema = parse_schema({"type": "record", "name": "F", "fields": [{"name": "f", "type": {"type": "fixed", "name": "H", "size": 4}}]})
    with pytest.raises(ValueError, match="not supported"):
        compile_encoder(schema)


def test_other_sequences_and_mappings_write_like_lists_and_dicts() -> None:
    from types import MappingProxyType

    parsed = AvroSerde().catalog.latest("astraflow.Task").parsed
    datum = make_task(1).to_avro()
    datum["metadata"] = {"a": "b"}
    other = {**datum, "policies": tuple(datum["policies"]), "metadata": MappingProxyType(datum["metadata"]),
             "reference": "ref"}
    datum["reference"] = "ref"
    assert _compiled_bytes(parsed, other) == _compiled_bytes(parsed, datum) == _fastavro_bytes(parsed, datum)
