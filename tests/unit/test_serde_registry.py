"""Readers obtain writers' schemas from a schema registry (the in-process mock:// one here; the
real Apicurio in tests/integration/test_registry_*.py): a newer writer's version is resolved into
the reader's own, an unresolvable one is refused naming the schema, and a registry that does not
answer stops start-up with a message that says what to do."""

import json
import shutil
import uuid
from pathlib import Path

import pytest

from astraflow.config import KafkaSettings
from astraflow.errors import IncompatibleSchemaError, SchemaRegistryError, UnknownSchemaError
from astraflow.records import Task
from astraflow.schema_catalog import SchemaCatalog, default_schemas_dir
from astraflow.schema_registry import SchemaRegistry
from astraflow.serde import AvroSerde
from astraflow.testing import make_task

pytestmark = pytest.mark.unit


def _catalog_with_task_v2(tmp_path: Path, change) -> SchemaCatalog:
    root = tmp_path / "schemas"
    shutil.copytree(default_schemas_dir(), root)
    raw = json.loads((root / "task" / "v1.avsc").read_text())
    change(raw)
    (root / "task" / "v2.avsc").write_text(json.dumps(raw))
    return SchemaCatalog.load(root)


def _added_with_default(raw: dict) -> None:
    raw["fields"].append({"name": "priority", "type": "int", "default": 7})


def _registry() -> SchemaRegistry:
    return SchemaRegistry(f"mock://{uuid.uuid4().hex}")


@pytest.mark.parametrize("framing", ["single_object", "confluent"])
def test_old_reader_resolves_a_newer_writer_through_the_registry(tmp_path: Path, framing: str) -> None:
    registry = _registry()
    new = AvroSerde(_catalog_with_task_v2(tmp_path, _added_with_default), registry=registry, framing=framing)
    new.register_schemas()
    data = new.encode("astraflow.Task", {**make_task(3).to_avro(), "priority": 9})
    assert data[:2] == b"\xc3\x01" if framing == "single_object" else data[0] == 0
    old = AvroSerde(registry=SchemaRegistry(registry.url, client=registry.client), framing="single_object")
    task = old.loads(data, Task)  # v2 resolved into the shipped v1: `priority` dropped
    assert task.task_id == "task-3"
    # ...and the newer reader reads the old writer's records, with the default.
    assert new.decode(old.dumps(make_task(4)))[1]["priority"] == 7


def test_without_a_registry_a_newer_fingerprint_is_refused_by_name(tmp_path: Path) -> None:
    data = AvroSerde(_catalog_with_task_v2(tmp_path, _added_with_default)).dumps(make_task(1))
    with pytest.raises(UnknownSchemaError, match=r"fingerprint [0-9a-f]{16} is not among"):
        AvroSerde().loads(data)
    with pytest.raises(UnknownSchemaError, match="nor in the schema registry"):
        AvroSerde(registry=_registry(), framing="single_object").loads(data)


def test_an_unresolvable_writer_is_refused_naming_both_schemas(tmp_path: Path) -> None:
    def drop_prompt(raw: dict) -> None:  # `prompt` has no default: old readers cannot fill it
        raw["fields"] = [f for f in raw["fields"] if f["name"] != "prompt"]

    registry = _registry()
    new = AvroSerde(_catalog_with_task_v2(tmp_path, drop_prompt), registry=registry, framing="confluent")
    datum = {k: v for k, v in make_task(2).to_avro().items() if k != "prompt"}
    data = new.encode("astraflow.Task", datum)
    old = AvroSerde(registry=SchemaRegistry(registry.url, client=registry.client))
    with pytest.raises(IncompatibleSchemaError, match=r"writer schema astraflow.Task \(registry id \d+, fingerprint [0-9a-f]{16}\) "
                       r"cannot be resolved to this reader's astraflow.Task v1"):
        old.loads(data)


def test_unknown_schema_id_names_the_id() -> None:
    with pytest.raises(UnknownSchemaError, match="schema id 4242 is not in the schema registry"):
        AvroSerde(registry=_registry()).loads(b"\x00" + (4242).to_bytes(4, "big") + b"\x02")


def test_registry_down_stops_start_up_with_what_to_do() -> None:
    kafka = KafkaSettings(schema_registry_url="http://127.0.0.1:9/apis/ccompat/v7", schema_registry_wait_s=1.0)
    with pytest.raises(SchemaRegistryError, match="did not answer within 1s.*astraflow registry up"):
        AvroSerde.for_kafka(kafka)


def test_confluent_framing_needs_a_registry() -> None:
    with pytest.raises(ValueError, match="schema_registry_url"):
        KafkaSettings(record_framing="confluent")
    assert KafkaSettings().record_framing is None and AvroSerde.for_kafka(KafkaSettings()).framing == "single_object"
