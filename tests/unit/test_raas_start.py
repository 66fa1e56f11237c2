"""Which buffered tasks a RaaS node starts: samples are counted against max_inflight, in order,
and a started task's samples start one by one as rollout slots free.

A node at max-inflight 16 with groups of 8 used to start a task whenever fewer than 16 rollouts
ran, so one finished sample let 8 more in (23 requests on 16 engine rows, the rest queued in the
engine); then it waited until all 8 fit, holding up to 7 slots empty meanwhile. Here the node's
rollouts are stand-ins that end when the test says so; no broker.
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
    """A RaasNode with only what starting tasks uses; each started task's samples run once they
    have a slot, until `finish(offset, k)` ends k of its running ones."""

    def __init__(self, max_inflight: int, pending: list[Received[Task]]) -> None:
        node = RaasNode.__new__(RaasNode)
        node.cfg, node.s = AstraflowConfig(), NodeSettings("exp", max_inflight=max_inflight)
        node.backends = {"policy": object()}
        node.offsets, node.inflight, node.tasks_refused = OffsetTracker(), 0, 0
        node._pending, node._head, node._running = collections.deque(pending), None, set()
        node._waiting, node._slot_freed = collections.deque(), SimpleNamespace(set=lambda: None)
        self.refused: list[int] = []
        node.consumer = SimpleNamespace(dead_letter=lambda rec, exc: self.refused.append(rec.offset))
        self.node, self.started = node, []
        self.running: collections.Counter[int] = collections.Counter()  # samples running, per task
        self.peak = 0

        async def serve(rec, workflow, epoch, grants) -> None:
            self.started.append(rec.offset)
            for grant in grants:
                if grant is None:
                    self._run(rec.offset)
                else:
                    grant.add_done_callback(lambda g, o=rec.offset: g.cancelled() or self._run(o))

        node._serve = serve  # type: ignore[method-assign]

    def _run(self, offset: int) -> None:
        self.running[offset] += 1

    async def start(self) -> None:
        self.node._start_ready()
        await asyncio.sleep(0)  # the started tasks' coroutines run, granted samples start
        await asyncio.sleep(0)
        assert sum(self.running.values()) == self.node.inflight  # every running sample holds a slot
        self.peak = max(self.peak, self.node.inflight)

    def finish(self, offset: int, k: int) -> None:
        for _ in range(k):
            assert self.running[offset] > 0
            self.running[offset] -= 1
            self.node._release()

def test_tasks_start_in_order_their_samples_one_by_one_as_slots_free_and_bad_tasks_are_refused_at_once() -> None:
    bad = _rec(3, 8)
    bad.record.n_samples = 0  # outside the limits: refused whatever room there is
    n = _Node(16, [_rec(0, 8), _rec(1, 8), _rec(2, 8), bad, _rec(4, 40), _rec(5, 1)])

    async def scenario() -> None:
        await n.start()
        assert n.started == [0, 1] and n.node.inflight == 16
        n.finish(0, 1)  # one sample of task 0 ends: task 2 starts in its slot, 7 samples wait
        await n.start()
        assert n.started == [0, 1, 2] and n.running[2] == 1 and n.node.inflight == 16 and len(n.node._waiting) == 7
        # the bad task behind it is refused at once; task 4 waits: task 2 still has samples to start
        assert n.refused == [3] and n.node.tasks_refused == 1 and [r.offset for r in n.node._pending] == [4, 5]
        n.finish(0, 3)  # each slot that frees goes to task 2's next sample at once
        await n.start()
        assert n.running[2] == 4 and n.node.inflight == 16 and len(n.node._waiting) == 4 and n.started == [0, 1, 2]
        n.finish(1, 8)
        await n.start()  # task 2's last 4 samples, then task 4 (larger than the node) in the other 4 slots
        assert n.running[2] == 8 and n.started == [0, 1, 2, 4] and n.running[4] == 4 and len(n.node._waiting) == 36
        n.finish(0, 4)
        n.finish(2, 8)
        await n.start()
        assert n.running[4] == 16 and n.started == [0, 1, 2, 4]  # task 5 waits behind task 4's samples
        for _ in range(3):
            n.finish(4, 8)
            await n.start()
        assert n.running[4] == 16 and not n.node._waiting and n.started == [0, 1, 2, 4]
        n.finish(4, 1)
        await n.start()
        assert n.started == [0, 1, 2, 4, 5] and not n.node._pending and n.node.inflight == 16

    asyncio.run(scenario())
    assert n.peak == 16  # never more rollouts than max_inflight, even for the task larger than the node


def test_a_cancelled_waiting_sample_is_skipped_and_its_slot_goes_to_the_next() -> None:
    n = _Node(2, [_rec(0, 2), _rec(1, 3)])

    async def scenario() -> None:
        await n.start()
        assert n.started == [0] and n.node.inflight == 2
        n.finish(0, 1)
        await n.start()
        assert n.started == [0, 1] and n.running[1] == 1 and len(n.node._waiting) == 2
        n.node._waiting[0].cancel()  # that sample's rollout was cancelled while it waited
        n.finish(0, 1)
        await n.start()
        assert n.running[1] == 2 and not n.node._waiting and n.node.inflight == 2
        n.finish(1, 2)
        await n.start()
        assert n.node.inflight == 0

    asyncio.run(scenario())


def test_the_loops_commit_does_not_wait_for_the_broker() -> None:
    """The main loop's commit is sent asynchronously and returns at once (its report comes with a
    later poll), so a rollout that ends meanwhile has its room refilled by the loop's next start."""
    n = _Node(16, [_rec(0, 8), _rec(1, 8), _rec(2, 8)])
    node = n.node
    sent: list[list[tuple[str, int, int]]] = []

    def commit(offsets, asynchronous=True) -> None:
        assert asynchronous  # answered later, through a poll: nothing here waits on the broker
        sent.append([(tp.topic, tp.partition, tp.offset) for tp in offsets])

    node.consumer.raw = SimpleNamespace(commit=commit)
    node.dlq = SimpleNamespace(count=0)

    async def scenario() -> None:
        node._slot_freed = asyncio.Event()
        await n.start()
        assert n.started == [0, 1]
        node.offsets.finished(("other", 0), 5, node.offsets.received(("other", 0), 5))  # something to commit
        await asyncio.wait_for(node._commit_async(), 1.0)
        assert len(sent) == 1 and ("other", 0, 6) in sent[0] and node._commit_sent is not None  # unanswered
        n.finish(0, 8)
        await n.start()
        assert n.started == [0, 1, 2]

    asyncio.run(scenario())
