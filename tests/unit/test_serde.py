import io
import json
import shutil
from pathlib import Path

import avro.io
import avro.schema
import numpy as np
import pytest

from astraflow.errors import (
    CorruptRecordError,
    RecordTooLargeError,
    SchemaValidationError,
    UnknownSchemaError,
)
from astraflow.records import (
    Control,
    DeadLetter,
    Metric,
    PolicyVersion,
    PromptStats,
    Task,
    TrainSample,
    Trajectory,
    WeightChunk,
    WeightKind,
)
from astraflow.schema_catalog import SchemaCatalog, default_schemas_dir
from astraflow.serde import AvroSerde
from astraflow.testing import make_task, make_trajectory


@pytest.fixture(scope="module")
def serde() -> AvroSerde:
    return AvroSerde()


def _same_trajectory(a: Trajectory, b: Trajectory) -> None:
    assert a.trajectory_id == b.trajectory_id and a.tool_calls == b.tool_calls and a.timings == b.timings
    assert len(a.segments) == len(b.segments)
    for x, y in zip(a.segments, b.segments, strict=True):
        for f in ("token_ids", "logprobs", "loss_mask", "versions"):
            np.testing.assert_array_equal(getattr(x, f), getattr(y, f))
        assert (x.policy, x.role, x.text) == (y.policy, y.role, y.text)


def test_trajectory_round_trip_zero_copy(serde: AvroSerde) -> None:
    t = make_trajectory(4096, reward=1.0)
    data = serde.dumps(t)
    assert data[:2] == b"\xc3\x01"
    back = serde.loads(data, Trajectory)
    _same_trajectory(t, back)
    assert back.reward == 1.0 and back.num_tokens == 4096
    ids = back.segments[1].token_ids
    assert ids.dtype == np.dtype("<i4") and not ids.flags.owndata and not ids.flags.writeable


@pytest.mark.parametrize(
    "record",
    [
        make_task(3),
        TrainSample("s", "t", "g", "p", "pol", np.arange(5), np.ones(5, np.uint8), np.zeros(5), np.zeros(5), 0.5, 1.0, 3),
        PolicyVersion("pol", 2, WeightKind.DELTA, "bfloat16", 3, 100, "ab", "cd", 10, 640, base_version=1),
        WeightChunk("pol", 2, 0, 3, b"\x00\x01", 123),
        Control("curate", "advantage", "grpo", 2, {"eps": "1e-6"}),
        PromptStats("p", "d", "pol", 1, 4, 0.5, 0.4, 0.5, 0.5, 30.0, 0, 2),
        Metric("rollouts_per_s", 3.5, "raas", "node-1", {"region": "eu"}),
        DeadLetter(b"\x00junk", "af.x.rollouts", 1, 42, "CorruptRecordError", "bad", "reward"),
    ],
    ids=lambda r: type(r).__name__,
)
def test_every_record_round_trips(serde: AvroSerde, record) -> None:
    back = serde.loads(serde.dumps(record), type(record))
    a, b = record.to_avro(), back.to_avro()
    assert a.keys() == b.keys()
    for k in a:
        assert a[k] == pytest.approx(b[k]) if isinstance(a[k], float) else a[k] == b[k], k


def test_corrupt_bytes(serde: AvroSerde) -> None:
    with pytest.raises(CorruptRecordError, match="header"):
        serde.loads(b"hello world")
    data = serde.dumps(make_task())
    with pytest.raises(CorruptRecordError, match="corrupt or truncated"):
        serde.loads(data[:-7])
    with pytest.raises(CorruptRecordError, match="trailing"):
        serde.loads(data + b"\x00")
    with pytest.raises(CorruptRecordError, match="tombstone"):
        serde.loads(None)  # type: ignore[arg-type]


def test_unknown_fingerprint(serde: AvroSerde) -> None:
    data = bytearray(serde.dumps(make_task()))
    data[2:10] = b"\x01" * 8
    with pytest.raises(UnknownSchemaError, match="0101010101010101"):
        serde.loads(bytes(data))


def test_record_failing_schema(serde: AvroSerde) -> None:
    bad = make_task().to_avro()
    bad["n_samples"] = "four"
    with pytest.raises(SchemaValidationError, match="n_samples"):
        serde.encode("astraflow.Task", bad)
    del bad["prompt"]
    with pytest.raises(SchemaValidationError, match=r"Task v1"):
        serde.encode("astraflow.Task", bad)


def test_wrong_record_type(serde: AvroSerde) -> None:
    with pytest.raises(SchemaValidationError, match="expected a astraflow.Trajectory"):
        serde.loads(serde.dumps(make_task()), Trajectory)


def test_oversized_record() -> None:
    small = AvroSerde(max_record_bytes=10_000)
    with pytest.raises(RecordTooLargeError, match="claim-check"):
        small.dumps(make_trajectory(4096))
    with pytest.raises(RecordTooLargeError, match="limit of this consumer"):
        small.loads(AvroSerde().dumps(make_trajectory(4096)))


def test_old_schema_version_decodes_into_current(tmp_path: Path) -> None:
    """A record written with v1 decodes through its fingerprint into a v2 with a new field."""
    root = tmp_path / "schemas"
    shutil.copytree(default_schemas_dir(), root)
    v2 = json.loads((root / "task" / "v1.avsc").read_text())
    v2["fields"].append({"name": "priority", "type": "int", "default": 7})
    (root / "task" / "v2.avsc").write_text(json.dumps(v2))
    old = AvroSerde(SchemaCatalog.load(default_schemas_dir()))
    new = AvroSerde(SchemaCatalog.load(root))
    name, datum = new.decode(old.dumps(make_task(5)))
    assert name == "astraflow.Task" and datum["priority"] == 7 and datum["task_id"] == "task-5"
    assert [v.version for v in new.catalog.versions("astraflow.Task")] == [1, 2]


def test_interop_with_official_avro_package(serde: AvroSerde) -> None:
    """Our bytes decode with Apache's `avro` reading the .avsc file, and the reverse."""
    path = SchemaCatalog.load(default_schemas_dir()).latest("astraflow.Trajectory").path
    schema = avro.schema.parse(path.read_text())
    t = make_trajectory(256, reward=0.5)
    data = serde.dumps(t)
    datum = avro.io.DatumReader(schema).read(avro.io.BinaryDecoder(io.BytesIO(data[10:])))
    assert datum["trajectory_id"] == t.trajectory_id and datum["reward"] == 0.5
    np.testing.assert_array_equal(np.frombuffer(datum["segments"][1]["token_ids"], "<i4"), t.segments[1].token_ids)

    buf = io.BytesIO()
    avro.io.DatumWriter(schema).write(datum, avro.io.BinaryEncoder(buf))
    framed = b"\xc3\x01" + serde.catalog.latest("astraflow.Trajectory").fingerprint + buf.getvalue()
    _same_trajectory(t, serde.loads(framed, Trajectory))


def test_confluent_framing_with_registry() -> None:
    s = AvroSerde(registry_url="mock://af-test")
    data = s.dumps(make_task(1))
    assert data[0] == 0
    assert s.loads(data, Task).task_id == "task-1"
    # A second serde sharing the registry decodes by id, without having registered anything.
    other = AvroSerde(registry_client=s.registry.client)
    assert other.loads(data, Task).task_id == "task-1"
    # Single-object records still decode where a registry is configured.
    assert s.loads(AvroSerde().dumps(make_task(2)), Task).task_id == "task-2"


def test_confluent_framing_without_registry_explains() -> None:
    data = AvroSerde(registry_url="mock://af-test2").dumps(make_task(1))
    with pytest.raises(UnknownSchemaError, match="schema_registry_url"):
        AvroSerde().loads(data)
