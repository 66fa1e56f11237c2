"""A stand-in for the stream worker, for driving app handlers (reward, curate, curator, user
processors) by hand without a broker, and the record builders their tests share.

`FakeWorker` stands in for `StreamEngine`: it records what a handler sends, drops and
dead-letters, keeps the app's tables in plain dicts, and serves a `ControlState` the test
changes (the hot swap, minus Kafka). The Faust wiring itself is tested in test_stream_engine.py.
"""

from __future__ import annotations

from collections import Counter
from typing import Any

import numpy as np

from astraflow.config import KafkaSettings
from astraflow.control import ControlState
from astraflow.kafka.received import Received
from astraflow.kafka.topics import Topics
from astraflow.records import Control, PolicyVersion, Segment, Trajectory, WeightKind
from astraflow.serde import AvroSerde
from astraflow.testing import make_trajectory
from stream_apps.curate import CurateApp
from stream_apps.curator import CuratorApp, CuratorOptions
from stream_apps.groups import TaskClaim
from stream_apps.slots import Slot

EXP = "unit"


class FakeControl:
    """The part of ControlReader the apps and their slots read (the control topic, minus Kafka);
    `set` writes a control record."""

    def __init__(self) -> None:
        self.state = ControlState()
        self.version = 0

    @property
    def generation(self) -> int:
        return self.state.generation

    def get_for(self, app: str, slot: str) -> Control | None:
        return self.state.get(app, slot)

    def set(self, app: str, slot: str, strategy: str, **params: str) -> None:
        self.version += 1
        self.state.apply(f"{app}/{slot}", Control(app, slot, strategy, self.version, params, issued_at=0))

    def refresh(self) -> bool:
        return False

    def close(self) -> None:
        pass


class FakeWorker:
    def __init__(self, app_name: str) -> None:
        self.app_name = app_name
        self.control = FakeControl()
        self.control.get = lambda slot: self.control.state.get(app_name, slot)  # type: ignore[attr-defined]
        self.topics = Topics(EXP)
        self.sent: list[tuple[str, Any, Any]] = []
        self.side: list[tuple[str, Any, Any]] = []
        self.dropped: Counter[str] = Counter()
        self.dead: list[tuple[Any, str, str | None]] = []
        self.stopped = False
        self.serde = AvroSerde()
        self.kafka = KafkaSettings()
        self.source = self.topics.scored
        self.encoded: list[bytes] = []  # what send_encoded got, as sent (its record also goes to `sent`)
        self.tables: dict[str, dict[bytes, bytes]] = {"groups": {}, "emitted": {}}
        self.source_records: dict[tuple[int, int], bytes] = {}  # (partition, offset) -> what `reread` finds

    def send(self, topic: str, record: Any, key: Any = None, partition: int | None = None) -> None:
        self.sent.append((topic, record, key))

    def send_encoded(self, topic: str, value: bytes, key: Any = None, partition: int | None = None,
                     headers: dict[str, str] | None = None) -> None:
        self.encoded.append(value)
        self.sent.append((topic, self.serde.loads(value), key))

    def send_side(self, topic: str, record: Any, key: Any = None) -> None:
        self.side.append((topic, record, key))

    def drop(self, reason: str, n: int = 1) -> None:
        self.dropped[reason] += n

    def dead_letter(self, inc: Received[Any], error: Any, strategy: str | None = None) -> None:
        self.dead.append((inc, str(error), strategy))

    def table(self, name: str) -> dict[bytes, bytes]:
        return self.tables[name]

    def reread(self, partition: int, offsets: list[int]) -> dict[int, bytes]:
        return {o: self.source_records[(partition, o)] for o in offsets if (partition, o) in self.source_records}

    def assigned(self) -> set[int]:
        return {0}

    async def in_partition(self, partition: int, fn: Any) -> Any:
        return fn()

    def stop(self) -> None:
        self.stopped = True


def incoming(record: Any, offset: int = 0, partition: int = 0) -> Received[Any]:
    return Received(record, "src", partition, offset, getattr(record, "group_id", "k").encode(), 0,
                     AvroSerde().dumps(record), {}, 1)


def two_policy_traj(group: str, i: int, size: int, reward: float, with_b: bool, version: int = 2) -> Trajectory:
    segs = [Segment.context("a", "prompt", [1, 2]), gen_segment("a", [3, 4, 5], version)]
    if with_b:
        segs.append(gen_segment("b", [6, 7], version + 1))
    t = make_trajectory(8, task_id=group, sample_index=i, group_size=size)
    t.segments, t.reward, t.group_id, t.prompt_id = segs, reward, group, f"prompt-{group}"
    return t


def gen_segment(policy: str, ids: list[int], version: int) -> Segment:
    n = len(ids)
    return Segment(policy, "assistant", np.array(ids, np.int32), np.full(n, -0.5, np.float32), np.ones(n, np.uint8),
                   np.full(n, version, np.int32))


def make_curate(policies: tuple[str, ...] = ("a", "b"), versions: dict[str, int] | None = None, **kw: Any) -> tuple[CurateApp, FakeWorker]:
    w = FakeWorker("curate")
    app = CurateApp(policies, **kw)
    app.worker = w
    app.init_slots(w.control)
    app._train_topics = dict.fromkeys(policies, True)
    app.versions = Latest({p: PolicyVersion(p, v, WeightKind.DELTA, "bf16", 0, 0, "", "", 0, 0) for p, v in (versions or {}).items()})
    app.feedback = Latest({})
    app.tasks = Issued()
    w.tables["prompt_stats"] = {}
    app.on_recovered("prompt_stats")
    return app, w


class Latest:
    """Stands in for a CompactedReader: the latest record per key, nothing new to refresh."""

    def __init__(self, latest: dict[str, Any]) -> None:
        self.latest = latest

    def refresh(self) -> int:
        return 0


class Issued:
    """Stands in for a TaskBook: the tasks the curator issued, group id -> claims."""

    def __init__(self) -> None:
        self.claims: dict[str, TaskClaim] = {}

    def issue(self, task_id: str, group_id: str, prompt_id: str, n_samples: int) -> None:
        self.claims[group_id] = TaskClaim(task_id, group_id, prompt_id, n_samples)

    def claim(self, group_id: str) -> TaskClaim | None:
        return self.claims.get(group_id)

    def refresh(self) -> None:
        pass


def feed(app: CurateApp, trajs: list[Trajectory], issue: bool = True) -> list[Received[Any]]:
    """Hands `trajs` to curate; with `issue`, each group's task is issued first (as the curator
    would have: what its first trajectory says), unless one was issued already."""
    incs = [incoming(t, i) for i, t in enumerate(trajs)]
    for inc, t in zip(incs, trajs, strict=True):
        if issue and t.group_id not in app.tasks.claims:
            app.tasks.issue(t.task_id, t.group_id, t.prompt_id, t.group_size)
        app.handle(inc)
    return incs


def by_policy(w: FakeWorker) -> dict[str, dict[str, float]]:
    out: dict[str, dict[str, float]] = {}
    for topic, s, key in w.sent:
        assert topic == Topics(EXP).train(s.policy) and key == s.group_id
        out.setdefault(s.policy, {})[s.trajectory_id] = s.advantage
    return out


def curator_on_fake_worker(options: CuratorOptions) -> tuple[CuratorApp, FakeWorker]:
    """A curator with `options` on a FakeWorker, its (empty) prompt statistics table recovered."""
    app = CuratorApp(options)
    w = FakeWorker("curator")
    app.worker = w
    app.slot = Slot(w.control, "curator", "curator", "curator", app.defaults["curator"])
    app.tasks_topic, app.trainer_groups = Topics(EXP).tasks, {}
    app.feedback = Latest({})
    app.tasks = Issued()
    w.tables["prompt_stats"] = {}
    app.on_recovered("prompt_stats")  # the worker recovered the curator's (empty) statistics table
    return app, w


def tick(app: CuratorApp, now: float) -> None:
    """One tick of the curator, run to its end (it returns an awaitable when it measures first)."""
    import asyncio

    result = app.tick(now)
    if result is not None:
        asyncio.run(result)  # type: ignore[arg-type]
