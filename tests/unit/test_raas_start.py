"""Which buffered tasks a RaaS node starts: samples are counted against max_inflight, in order.

A node at max-inflight 16 with groups of 8 used to start a task whenever fewer than 16 rollouts
ran, so one finished sample let 8 more in (23 requests on 16 engine rows, the rest queued in the
engine). Here the node's rollouts are stand-ins that end when the test says so; no broker.
"""

from __future__ import annotations

import asyncio
import collections
from types import SimpleNamespace

from astraflow.config import AstraflowConfig
from astraflow.kafka.offsets import OffsetTracker
from astraflow.kafka.received import Received
from astraflow.raas.node import NodeSettings, RaasNode
from astraflow.records import Task
from astraflow.testing import make_task


def _rec(offset: int, n: int) -> Received[Task]:
    return Received(make_task(offset, n_samples=n), "tasks", 0, offset, None, 0, b"", {})


class _Node:
    """A RaasNode with only what starting tasks uses; each started task holds its samples until
    `finish(offset, k)` ends k of them."""

    def __init__(self, max_inflight: int, pending: list[Received[Task]]) -> None:
        node = RaasNode.__new__(RaasNode)
        node.cfg, node.s = AstraflowConfig(), NodeSettings("exp", max_inflight=max_inflight)
        node.backends = {"policy": object()}
        node.offsets, node.inflight, node.tasks_refused = OffsetTracker(), 0, 0
        node._pending, node._head, node._running = collections.deque(pending), None, set()
        self.refused: list[int] = []
        node.consumer = SimpleNamespace(dead_letter=lambda rec, exc: self.refused.append(rec.offset))
        self.node, self.started, self.left = node, [], {}
        self.peak = 0

        async def serve(rec, workflow, epoch) -> None:
            self.started.append(rec.offset)
            self.peak = max(self.peak, node.inflight)
            self.left[rec.offset] = rec.record.n_samples

        node._serve = serve  # type: ignore[method-assign]

    async def start(self) -> None:
        self.node._start_ready()
        await asyncio.sleep(0)  # the started tasks' coroutines run

    def finish(self, offset: int, k: int) -> None:
        self.left[offset] -= k
        self.node.inflight -= k


def test_groups_start_when_all_their_samples_fit_in_order_and_bad_tasks_are_refused_at_once() -> None:
    bad = _rec(3, 8)
    bad.record.n_samples = 0  # outside the limits: refused whatever room there is
    n = _Node(16, [_rec(0, 8), _rec(1, 8), _rec(2, 8), bad, _rec(4, 40), _rec(5, 1)])

    async def scenario() -> None:
        await n.start()
        assert n.started == [0, 1] and n.node.inflight == 16
        n.finish(0, 1)  # one sample of task 0 ends: 15 run, 8 do not fit
        await n.start()
        assert n.started == [0, 1] and n.node.inflight == 15
        n.finish(0, 7)
        await n.start()  # task 2 fits; the bad task behind it is refused at once; 40 samples wait
        assert n.started == [0, 1, 2] and n.refused == [3] and n.node.tasks_refused == 1
        assert n.node.inflight == 16 and [r.offset for r in n.node._pending] == [4, 5]
        n.finish(1, 8)
        await n.start()
        assert n.started == [0, 1, 2]  # task 5 (1 sample) fits but waits its turn behind task 4
        n.finish(2, 8)
        await n.start()  # nothing runs: the task larger than the node starts alone
        assert n.started == [0, 1, 2, 4] and n.node.inflight == 40 and [r.offset for r in n.node._pending] == [5]
        n.finish(4, 40)
        await n.start()
        assert n.started == [0, 1, 2, 4, 5] and not n.node._pending

    asyncio.run(scenario())
    assert n.peak == 40  # the lone larger task; at most 16 otherwise (checked step by step above)


def test_a_rollout_ending_during_a_slow_commit_has_its_room_refilled_at_once() -> None:
    import threading

    n = _Node(16, [_rec(0, 8), _rec(1, 8), _rec(2, 8)])
    node = n.node
    release = threading.Event()
    committed: list[list[tuple[str, int, int]]] = []

    def commit(offsets, asynchronous=True) -> None:  # a broker that takes its time
        release.wait(10)
        committed.append([(tp.topic, tp.partition, tp.offset) for tp in offsets])

    node.consumer.raw = SimpleNamespace(commit=commit)
    node.dlq = SimpleNamespace(count=0)
    node._slot_freed = None

    async def scenario() -> None:
        node._slot_freed = asyncio.Event()
        await n.start()
        assert n.started == [0, 1]
        node.offsets.finished(("other", 0), 5, node.offsets.received(("other", 0), 5))  # something to commit
        commit_task = asyncio.create_task(node._commit_in_thread(start_meanwhile=True))
        await asyncio.sleep(0.05)
        n.finish(0, 8)
        node._slot_freed.set()
        for _ in range(100):
            await asyncio.sleep(0.01)
            if n.started == [0, 1, 2]:
                break
        assert n.started == [0, 1, 2] and not committed  # started while the commit still waits
        release.set()
        await commit_task
        assert len(committed) == 1 and ("other", 0, 6) in committed[0]

    asyncio.run(scenario())
