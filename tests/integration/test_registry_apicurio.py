"""The real schema registry (Apicurio, `astraflow registry up`, the `schema_registry` fixture):
roles register every shipped version with its record's rule, the registry refuses a change the
rule forbids naming the field, and an old reader obtains a newer writer's schema from it."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
from confluent_kafka.schema_registry import SchemaRegistryClient
from typer.testing import CliRunner

from astraflow.config import KafkaSettings
from astraflow.errors import SchemaRegistryError
from astraflow.records import Task
from astraflow.schema_catalog import SchemaCatalog, default_schemas_dir
from astraflow.schema_compat import load_rules
from astraflow.schema_registry import SchemaRegistry
from astraflow.serde import AvroSerde
from astraflow.testing import make_task
from astraflow_cli.main import app

pytestmark = pytest.mark.timeout(120)


def test_registry_roles_register_every_version_with_its_rule(schema_registry: str) -> None:
    AvroSerde.for_kafka(KafkaSettings(schema_registry_url=schema_registry))
    client = SchemaRegistryClient({"url": schema_registry})
    catalog = SchemaCatalog.load()
    assert set(catalog.names()) <= set(client.get_subjects())
    rules = load_rules()
    for name in catalog.names():
        assert client.get_compatibility(name) == rules[name]
        assert len(client.get_versions(name)) >= len(catalog.versions(name))


def test_registry_refuses_an_incompatible_change_naming_the_field(schema_registry: str) -> None:
    AvroSerde.for_kafka(KafkaSettings(schema_registry_url=schema_registry))
    raw = json.loads(SchemaCatalog.load().latest("astraflow.Task").path.read_text())
    raw["fields"] = [f for f in raw["fields"] if f["name"] != "prompt"]  # no default: old readers cannot fill it
    with pytest.raises(SchemaRegistryError, match=r"refuses astraflow.Task .*prompt"):
        SchemaRegistry(schema_registry).register("astraflow.Task", raw)


def test_registry_serves_a_newer_writers_schema_to_an_old_reader(schema_registry: str, tmp_path: Path) -> None:
    root = tmp_path / "schemas"
    shutil.copytree(default_schemas_dir(), root)
    raw = json.loads((root / "task" / "v1.avsc").read_text())
    raw["fields"].append({"name": "registry_test_priority", "type": "int", "default": 0, "doc": "test-only"})
    (root / "task" / "v2.avsc").write_text(json.dumps(raw))
    newer = AvroSerde(SchemaCatalog.load(root), registry=SchemaRegistry(schema_registry), framing="single_object")
    newer.register_schemas()  # what a newer role does on start
    data = newer.encode("astraflow.Task", {**make_task(8).to_avro(), "registry_test_priority": 3})

    old = AvroSerde.for_kafka(KafkaSettings(schema_registry_url=schema_registry, record_framing="single_object"))
    assert old.loads(data, Task).task_id == "task-8"  # fingerprint unknown to schemas/, found in the registry


def test_registry_status_says_how_to_start_it(tmp_path: Path) -> None:
    res = CliRunner().invoke(app, ["registry", "status", "--data-dir", str(tmp_path), "--port", "18999"])
    assert res.exit_code == 1
    assert "down" in res.output and "astraflow registry up" in res.output
