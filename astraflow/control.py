"""The control topic: operators select strategies per app slot; every worker follows within a second.

A command is a `Control` record keyed `<app>/<slot>` on the experiment's compacted `control`
topic (one partition, so one total order). `ControlWriter.set` writes the next version of a
slot (previous version + 1); `ControlWriter.unset` writes a tombstone (back to the app's
default). `app` may be `*`: a slot for every app, overridden by an app-specific record.

Readers never join a consumer group: each one assigns the partition from the beginning, reads
up to the end before the app starts (so the first record already uses the selected strategy),
then polls for changes without blocking (`ControlReader.refresh`, called by the stream apps
every ~100 ms). The latest record by offset wins, exactly what compaction keeps, so a reader
that restarts ends in the same state as one that followed along.

`CompactedReader` is the same machinery for any compacted topic (`policies`, `feedback`):
latest value per key, bytes in, decoded records out. On an authority topic (`control`: the
operator's; `policies`: the trainers') it takes only records signed by the owner's key
(`astraflow.kafka.signing`), never one signed before the record in force for its key (a
replay), nor on `policies` a version lower than the one in force; a refused record is
dead-lettered with the reason and changes nothing.
"""

from __future__ import annotations

import getpass
import socket
import time
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from astraflow.errors import ConfigError, KafkaLayerError, SerdeError
from astraflow.records import Control

if TYPE_CHECKING:
    from astraflow.config import KafkaSettings
    from astraflow.serde import AvroSerde

EVERYONE = "*"  # app name of a slot that applies to every app


def parse_param_args(items: Iterable[str]) -> dict[str, str]:
    """`["k=v", "weights={\"a\": 1}"]` -> {"k": "v", ...}; values stay strings (strategies decode JSON)."""
    out: dict[str, str] = {}
    for item in items:
        key, sep, value = item.partition("=")
        if not sep or not key.strip():
            raise ConfigError(f"parameter {item!r} must look like name=value (e.g. --param abs_tol=0.01)")
        out[key.strip()] = value
    return out


@dataclass
class ControlState:
    """Latest Control per `<app>/<slot>` key (pure: fed with what the topic holds, in order)."""

    controls: dict[str, Control] = field(default_factory=dict)  # key -> latest record
    generation: int = 0  # bumped on every change, so users can cache what they built from it

    def apply(self, key: str, control: Control | None) -> bool:
        """Takes one record of the topic (None = tombstone); returns whether anything changed."""
        old = self.controls.get(key)
        if control is None:
            if old is None:
                return False
            del self.controls[key]
        else:
            if old is not None and old == control:
                return False
            self.controls[key] = control
        self.generation += 1
        return True

    def get(self, app: str, slot: str) -> Control | None:
        """What selects `slot` of `app`: its own record, else the `*` one, else None (default)."""
        return self.controls.get(f"{app}/{slot}") or self.controls.get(f"{EVERYONE}/{slot}")

    def slots(self, app: str) -> dict[str, Control]:
        """Every slot that has a record for `app` (own or `*`), by slot name."""
        out: dict[str, Control] = {}
        for c in self.controls.values():
            if c.app == EVERYONE:
                out.setdefault(c.slot, c)
        for c in self.controls.values():
            if c.app == app:
                out[c.slot] = c
        return out


def _consumer(kafka: KafkaSettings, max_record_bytes: int) -> Any:
    from astraflow.kafka.clients import reader
    from astraflow.kafka.topics import reader_group

    # A throwaway group id: librdkafka wants one, but the reader only assigns and never commits.
    return reader(kafka, reader_group("control"), max_record_bytes)


class CompactedReader:
    """Latest record per key of a compacted topic, read without a consumer group.

    `catch_up()` reads to the end offsets present when it is called (the last stable ones: what a
    read_committed reader gets); `refresh()` takes whatever
    arrived since, without blocking. `on_record(key, record_or_None)` sees every change in
    order; records that cannot be decoded are counted in `errors` and skipped.
    """

    def __init__(
        self,
        kafka: KafkaSettings,
        topic: str,
        *,
        serde: AvroSerde | None = None,
        expect: type | None = None,
        on_record: Callable[[str, Any], None] | None = None,
        signed: tuple[str, str] | None = None,
        component: str = "reader",
        keep: bool = True,
    ) -> None:
        from astraflow.serde import AvroSerde

        self.topic = topic
        self.serde = serde or AvroSerde.for_kafka(kafka)
        self.expect = expect
        self.on_record = on_record
        self.latest: dict[str, Any] = {}  # key -> decoded record (kept only with keep=True; on_record sees all)
        self._keep = keep
        self.errors: list[str] = []  # why records were skipped (bounded)
        self.refused = 0  # records refused (signature, replay), each dead-lettered
        self.component = component
        # (experiment, stream): an authority topic whose records must carry its owner's signature
        self._signed = signed
        self._verifier: Any = None
        if signed is not None:
            from astraflow.kafka.signing import Verifier

            self._verifier = Verifier(signed[0])
        self._signed_at: dict[str, int] = {}  # key -> signing time of the record in force (replays go back)
        self._kafka = kafka
        self._dlq: Any = None
        self._admin: Any = None  # made at the first catch_up (the end offsets)
        self._consumer = _consumer(kafka, self.serde.max_record_bytes)
        self._partitions = self._assign()

    def _assign(self) -> list[int]:
        from confluent_kafka import OFFSET_BEGINNING, KafkaException, TopicPartition

        deadline = time.monotonic() + 15.0
        while True:
            try:
                md = self._consumer.list_topics(self.topic, timeout=5.0)
                meta = md.topics.get(self.topic)
                if meta is not None and meta.error is None and meta.partitions:
                    parts = sorted(meta.partitions)
                    break
            except KafkaException as exc:
                if time.monotonic() > deadline:
                    raise KafkaLayerError(f"cannot read metadata of {self.topic}: {exc}") from exc
            if time.monotonic() > deadline:
                self._consumer.close()
                raise KafkaLayerError(
                    f"topic {self.topic} does not exist; create the experiment's topics with `astraflow topics create`"
                )
            time.sleep(0.2)
        self._consumer.assign([TopicPartition(self.topic, p, OFFSET_BEGINNING) for p in parts])
        return parts

    def catch_up(self, timeout_s: float = 15.0) -> None:
        """Reads until every partition reached the end offset it had when this was called."""
        from confluent_kafka import TopicPartition

        from astraflow.kafka.clients import admin, consume_ready, stable_ends

        # Every partition's ends in one request, on an admin client's connection: the consumer's
        # own would answer each partition after its held fetch (`stable_ends`), half a second each.
        if self._admin is None:
            self._admin = admin(self._kafka)
        ends = {p: high for p, (low, high) in stable_ends(self._admin, self.topic, self._partitions, timeout_s).items()
                if high > low}
        deadline = time.monotonic() + timeout_s
        done: dict[int, int] = {}
        while any(done.get(p, -1) < end - 1 for p, end in ends.items()):
            if time.monotonic() > deadline:
                raise KafkaLayerError(f"could not read {self.topic} to its end within {timeout_s:.0f}s; is Kafka slow?")
            for msg in consume_ready(self._consumer, 500, 0.2):
                if msg.error() is None:
                    self._take(msg)
                    done[msg.partition()] = msg.offset()
            # Compaction may have removed the last offsets: the position says how far we are.
            for tp in self._consumer.position([TopicPartition(self.topic, p) for p in ends]):
                if tp.offset >= 0:
                    done[tp.partition] = max(done.get(tp.partition, -1), tp.offset - 1)

    def refresh(self, max_records: int = 500) -> int:
        """Takes records that arrived since the last call (never blocks); returns how many."""
        n = 0
        while True:
            msgs = self._consumer.consume(max_records, 0)
            for msg in msgs:
                if msg.error() is None:
                    self._take(msg)
                    n += 1
            if len(msgs) < max_records:
                return n

    def _refuse(self, msg: Any, error: Exception) -> None:
        """Dead-letters a refused record (original bytes, the reason); the state is unchanged."""
        from astraflow.kafka.clients import RecordProducer
        from astraflow.kafka.received import DeadLetterWriter, Received
        from astraflow.kafka.topics import Topics

        self.refused += 1
        if len(self.errors) < 100:
            self.errors.append(f"{self.topic}[{msg.partition()}]@{msg.offset()}: {error}")
        if self._signed is None:
            return
        try:
            if self._dlq is None:
                self._dlq = DeadLetterWriter(RecordProducer(self._kafka), Topics(self._signed[0]).dlq, self.component)
            self._dlq.send(Received.of(msg), error)
            self._dlq.producer.poll(0)
        except Exception as exc:  # the DLQ unreachable: the refusal stands, logged
            import logging

            logging.getLogger("astraflow.control").error("refused %s@%d (%s); cannot dead-letter it: %s",
                                                         self.topic, msg.offset(), error, exc)

    def _fresh(self, key: str, msg: Any, record: Any, signed: Any) -> bool:
        """No replay of a validly signed record: a key's signing time (and a policy's version)
        never goes back, so an old signed record sent again rolls nothing back."""
        from astraflow.kafka.signing import SignatureError

        try:
            before = self._signed_at.get(key)
            if before is not None and signed.ts_ms < before:
                raise SignatureError(f"replayed record on {self._signed[1]} (key {key}): signed at {signed.ts_ms}, "
                                     f"before the record in force ({before})")
            old = self.latest.get(key)
            new_v, old_v = getattr(record, "version", None), getattr(old, "version", None)
            if self._signed[1] == "policies" and isinstance(new_v, int) and isinstance(old_v, int) and new_v < old_v:
                raise SignatureError(f"policy version goes back on policies (key {key}): {new_v} after {old_v}")
        except SignatureError as exc:
            self._refuse(msg, exc)
            return False
        self._signed_at[key] = signed.ts_ms
        return True

    def _take(self, msg: Any) -> None:
        raw_key = msg.key()
        key = raw_key.decode(errors="replace") if isinstance(raw_key, bytes) else str(raw_key)
        value = msg.value()
        record = None
        signed = None
        if self._verifier is not None:  # who wrote it, before its bytes are even decoded
            from astraflow.kafka.signing import SignatureError

            try:
                signed = self._verifier.check(self._signed[1], msg.key(), value, msg.headers())
            except SignatureError as exc:
                self._refuse(msg, exc)
                return
        if value is not None:
            try:
                record = self.serde.loads(value, self.expect)
            except SerdeError as exc:
                if self._signed is not None:
                    self._refuse(msg, exc)
                elif len(self.errors) < 100:
                    self.errors.append(f"{self.topic}[{msg.partition()}]@{msg.offset()}: {exc}")
                return
        if signed is not None and not self._fresh(key, msg, record, signed):
            return
        if record is None or not self._keep:
            self.latest.pop(key, None)
        else:
            self.latest[key] = record
        if self.on_record is not None:
            self.on_record(key, record)

    def close(self) -> None:
        self._consumer.close()
        if self._dlq is not None:
            self._dlq.producer.flush()


class ControlReader:
    """What the control topic currently selects for one app (or for all, with app=None)."""

    def __init__(self, kafka: KafkaSettings, experiment: str, app: str | None = None, *, serde: AvroSerde | None = None):
        from astraflow.kafka.topics import Topics

        self.app = app
        self.state = ControlState()
        self.topic = Topics(experiment).control
        self._reader = CompactedReader(kafka, self.topic, serde=serde, expect=Control, on_record=self._on_record,
                                       signed=(experiment, "control"), component=f"{app or 'every'}-control")
        self.last_change_at: float | None = None  # wall-clock time (time.time()) this reader saw the latest change

    def _on_record(self, key: str, record: Control | None) -> None:
        if self.app is not None and not (key.startswith(f"{self.app}/") or key.startswith(f"{EVERYONE}/")):
            return
        if self.state.apply(key, record):
            self.last_change_at = time.time()

    def start(self, timeout_s: float = 15.0) -> ControlReader:
        """Reads the topic to its end; returns self."""
        self._reader.catch_up(timeout_s)
        return self

    def refresh(self) -> bool:
        """Applies records that arrived since the last call; True if a slot of this app changed."""
        before = self.state.generation
        self._reader.refresh()
        return self.state.generation != before

    def get(self, slot: str) -> Control | None:
        if self.app is None:
            raise ConfigError("a ControlReader for every app needs get_for(app, slot)")
        return self.state.get(self.app, slot)

    def get_for(self, app: str, slot: str) -> Control | None:
        return self.state.get(app, slot)

    @property
    def generation(self) -> int:
        return self.state.generation

    @property
    def errors(self) -> list[str]:
        return self._reader.errors

    def close(self) -> None:
        self._reader.close()


class ControlWriter:
    """Writes control commands: the next version of a slot, or a tombstone."""

    def __init__(self, kafka: KafkaSettings, experiment: str, *, serde: AvroSerde | None = None) -> None:
        self.kafka = kafka
        self.experiment = experiment
        self.serde = serde
        self._signer: Any = None

    @property
    def signer(self) -> Any:
        """The operator's key of this experiment (`astraflow.kafka.signing`): control records are signed."""
        if self._signer is None:
            from astraflow.kafka.signing import Signer

            self._signer = Signer(self.experiment, "operator")
        return self._signer

    def current(self) -> ControlState:
        """Everything the control topic selects now."""
        reader = ControlReader(self.kafka, self.experiment, None, serde=self.serde)
        try:
            reader.start()
            return reader.state
        finally:
            reader.close()

    def set(
        self,
        app: str,
        slot: str,
        strategy: str,
        params: Mapping[str, str] | None = None,
        *,
        issued_by: str | None = None,
    ) -> Control:
        """Writes `<app>/<slot>` = strategy with params, as the slot's next version; returns the record."""
        from astraflow.kafka.clients import RecordProducer
        from astraflow.kafka.topics import Topics

        if not app or "/" in app or not slot or "/" in slot:
            raise ConfigError(f"app {app!r} and slot {slot!r} must be non-empty and free of '/'")
        previous = self.current().controls.get(f"{app}/{slot}")
        control = Control(
            app=app,
            slot=slot,
            strategy=strategy,
            version=(previous.version + 1) if previous else 1,
            params={str(k): str(v) for k, v in (params or {}).items()},
            issued_by=issued_by if issued_by is not None else _whoami(),
        )
        producer = RecordProducer(self.kafka, self.serde)
        value = producer.serde.dumps(control)
        producer.send_raw(Topics(self.experiment).control, value, control.key,
                          self.signer.headers("control", control.key, value))
        producer.flush()
        return control

    def unset(self, app: str, slot: str) -> None:
        """Tombstones `<app>/<slot>`: the app goes back to its default (or the `*` record)."""
        from astraflow.kafka.clients import RecordProducer
        from astraflow.kafka.topics import Topics

        producer = RecordProducer(self.kafka, self.serde)
        key = f"{app}/{slot}"
        producer.send_raw(Topics(self.experiment).control, None, key, self.signer.headers("control", key, None))
        producer.flush()


def _whoami() -> str:
    try:
        user = getpass.getuser()
    except (KeyError, OSError):
        user = "unknown"
    return f"{user}@{socket.gethostname()}"
