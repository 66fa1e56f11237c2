"""The Faust agent of a StreamEngine, driven with Faust's own test support (`agent.test_context()`).

No broker: the agent reads an in-memory channel, and what the engine would hand to Kafka's
producer is collected instead (`_produce` is the one place that talks to Kafka). What is
checked is the agent body: decoding with the Avro codec, the handler's outputs, dead letters
with their reason and strategy, the record acked only once its outputs are handed over, and
slow records running concurrently.
"""

from __future__ import annotations

import asyncio
from types import SimpleNamespace
from typing import Any

import pytest
from stream_fakes import FakeControl

from astraflow.config import KafkaSettings
from astraflow.dataflow.registry import register
from astraflow.dataflow.rewards import RewardResult
from astraflow.errors import ConfigError
from astraflow.kafka.topics import Topics
from astraflow.records import Control, DeadLetter, Trajectory
from astraflow.serde import AvroSerde
from astraflow.testing import make_trajectory
from stream_apps.codec import CODEC_NAME, AvroCodec
from stream_apps.engine import EngineSettings, StreamEngine
from stream_apps.reward import RewardApp

EXP = "unit"


@register("reward", "unit_slow", version=1)
class SlowReward:
    """An async reward: sleeps, then scores 1; raises on answer 'boom'."""

    def __init__(self, delay_s: float = 0.05) -> None:
        self.delay_s = float(delay_s)
        self.running = 0
        self.peak = 0

    def __call__(self, t: Trajectory) -> RewardResult:
        raise AssertionError("the engine must use score_async")

    async def score_async(self, t: Trajectory) -> RewardResult:
        self.running += 1
        self.peak = max(self.peak, self.running)
        await asyncio.sleep(self.delay_s)
        self.running -= 1
        if t.final_answer == "boom":
            raise ValueError("slow reward exploded")
        return RewardResult(1.0, {"unit_slow": 1.0})


def engine_with_capture() -> tuple[StreamEngine, list[tuple[str, bytes | None, bytes | None]]]:
    engine = StreamEngine(RewardApp(), EngineSettings(EXP, KafkaSettings(), guarantee="at_least_once", source_partitions=1))
    engine.build()
    engine.control = FakeControl()  # type: ignore[assignment]
    engine.handler.bind(engine)
    sent: list[tuple[str, bytes | None, bytes | None]] = []

    async def produce(outbox: list[Any], partition: int | None) -> None:
        sent.extend((o.topic, o.key, o.value) for o in outbox)

    engine._produce = produce  # type: ignore[method-assign]
    return engine, sent


def traj(i: int, answer: str) -> Trajectory:
    t = make_trajectory(32, task_id=f"t{i}", seed=i)
    t.final_answer, t.reference = answer, '{"answer": "4"}'
    return t


def test_agent_decodes_scores_and_dead_letters_with_reasons() -> None:
    engine, sent = engine_with_capture()
    agent = next(iter(engine.app.agents.values()))
    serde = AvroSerde()
    topics = Topics(EXP)

    async def run() -> None:
        async with agent.test_context() as ctx:
            await ctx.put(serde.dumps(traj(0, "4")), key=b"g-t0")
            await ctx.put(b"random bytes, not avro", key=b"junk")
            await ctx.put(serde.dumps(make_trajectory(8)).replace(b"\xc3\x01", b"\xc3\x01", 1)[:12], key=b"short")
            bad_ref = traj(1, "4")
            bad_ref.reference = "not json"
            await ctx.put(serde.dumps(bad_ref), key=b"g-t1")
            await ctx.put(serde.dumps(traj(2, "five")), key=b"g-t2")

    asyncio.run(run())
    assert [topic for topic, _, _ in sent] == [topics.scored, topics.dlq, topics.dlq, topics.dlq, topics.scored]
    scored = [serde.loads(v) for t, _, v in sent if t == topics.scored]
    assert [(s.trajectory_id, s.reward) for s in scored] == [("t0/0", 1.0), ("t2/0", 0.0)]
    letters = [serde.loads(v, DeadLetter) for t, _, v in sent if t == topics.dlq]
    assert [(d.component, d.error_class, d.strategy) for d in letters] == [
        ("reward", "CorruptRecordError", None), ("reward", "CorruptRecordError", None), ("reward", "RewardError", "exact_match")]
    assert letters[0].original == b"random bytes, not avro" and letters[0].original_key == b"junk"
    assert "not valid JSON" in letters[2].error
    assert engine.stats.records_in == 5 and engine.stats.records_out == 2 and engine.stats.dead_lettered_total == 3


def test_a_record_of_another_schema_is_dead_lettered_not_handled() -> None:
    engine, sent = engine_with_capture()
    agent = next(iter(engine.app.agents.values()))
    serde = AvroSerde()

    async def run() -> None:
        async with agent.test_context() as ctx:
            other = DeadLetter(original=b"x", original_key=None, topic="t", partition=0, offset=0, error_class="E",
                               error="e", component="c")
            await ctx.put(serde.dumps(other), key=b"k")

    asyncio.run(run())
    (topic, _, value), = sent
    dl = serde.loads(value, DeadLetter)
    assert topic == Topics(EXP).dlq and dl.component == "reward" and "Trajectory" in dl.error
    assert engine.stats.records_out == 0


def test_slow_rewards_run_concurrently_and_failures_are_dead_lettered_by_name() -> None:
    engine, sent = engine_with_capture()
    engine.control.state.apply("reward/reward", Control("reward", "reward", "unit_slow", 1, {}, issued_at=0))  # type: ignore[union-attr]
    agent = next(iter(engine.app.agents.values()))
    serde = AvroSerde()

    async def run() -> None:
        async with agent.test_context() as ctx:
            for i in range(6):
                await ctx.put(serde.dumps(traj(i, "boom" if i == 3 else "4")), key=f"g-t{i}".encode())
            while engine._tasks:
                await asyncio.sleep(0.01)

    asyncio.run(run())
    topics = Topics(EXP)
    assert sorted(serde.loads(v).trajectory_id for t, _, v in sent if t == topics.scored) == [f"t{i}/0" for i in (0, 1, 2, 4, 5)]
    (dl,) = [serde.loads(v, DeadLetter) for t, _, v in sent if t == topics.dlq]
    assert dl.strategy == "unit_slow" and "slow reward exploded" in dl.error
    assert engine.stats.inflight_peak > 1  # they overlapped
    assert engine.tracker.pending() == 0  # every record finished


def test_the_faust_codec_round_trips_typed_records() -> None:
    from faust.serializers import codecs

    codec = codecs.get_codec(CODEC_NAME)
    assert isinstance(codec, AvroCodec)
    t = traj(0, "4")
    back = codec.loads(codec.dumps(t))
    assert isinstance(back, Trajectory) and back.trajectory_id == t.trajectory_id


def test_the_faust_native_entry_builds_the_same_engine_from_the_environment() -> None:
    import pytest

    from astraflow.errors import ConfigError
    from stream_apps.faust_worker import build_from_env

    engine = build_from_env({"ASTRAFLOW_EXPERIMENT": EXP, "ASTRAFLOW_APP": "curate", "ASTRAFLOW_POLICIES": "a,b",
                             "ASTRAFLOW_GUARANTEE": "at_least_once"})
    assert engine.handler.name == "curate" and engine.handler.policies == ("a", "b")  # type: ignore[attr-defined]
    assert engine.group_id == f"af.{EXP}.curate" and not engine.exactly_once
    proc = build_from_env({"ASTRAFLOW_EXPERIMENT": EXP, "ASTRAFLOW_PROCESSOR": "stream_apps.examples.tool_errors:tool_errors"})
    assert proc.group_id == f"af.{EXP}.proc.tool-errors" and proc.exactly_once
    for bad in ({"ASTRAFLOW_APP": "reward"}, {"ASTRAFLOW_EXPERIMENT": EXP, "ASTRAFLOW_APP": "curator"}):
        with pytest.raises(ConfigError):
            build_from_env(bad)


def test_activity_arms_the_idle_commit_which_waits_until_the_worker_was_quiet_for_commit_idle_s(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """No periodic check: a record arriving or finishing arms one timer, which, when it fires,
    commits if the worker has been quiet for `commit_idle_s` since the last record and otherwise
    waits out the rest (so the commit comes `commit_idle_s` after a burst, not up to twice that).
    The engine's clock is a fake one here and the timer is fired by hand."""
    engine = StreamEngine(RewardApp(), EngineSettings(EXP, KafkaSettings(), commit_idle_s=30.0, source_partitions=1))
    clock = SimpleNamespace(now=0.0)
    monkeypatch.setattr("stream_apps.engine.time", SimpleNamespace(monotonic=lambda: clock.now))
    commits: list[set[int]] = []

    async def commit() -> None:
        commits.append(set(engine._dirty))
        engine._dirty = set()

    engine.commit = commit  # type: ignore[method-assign]

    async def scenario() -> None:
        engine._dirty = {0}
        engine._note_active()  # t=0: a record finished
        armed = engine._idle_due
        assert armed is not None
        clock.now = 10.0
        engine._note_active()  # another one: the same timer, moved on when it fires
        assert engine._idle_due is armed
        clock.now = 30.0
        engine._idle_deadline()  # fires at 30: quiet for 20 s only
        await asyncio.sleep(0)
        assert commits == [] and engine._idle_due is not None and engine._idle_due is not armed
        clock.now = 40.0
        engine._idle_deadline()  # quiet for 30 s: commits
        await asyncio.sleep(0)
        assert commits == [{0}] and engine._idle_due is None
        engine._note_active()  # a record arrives; nothing produced since the commit
        clock.now = 70.0
        engine._idle_deadline()
        await asyncio.sleep(0)
        assert commits == [{0}] and engine._idle_due is None

    asyncio.run(scenario())


def test_faust_overrides_replace_the_engine_settings() -> None:
    settings = EngineSettings("unit", KafkaSettings(), guarantee="at_least_once", source_partitions=1,
                              faust_overrides={"producer_linger": 0.02, "stream_buffer_maxsize": 64})
    engine = StreamEngine(RewardApp(), settings)
    app = engine.build()
    assert app.conf.producer_linger == 0.02
    assert app.conf.stream_buffer_maxsize == 64


def test_the_app_hands_over_faust_events_with_its_kept_event_class_and_lean_fetch_loop() -> None:
    from faust.transport.consumer import Consumer as FaustConsumer

    from stream_apps.handover import drain_messages

    app = StreamEngine(RewardApp(), EngineSettings("unit", KafkaSettings(), guarantee="at_least_once",
                                                   source_partitions=1)).build()
    message = SimpleNamespace(topic="t", partition=0, offset=5)
    event = app.create_event(b"k", b"v", [("h", b"1")], message)
    assert type(event) is app.conf.Event  # the class Faust would look up itself
    assert (event.app, event.key, event.value, event.headers, event.message) == (app, b"k", b"v", {"h": b"1"}, message)
    assert app.transport.Consumer._drain_messages is drain_messages
    assert FaustConsumer._drain_messages is not drain_messages  # Faust's own class is left as it is


def test_the_worker_writes_snappy_batches_that_read_back() -> None:
    from aiokafka.record.default_records import DefaultRecordBatch, DefaultRecordBatchBuilder

    settings = EngineSettings("unit", KafkaSettings(), guarantee="at_least_once", source_partitions=1)
    assert settings.compression == "snappy"
    app = StreamEngine(RewardApp(), settings).build()
    assert app.producer._settings_default()["compression_type"] == "snappy"  # what aiokafka's producer gets
    none = StreamEngine(RewardApp(), EngineSettings("unit", KafkaSettings(), guarantee="at_least_once",
                                                    source_partitions=1, compression="none")).build()
    assert none.producer._settings_default()["compression_type"] is None
    with pytest.raises(ConfigError, match="compression"):
        EngineSettings("unit", KafkaSettings(), compression="brotli")  # type: ignore[arg-type]

    # A batch as aiokafka's producer builds it with that codec (transactional, as under exactly-once).
    values = [AvroSerde().dumps(make_trajectory(4096, seed=s)) for s in (3, 4)]
    b = DefaultRecordBatchBuilder(magic=2, compression_type=DefaultRecordBatch.CODEC_SNAPPY, is_transactional=1,
                                  producer_id=7, producer_epoch=0, base_sequence=0, batch_size=1 << 20)
    for i, v in enumerate(values):
        b.append(i, timestamp=None, key=b"k", value=v, headers=[])
    data = bytes(b.build())
    assert len(data) < 0.8 * sum(map(len, values))  # compressed
    batch = DefaultRecordBatch(bytearray(data))
    assert batch.compression_type == DefaultRecordBatch.CODEC_SNAPPY
    assert [r.value for r in batch] == values  # and it reads back as Faust's consumers read it



class _Batch:
    """aiokafka's BatchBuilder as `flush_partition` uses it: full after `capacity` records."""

    def __init__(self, capacity: int) -> None:
        self.capacity, self.values = capacity, []  # type: list[bytes | None]

    def append(self, *, key: bytes | None, value: bytes | None, timestamp: None, headers: list[tuple[str, bytes]]) -> object | None:
        if len(self.values) >= self.capacity and self.values:
            return None
        self.values.append(value)
        return object()


class _TxProducer:
    """The calls a source partition's transactional producer gets, in order."""

    def __init__(self, capacity: int) -> None:
        self.calls: list[Any] = []
        self.capacity = capacity
        self.client = SimpleNamespace(_wait_on_metadata=self._metadata)

    async def _metadata(self, topic: str) -> None:
        pass

    def _partition(self, topic: str, partition: None, key: bytes, value: bytes, skey: bytes, svalue: bytes) -> int:
        return int(key[-1:])  # aiokafka's murmur2 of the key in the real producer; here the key's last digit

    def create_batch(self) -> _Batch:
        return _Batch(self.capacity)

    async def send_batch(self, batch: _Batch, topic: str, *, partition: int) -> asyncio.Future[None]:
        self.calls.append(("batch", topic, partition, batch.values))
        fut = asyncio.get_running_loop().create_future()
        fut.set_result(None)
        return fut

    async def send_offsets_to_transaction(self, offsets: dict[Any, int], group: str) -> None:
        self.calls.append(("offsets", *offsets.values()))

    async def commit_transaction(self) -> None:
        self.calls.append("commit")

    async def begin_transaction(self) -> None:
        self.calls.append("begin")


def test_outputs_go_to_the_transaction_in_batches_before_the_offsets_they_commit() -> None:
    from stream_apps.engine import SEND_BATCH_BYTES, SEND_LINGER_S, _Out
    from stream_apps.transactions import ExactTransactionManager

    engine = StreamEngine(RewardApp(), EngineSettings(EXP, KafkaSettings(), source_partitions=1))
    txp = _TxProducer(capacity=2)
    producer = SimpleNamespace(_transaction_producers={f"app-{p}": txp for p in (0, 1)},
                               _trn_locks={f"app-{p}": asyncio.Lock() for p in (0, 1)})
    engine.app = SimpleNamespace(producer=producer, conf=SimpleNamespace(id="app"))  # type: ignore[assignment]
    manager = ExactTransactionManager.__new__(ExactTransactionManager)
    manager.app = SimpleNamespace(astraflow_engine=engine, conf=SimpleNamespace(id="app"),  # type: ignore[assignment]
                                  monitor=SimpleNamespace(on_tp_commit=lambda offsets: None),
                                  consumer=SimpleNamespace(_thread=SimpleNamespace(_commit_recorded=lambda tp: None)))
    manager.producer = producer  # type: ignore[assignment]
    tp = (engine.source, 0)

    async def run() -> list[Any]:
        for offset, outs in enumerate([
            [_Out("train", b"g1", b"a"), _Out("changelog", b"k", b"c0", partition=0, table=True)],
            [_Out("train", b"g0", b"b"), _Out("train", b"g1", b"d")],
            [_Out("train", b"g1", b"e"), _Out("changelog", b"k", b"c1", partition=0, table=True),
             _Out("changelog", b"j", b"c2", partition=0, table=True)],
        ]):
            epoch = engine.tracker.received(tp, offset)
            await engine._produce(outs, 0)
            engine.tracker.finished(tp, offset, epoch)
        assert txp.calls == []  # kept: small outputs, the linger has not passed
        await manager.commit_partition(0)
        first_commit = list(txp.calls)
        txp.calls.clear()
        await engine._produce([_Out("train", b"g1", b"x" * SEND_BATCH_BYTES)], 1)  # a MiB kept: handed over now
        assert txp.calls == [("batch", "train", 1, [b"x" * SEND_BATCH_BYTES])]
        txp.calls.clear()
        await engine._produce([_Out("train", b"g1", b"z")], 1)
        await asyncio.sleep(SEND_LINGER_S * 4)  # kept outputs go to the open transaction after the linger
        assert txp.calls == [("batch", "train", 1, [b"z"])]
        txp.calls.clear()
        await engine._produce([_Out("train", b"g1", b"y")], 1)
        engine.forget_unsent(1)  # a producer gone: nothing of it is sent later
        await asyncio.sleep(SEND_LINGER_S * 4)
        await manager.commit_partition(1)
        assert txp.calls == ["commit", "begin"]
        assert engine._unsent == {} and engine._lingering == {}
        return first_commit

    first_commit = asyncio.run(run())
    # One batch per destination partition, in the records' order, split when full, a table's
    # key written twice in the transaction only once (its last value); then the offset past the
    # three records, then the commit.
    assert first_commit == [("batch", "train", 1, [b"a", b"d"]), ("batch", "train", 1, [b"e"]),
                            ("batch", "train", 0, [b"b"]), ("batch", "changelog", 0, [b"c1", b"c2"]),
                            ("offsets", 3), "commit", "begin"]


def test_a_key_born_and_deleted_in_one_hand_over_writes_nothing_to_the_changelog() -> None:
    from stream_apps.engine import _last_table_writes, _Out

    def cl(key: bytes, value: bytes | None, born: bool, partition: int = 0) -> _Out:
        return _Out("groups-changelog", key, value, partition, table=True, born=born)

    outs = [
        cl(b"g1", b"m1", born=True), _Out("train", b"g0", b"s0"), cl(b"g1", b"m1m2", born=False),
        cl(b"g1", None, born=False),  # g1 assembled and emitted here: nothing for the changelog
        cl(b"g2", b"m1", born=False), cl(b"g2", None, born=False),  # g2 was held before: its tombstone goes
        cl(b"g3", b"m1", born=True), cl(b"g3", None, born=False), cl(b"g3", b"again", born=True),  # last: a value
        cl(b"g4", None, born=False),  # only deleted here, held before
        cl(b"g1", b"other partition", born=True, partition=1),
    ]
    kept = _last_table_writes(outs)
    assert [(o.topic, o.key, o.value, o.partition) for o in kept] == [
        ("train", b"g0", b"s0", None), ("groups-changelog", b"g2", None, 0), ("groups-changelog", b"g3", b"again", 0),
        ("groups-changelog", b"g4", None, 0), ("groups-changelog", b"g1", b"other partition", 1)]


def test_table_writes_record_whether_the_table_held_the_key_before_them() -> None:
    from stream_apps.engine import _OUTBOX, _PARTITION

    engine = StreamEngine(RewardApp(), EngineSettings(EXP, KafkaSettings(), source_partitions=1))
    data: dict[bytes, bytes] = {b"held": b"v"}
    table = SimpleNamespace(data=data, name="groups",
                            changelog_topic=SimpleNamespace(get_topic_name=lambda: "groups-changelog"))
    outbox: list[Any] = []
    box, part = _OUTBOX.set(outbox), _PARTITION.set(0)
    try:
        engine.changelog(table, b"new", b"x")
        data[b"new"] = b"x"  # as Faust's table does after on_key_set
        engine.changelog(table, b"new", None)
        engine.changelog(table, b"held", None)
    finally:
        _OUTBOX.reset(box)
        _PARTITION.reset(part)
    assert [(o.key, o.value, o.born) for o in outbox] == [(b"new", b"x", True), (b"new", None, False), (b"held", None, False)]
