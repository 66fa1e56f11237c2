"""bench/apps.py's hand-written reference does the apps' job: for the same inputs, `HandReward` and
`HandCurate` give the records (topic, key, bytes) that the reward and curate apps give through the
engine's record path (`StreamEngine._handle`: decode, handle, the DLQ rule), dead letters included."""

from __future__ import annotations

import os
from typing import Any

import _common
import pytest
from _apps_hand import HandCurate, HandReward
from stream_fakes import FakeControl, Issued, Latest

from astraflow.config import KafkaSettings, TopicSettings
from astraflow.kafka.received import Received
from astraflow.kafka.topics import Topics
from astraflow.records import PolicyVersion, Trajectory, WeightKind
from astraflow.serde import AvroSerde
from stream_apps.curate import CurateApp
from stream_apps.engine import _OUTBOX, _PARTITION, EngineSettings, StreamEngine
from stream_apps.reward import RewardApp

pytestmark = pytest.mark.unit

EXP = "unit-hand"
NOW = 1_700_000_000.0


@pytest.fixture(autouse=True)
def frozen_clock(monkeypatch: pytest.MonkeyPatch) -> list[float]:
    """One wall clock for both sides (prompt statistics and records carry the time they were made)."""
    now = [NOW]
    monkeypatch.setattr("time.time", lambda: now[0])
    return now


def engine_for(handler: Any) -> StreamEngine:
    """A StreamEngine that is never started: its record path runs on the handler, without Faust."""
    return StreamEngine(handler, EngineSettings(EXP, KafkaSettings()))


def through_engine(engine: StreamEngine, call: Any, partition: int = 0) -> list[tuple[str, bytes | None, bytes]]:
    """What the engine queues for Kafka while `call()` runs (as for one record of `partition`)."""
    box: list[Any] = []
    tokens = _OUTBOX.set(box), _PARTITION.set(partition)
    try:
        assert call() is None  # these strategies run inline
    finally:
        _OUTBOX.reset(tokens[0])
        _PARTITION.reset(tokens[1])
    return [(o.topic, o.key, o.value) for o in box]


def received(value: bytes, offset: int, key: bytes | None, topic: str) -> Received[Any]:
    return Received(None, topic, 0, offset, key, 0, value, {})


def serdes() -> tuple[AvroSerde, AvroSerde]:
    serde = AvroSerde()
    return serde, AvroSerde(serde.catalog, max_record_bytes=TopicSettings().max_message_bytes)


def reward_inputs(serde: AvroSerde) -> list[tuple[bytes, bytes | None]]:
    trajs = _common.trajectories(25, 32, 8)  # groups g0, g1, g2 of 8, and one more
    for t in trajs[16:24]:  # a group where every answer is right: curate's zero-variance filter drops it
        t.final_answer = "4"
    trajs[24].reference = "not json {"  # exact match raises: DLQ, named
    wrong = PolicyVersion("policy", 1, WeightKind.DELTA, "bf16", 0, 0, "", "", 0, 0)  # another schema
    return [(serde.dumps(t), t.group_id.encode()) for t in trajs] + [(os.urandom(300), b"junk"), (serde.dumps(wrong), None)]


def test_hand_written_reward_gives_the_apps_records() -> None:
    serde, dlq = serdes()
    app = RewardApp()
    engine = engine_for(app)
    app.bind(engine)
    hand = HandReward(EXP, serde, dlq)
    src = Topics(EXP).rollouts
    ours, theirs = [], []
    for offset, (value, key) in enumerate(reward_inputs(serde)):
        inc = received(value, offset, key, src)
        ours.append(through_engine(engine, lambda inc=inc: engine._handle(inc)))
        theirs.append(hand.process(received(value, offset, key, src)))
    assert theirs == ours
    topics = [t for outs in ours for t, _, _ in outs]
    assert topics.count(Topics(EXP).scored) == 24 and topics.count(Topics(EXP).dlq) == 3


def test_hand_written_curate_gives_the_apps_records(frozen_clock: list[float]) -> None:
    serde, dlq = serdes()
    topics = Topics(EXP)
    reward = HandReward(EXP, serde, dlq)
    scored = [out for offset, (v, k) in enumerate(reward_inputs(serde))
              for out in reward.process(received(v, offset, k, topics.rollouts)) if out[0] == topics.scored]
    partial = scored[8:11]  # the second group: three members now, the rest after its timeout (late)
    inputs = [*scored[:8], *partial, *scored[16:], scored[2], (topics.scored, b"junk", os.urandom(200))]
    unscored = _common.trajectories(1, 32, 1)[0]
    inputs.append((topics.scored, b"u", serde.dumps(unscored)))

    app = CurateApp(["policy"], group_timeout_s=30.0)
    engine = engine_for(app)
    engine.control = FakeControl()  # type: ignore[assignment]
    engine.tables = {"groups": {}, "emitted": {}}  # plain dicts: table writes are the engine's, not the app's outputs
    app.worker = engine
    app.init_slots(engine.control)
    app._train_topics = {"policy": True}
    app.versions = Latest({})
    app.feedback = Latest({})
    app.tasks = Issued()  # the curator issued every group's task
    for _, _, value in inputs[:-2]:
        t = serde.loads(value, Trajectory)
        app.tasks.issue(t.task_id, t.group_id, t.prompt_id, t.group_size)
    hand = HandCurate(EXP, serde, dlq, ["policy"], group_timeout_s=30.0, claim=app.tasks.claim)

    ours, theirs = [], []
    for offset, (_, key, value) in enumerate(inputs):
        inc = received(value, offset, key, topics.scored)
        ours += through_engine(engine, lambda inc=inc: engine._handle(inc))
        theirs += hand.process(received(value, offset, key, topics.scored))
    frozen_clock[0] += 31  # the partial group times out: emitted with its three members
    expired = app.store.expired(frozen_clock[0])
    assert [p.group_id for p in expired] == ["g1"]
    ours += through_engine(engine, lambda: app._expire("g1"))
    theirs += hand.tick(0.0)
    late = scored[12]  # a member of the timed-out group arriving after it left: the DLQ
    ours += through_engine(engine, lambda: engine._handle(received(late[2], 99, late[1], topics.scored)))
    theirs += hand.process(received(late[2], 99, late[1], topics.scored))

    assert theirs == ours
    counts: dict[str, int] = {}
    for topic, _, _ in ours:
        counts[topic] = counts.get(topic, 0) + 1
    assert counts[topics.train("policy")] == 8 + 3  # g0, and g1 at its timeout; g2 has zero variance
    assert counts[topics.feedback] == 3 and counts[topics.lineage] == 1  # g2's drop
    assert counts[topics.dlq] == 3  # the bytes, the unscored trajectory, the late member
