"""`astraflow registry up` keeps its schemas in a file: after `down` and `up` every id a record on
a topic names resolves to the same schema, a new schema gets an id no record has used, a role
starting while the registry is down waits for it with a message and then gets the same ids, and a
registry killed right after handing out an id still has it when it comes back."""

from __future__ import annotations

import json
import logging
import os
import signal
import struct
import threading
import time
from pathlib import Path

import pytest
from confluent_kafka.schema_registry import SchemaRegistryClient
from typer.testing import CliRunner

from astraflow.config import LocalRegistrySettings
from astraflow.kafka.nodes import alive
from astraflow.local_registry import LocalRegistry
from astraflow.records import Task
from astraflow.schema_registry import SchemaRegistry
from astraflow.serde import AvroSerde
from astraflow.testing import make_task
from astraflow_cli.main import app

pytestmark = pytest.mark.timeout(420)

PORT = "18083"  # this test's own registry; the `schema_registry` fixture's runs on 18082
PROBE = {"type": "record", "name": "RestartProbe", "namespace": "astraflow.test",
         "fields": [{"name": "n", "type": "int", "doc": "test-only"}]}


def cli(data_dir: Path, *args: str) -> tuple[int, str]:
    res = CliRunner().invoke(app, ["registry", *args, "--data-dir", str(data_dir), "--port", PORT],
                             env={"COLUMNS": "400"})
    return res.exit_code, " ".join(res.output.split())


def every_id(client: SchemaRegistryClient) -> dict[int, str]:
    """Schema id -> its schema text, over every version of every subject."""
    ids = {}
    for subject in client.get_subjects():
        for version in client.get_versions(subject):
            reg = client.get_version(subject, version)
            ids[reg.schema_id] = reg.schema.schema_str
    return ids


def test_registry_restart_keeps_schema_ids(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    data = tmp_path / "registry"
    url = f"http://127.0.0.1:{PORT}/apis/ccompat/v7"
    try:
        code, out = cli(data, "up")
        assert code == 0, out
        # A test-only schema first, so the roles' schemas do not get the ids a registry that came
        # back empty would hand out again when the roles register in the same order.
        probe_id = SchemaRegistry(url).register("astraflow.test.RestartProbe", PROBE)
        role = AvroSerde(registry=SchemaRegistry(url), framing="confluent")
        role.register_schemas(wait_s=30)  # what a role does on start (AvroSerde.for_kafka)
        task = make_task(7)
        record = role.dumps(task)
        (task_id,) = struct.unpack(">I", record[1:5])
        before = every_id(SchemaRegistryClient({"url": url}))
        assert probe_id in before and task_id in before and task_id != probe_id

        code, out = cli(data, "down")
        assert code == 0, out
        code, out = cli(data, "status")
        assert code == 1 and "down" in out and f"its schemas are kept in {data.resolve()}/registry.mv.db" in out

        # A role starting now waits for the registry, saying so, and goes on once it is back.
        caplog.set_level(logging.WARNING, logger="astraflow.schema_registry")
        waiting = AvroSerde(registry=SchemaRegistry(url), framing="confluent")
        starter = threading.Thread(target=waiting.register_schemas, kwargs={"wait_s": 300}, daemon=True)
        starter.start()
        deadline = time.monotonic() + 30
        while "waiting for the schema registry" not in caplog.text and time.monotonic() < deadline:
            time.sleep(0.2)
        assert f"waiting for the schema registry at {url}" in caplog.text and "astraflow registry up" in caplog.text
        assert starter.is_alive(), "start-up must wait for the registry, not go on without it"

        code, out = cli(data, "up")
        assert code == 0, out
        code, out = cli(data, "status")
        assert code == 0 and out.startswith("up") and f"schemas={data.resolve()}/registry.mv.db" in out

        # A reader that registers nothing resolves the record's id to the schema it was written with.
        reader = AvroSerde(registry=SchemaRegistry(url))
        assert reader.loads(record, Task) == task
        client = SchemaRegistryClient({"url": url})
        after = every_id(client)
        assert after == before, "every id names the schema it named before the restart"
        assert json.loads(client.get_schema(probe_id).schema_str)["name"] == "RestartProbe"

        starter.join(timeout=120)
        assert not starter.is_alive()
        assert waiting.dumps(task) == record, "the role that waited got the same ids"

        new = {**PROBE, "fields": [*PROBE["fields"], {"name": "m", "type": "int", "default": 0, "doc": "test-only"}]}
        new_id = SchemaRegistry(url).register("astraflow.test.RestartProbe", new)
        assert new_id not in before, f"a new schema got id {new_id}, which records written before name"

        # Killed (no shutdown) right after handing out an id: the id is in the file already.
        pid = LocalRegistry(LocalRegistrySettings(data_dir=data, port=int(PORT))).pid()
        assert pid is not None
        os.kill(pid, signal.SIGKILL)
        while alive(pid):
            time.sleep(0.1)
        deadline = time.monotonic() + 30
        while (code := cli(data, "up")[0]) != 0 and time.monotonic() < deadline:
            time.sleep(1)  # the dying JVM's threads may hold the port for a moment
        assert code == 0
        assert json.loads(SchemaRegistryClient({"url": url}).get_schema(new_id).schema_str) == new
    finally:
        cli(data, "down")
