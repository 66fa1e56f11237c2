"""A rolling upgrade, counted: roles on the shipped Trajectory schema and roles on a newer one run
side by side on a real Kafka, under load, and are upgraded one by one, through the real
registry (Apicurio, `astraflow registry up`) and through confluent-kafka's in-process one.

The newer schema is a test-only fixture (not a version in schemas/): it adds `region` with a
default and removes `temperature`, which had one, so it is FULL_TRANSITIVE-compatible with every
shipped version (the gate says so first). Two writers (a node not yet upgraded and one upgraded)
feed `rollouts`; two relays (like reward) re-encode into `scored` with their own version and
framing; two sinks (like a trainer) train each sample id once: at least once delivery, and the
trainer's own `SampleWindow` drops an id already trained (a commit refused in a rebalance means
a redelivery, as in the real roles). Every role has its own registry client
and registers its schemas on start (Apicurio checks the newer version against FULL_TRANSITIVE). Counted: every record reaches a sink, none is lost, none is
dead-lettered for compatibility, none trained twice, and every mix of writer and reader version
happened. Then a writer with an incompatible schema sends its records: one single-object and unregistered,
and, where the registry lets it register (the in-process one has no rules; Apicurio refuses it,
naming the field), one Confluent-framed: each goes to the DLQ naming the schema, and the relays go
on.
"""

from __future__ import annotations

import contextlib
import json
import shutil
import threading
import time
import uuid
from collections import Counter
from pathlib import Path
from typing import Any

import pytest

from astraflow.config import KafkaSettings
from astraflow.errors import KafkaLayerError, SchemaRegistryError
from astraflow.kafka.clients import RecordConsumer, RecordProducer
from astraflow.kafka.read import read_range
from astraflow.kafka.received import DeadLetterWriter
from astraflow.records import DeadLetter
from astraflow.rl.samples import SampleWindow
from astraflow.schema_catalog import SchemaCatalog, default_schemas_dir
from astraflow.schema_compat import check_candidate
from astraflow.schema_registry import SchemaRegistry, schema_fingerprint
from astraflow.serde import AvroSerde
from astraflow.testing import make_trajectory

pytestmark = pytest.mark.timeout(240)
PER_WRITER = 150  # good records per writer, at least
TRAJ = "astraflow.Trajectory"


class BuildSerde(AvroSerde):
    """The serde of a role built against `catalog`: it hands records on as dicts of its own
    latest version (what that build's record class would hold) and notes each writer version."""

    def __init__(self, catalog: SchemaCatalog, registry: SchemaRegistry, framing: str, seen: list[tuple[bytes, str]],
                 build: str) -> None:
        super().__init__(catalog, registry=registry, framing=framing)  # type: ignore[arg-type]
        self.seen, self.build = seen, build
        self.register_schemas()

    def loads(self, data: bytes, expect: Any = None) -> Any:
        _, datum = self.decode(data)
        raw = self.registry.schema_by_id(int.from_bytes(data[1:5], "big")) if data[0] == 0 else None  # type: ignore[union-attr]
        self.seen.append((schema_fingerprint(raw) if raw else bytes(data[2:10]), self.build))
        return datum


def _catalog(tmp: Path, name: str, change: Any) -> SchemaCatalog:
    root = tmp / name
    shutil.copytree(default_schemas_dir(), root)
    latest = SchemaCatalog.load(root).latest(TRAJ)
    raw = json.loads(latest.path.read_text())
    change(raw)
    (root / "trajectory" / f"v{latest.version + 1}.avsc").write_text(json.dumps(raw))
    return SchemaCatalog.load(root)


def _newer(raw: dict) -> None:
    raw["fields"] = [f for f in raw["fields"] if f["name"] != "temperature"]
    raw["fields"].append({"name": "region", "type": "string", "default": "", "doc": "test-only"})


def _incompatible(raw: dict) -> None:
    raw["fields"] = [f for f in raw["fields"] if f["name"] != "group_id"]  # group_id has no default


def _incompatible_too(raw: dict) -> None:
    raw["fields"] = [f for f in raw["fields"] if f["name"] != "prompt_id"]  # nor has prompt_id


class Role(threading.Thread):
    """A relay (rollouts -> scored, at least once) or a sink (takes each trajectory id once)."""

    def __init__(self, kafka: KafkaSettings, serde: BuildSerde, src: str, group: str, dlq: str, dst: str | None,
                 trained: list[str], window: SampleWindow) -> None:
        super().__init__(daemon=True, name=f"{'relay' if dst else 'sink'}-{serde.build}")
        self.kafka, self.serde, self.src, self.group, self.dlq_topic, self.dst = kafka, serde, src, group, dlq, dst
        self.trained, self.window = trained, window  # the sinks share one window (the trainer's checkpoint)
        self.redelivered = 0
        self.dead_lettered = 0
        self.stop = threading.Event()
        self.ready = threading.Event()
        self.error: BaseException | None = None

    def run(self) -> None:
        try:
            producer = RecordProducer(self.kafka, self.serde)
            dlq = DeadLetterWriter(producer, self.dlq_topic, self.name)
            consumer = RecordConsumer(self.kafka, self.group, [self.src], component=self.name, dlq=dlq, serde=self.serde)
            self.ready.set()
            while not self.stop.is_set():
                batch = consumer.poll_batch(100, 0.2)
                for r in batch:
                    if self.dst:
                        producer.send_raw(self.dst, self.serde.encode(TRAJ, r.record), key=r.key)
                    elif r.record["trajectory_id"] in self.window:
                        self.redelivered += 1
                    else:
                        self.window.extend([r.record["trajectory_id"]])
                        self.trained.append(r.record["trajectory_id"])
                producer.flush()
                self.dead_lettered = consumer.dead_lettered
                with contextlib.suppress(KafkaLayerError):  # a rebalance under way: the next commit, or the new owner, covers it
                    consumer.commit()
            consumer.close()
        except BaseException as exc:  # reported by the test
            self.error = exc
            self.ready.set()


def _writer(kafka: KafkaSettings, serde: AvroSerde, topic: str, datum: Any, stop: threading.Event,
            written: list[str]) -> threading.Thread:
    """Writes `datum(i)` for i = 0, 1, ... at a steady pace until `stop` is set (at least PER_WRITER)."""

    def run() -> None:
        producer = RecordProducer(kafka, serde)
        i = 0
        while i < PER_WRITER or not stop.is_set():
            d = datum(i)
            producer.send_raw(topic, serde.encode(TRAJ, d), key=d["trajectory_id"])
            written.append(d["trajectory_id"])
            i += 1
            time.sleep(0.01)  # a steady load while roles come and go
        producer.flush()

    t = threading.Thread(target=run, daemon=True)
    t.start()
    return t


@pytest.mark.parametrize("registry_kind", ["apicurio", "in_process"])
@pytest.mark.parametrize("relay_framing", ["single_object", "confluent"])
def test_rolling_upgrade_mixed_schema_versions(kafka: KafkaSettings, topic_factory, tmp_path: Path, relay_framing: str,
                                               registry_kind: str, request: pytest.FixtureRequest) -> None:
    old_cat = SchemaCatalog.load()
    new_cat = _catalog(tmp_path, "new", _newer)
    bad_cat = _catalog(tmp_path, "bad", _incompatible)
    bad2_cat = _catalog(tmp_path, "bad2", _incompatible_too)
    assert check_candidate(old_cat, new_cat.latest(TRAJ).raw) == []  # the gate lets the upgrade through
    assert check_candidate(old_cat, bad_cat.latest(TRAJ).raw)  # ...and would refuse the incompatible one

    if registry_kind == "apicurio":
        url = request.getfixturevalue("schema_registry")

        def registry() -> SchemaRegistry:  # a client (and its caches) per role
            return SchemaRegistry(url)
    else:
        store = SchemaRegistry(f"mock://{uuid.uuid4().hex}")

        def registry() -> SchemaRegistry:  # one in-process store, a client (and its caches) per role
            return SchemaRegistry(store.url, client=store.client)

    rollouts, scored, dlq = topic_factory("rollouts", 4), topic_factory("scored", 4), topic_factory("dlq", 1)
    relay_group, sink_group = f"relay-{uuid.uuid4().hex[:6]}", f"sink-{uuid.uuid4().hex[:6]}"
    relay_seen: list[tuple[bytes, str]] = []
    sink_seen: list[tuple[bytes, str]] = []
    trained: list[str] = []
    window = SampleWindow(10 * PER_WRITER)
    old_fp, new_fp = old_cat.latest(TRAJ).fingerprint, new_cat.latest(TRAJ).fingerprint

    def role(build: str, sink: bool) -> Role:
        cat = old_cat if build == "old" else new_cat
        serde = BuildSerde(cat, registry(), "single_object" if sink else relay_framing, sink_seen if sink else relay_seen, build)
        r = Role(kafka, serde, scored if sink else rollouts, sink_group if sink else relay_group, dlq, None if sink else scored, trained, window)
        r.start()
        assert r.ready.wait(30) and r.error is None, r.error
        return r

    relays = [role("old", False), role("old", False)]
    sinks = [role("old", True), role("old", True)]

    def old_datum(i: int) -> dict:
        return make_trajectory(16, task_id=f"old-{i}", reward=0.5).to_avro()

    def new_datum(i: int) -> dict:  # what the newer build writes: no temperature, a region
        d = make_trajectory(16, task_id=f"new-{i}", reward=0.5).to_avro()
        return {**{k: v for k, v in d.items() if k != "temperature"}, "region": "eu"}

    stop_writing = threading.Event()
    written: list[str] = []
    writers = [
        _writer(kafka, BuildSerde(old_cat, registry(), "single_object", [], "old"), rollouts, old_datum, stop_writing, written),
        _writer(kafka, BuildSerde(new_cat, registry(), "single_object", [], "new"), rollouts, new_datum, stop_writing, written),
    ]
    try:
        # Upgrade one role at a time, each once more records have gone through.
        for step, (group, i, sink) in enumerate([(relays, 0, False), (sinks, 0, True), (relays, 1, False), (sinks, 1, True)]):
            _wait(lambda n=len(trained): len(trained) >= n + 60, f"step {step}", [*relays, *sinks])  # load flows between steps
            group[i].stop.set()
            group[i].join(30)
            group[i] = role("new", sink)
        _wait(lambda n=len(trained): len(trained) >= n + 60, "load after the upgrade", [*relays, *sinks])
        stop_writing.set()
        for w in writers:
            w.join(120)
        # A writer with an incompatible schema: once unregistered (single-object), once registered (Confluent).
        bad = make_trajectory(16, task_id="bad").to_avro()
        unregistered = AvroSerde(bad_cat).encode(TRAJ, {k: v for k, v in bad.items() if k != "group_id"})
        bad2 = {k: v for k, v in bad.items() if k != "prompt_id"}
        expected_letters = {unregistered}
        probe = RecordProducer(kafka, AvroSerde())
        probe.send_raw(rollouts, unregistered, key=b"bad-1")
        if registry_kind == "apicurio":  # the registry's own rule stops the writer before it writes
            with pytest.raises(SchemaRegistryError, match="prompt_id"):
                AvroSerde(bad2_cat, registry=registry(), framing="confluent").encode(TRAJ, bad2)
        else:
            registered = AvroSerde(bad2_cat, registry=registry(), framing="confluent").encode(TRAJ, bad2)
            probe.send_raw(rollouts, registered, key=b"bad-2")
            expected_letters.add(registered)
        probe.flush()
        _wait(lambda: len(set(trained)) >= len(written), "every record trained", [*relays, *sinks])
        _wait(lambda: sum(r.dead_lettered for r in relays) >= len(expected_letters), "the dead letters", [*relays, *sinks])
    finally:
        for r in [*relays, *sinks]:
            r.stop.set()
        for r in [*relays, *sinks]:
            r.join(30)

    assert all(r.error is None for r in [*relays, *sinks])
    assert len(written) >= 2 * PER_WRITER and set(trained) == set(written)  # 0 lost
    assert Counter(trained).most_common(1)[0][1] == 1  # 0 trained twice
    combos = {(fp, build) for fp, build in relay_seen} | {(fp, build) for fp, build in sink_seen}
    assert {(old_fp, "old"), (old_fp, "new"), (new_fp, "old"), (new_fp, "new")} <= combos
    letters = [r for r in read_range(kafka, dlq, 0, AvroSerde(), 30.0) if isinstance(r, DeadLetter)]
    assert {d.original for d in letters} == expected_letters  # nothing else dead-lettered: 0 for compatibility
    by = {d.error_class: d.error for d in letters}
    bad_fp = bad_cat.latest(TRAJ).fingerprint.hex()
    assert f"fingerprint {bad_fp}" in by["UnknownSchemaError"]
    if registry_kind == "in_process":
        bad2_fp = bad2_cat.latest(TRAJ).fingerprint.hex()
        assert f"writer schema {TRAJ} (registry id" in by["IncompatibleSchemaError"] and bad2_fp in by["IncompatibleSchemaError"]


def _wait(cond: Any, what: str, roles: list[Role], timeout_s: float = 90.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not cond():
        failed = [r for r in roles if r.error is not None]
        assert not failed, f"{failed[0].name}: {failed[0].error!r}"
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.1)
