"""What a stream worker does around a rebalance, without a broker (issue 13's non-exact run).

* A partition kept across the rebalance commits its producer's transaction at the assignment
  instead of beginning one again (which Faust logged as failed), and starts without the read
  offset Faust's fetch loop recorded for the record it was handing over when the flow stopped
  (records below it, read again from the committed offset, would be dropped).
* Periodic work (`in_partition`) does not run while the tables recover: it would read a
  partial state (a timed-out group emitted without the members not recovered yet).
* A record that waited for its partition's gate while the partition was revoked is not handled:
  its table writes would stay in memory, outside any changelog.
* Records handed over while the tables recover are held back until the recovery's seek hands
  them over again; a record handed over twice is handled once (`stream_apps.takeover`).
* Resuming the flow keeps the agent's queue (Faust resumes after its post-recovery seek).
"""

from __future__ import annotations

import asyncio
from types import SimpleNamespace
from typing import Any

import pytest

from astraflow.config import KafkaSettings
from astraflow.serde import AvroSerde
from astraflow.testing import make_trajectory
from stream_apps.engine import EngineSettings, StreamEngine
from stream_apps.reward import RewardApp
from stream_apps.transactions import ExactTransactionManager

pytestmark = [pytest.mark.unit, pytest.mark.timeout(60)]

class Producer:
    """Faust's producer as the transaction manager uses it: one transactional producer per id."""

    def __init__(self, kept: str) -> None:
        self.calls: list[str] = []
        self.txp = SimpleNamespace(commit_transaction=self._call("commit"), begin_transaction=self._call("begin"),
                                   send_offsets_to_transaction=self._call("offsets"))
        self._transaction_producers = {kept: self.txp}
        self._trn_locks = {kept: asyncio.Lock()}

    def _call(self, name: str) -> Any:
        async def call(*_: Any) -> None:
            self.calls.append(name)
        return call

    async def maybe_begin_transaction(self, tid: str) -> None:
        self.calls.append(f"maybe_begin {tid}")
        self._transaction_producers[tid] = self.txp


async def _no_unsent(partition: int) -> None:
    pass


def test_a_kept_partition_commits_its_transaction_at_the_assignment() -> None:
    engine = SimpleNamespace(tracker=SimpleNamespace(committable=lambda tp: None, committed=lambda tp: None), source="src",
                             _gates={}, tid=lambda p: f"app-{p}")
    engine.gate = lambda p: engine._gates.setdefault(p, asyncio.Lock())
    engine.flush_partition, engine.forget_unsent = _no_unsent, lambda p: None
    manager = ExactTransactionManager.__new__(ExactTransactionManager)
    manager.app = SimpleNamespace(astraflow_engine=engine, conf=SimpleNamespace(id="app"))  # type: ignore[assignment]
    manager.producer = Producer(kept="app-1")  # type: ignore[assignment]

    asyncio.run(manager._start_transactions(["app-0", "app-1"]))

    assert manager.producer.calls == ["maybe_begin app-0", "commit", "begin"]  # type: ignore[attr-defined]


def test_an_assigned_partition_forgets_the_read_offset_recorded_after_the_revocation() -> None:
    from faust.types import TP

    engine = SimpleNamespace(tracker=SimpleNamespace(committable=lambda tp: None, committed=lambda tp: None), source="src",
                             _gates={}, tid=lambda p: f"app-{p}")
    engine.gate = lambda p: engine._gates.setdefault(p, asyncio.Lock())
    engine.flush_partition, engine.forget_unsent = _no_unsent, lambda p: None
    read_offsets = {TP("src", 1): 57, TP("other", 1): 3}
    manager = ExactTransactionManager.__new__(ExactTransactionManager)
    manager.app = SimpleNamespace(astraflow_engine=engine, conf=SimpleNamespace(id="app"),  # type: ignore[assignment]
                                  consumer=SimpleNamespace(_read_offset=read_offsets))
    manager.producer = Producer(kept="app-1")  # type: ignore[assignment]
    manager.log = SimpleNamespace(info=lambda *a: None)  # type: ignore[assignment]

    asyncio.run(manager.on_rebalance({TP("src", 1), TP("src-changelog", 1)}, set(), set()))

    assert read_offsets == {TP("other", 1): 3}
    assert manager.producer.calls == ["commit", "begin"]  # type: ignore[attr-defined]


def _engine() -> StreamEngine:
    engine = StreamEngine(RewardApp(), EngineSettings("unit", KafkaSettings(), guarantee="at_least_once", source_partitions=1))
    engine.build()
    return engine


def test_periodic_work_waits_for_the_end_of_the_rebalance() -> None:
    engine = _engine()
    engine.assigned = lambda: {0}  # type: ignore[method-assign]
    ran: list[int] = []
    engine.app.rebalancing = True
    assert asyncio.run(engine.in_partition(0, lambda: ran.append(1))) is None
    assert ran == []
    engine.app.rebalancing = False
    asyncio.run(engine.in_partition(0, lambda: ran.append(2)))
    assert ran == [2]


def test_a_record_revoked_while_it_waited_for_its_gate_is_not_handled() -> None:
    engine = _engine()
    handled: list[int] = []
    engine.handler.handle = lambda inc: handled.append(inc.offset)  # type: ignore[method-assign]
    message = SimpleNamespace(topic=engine.source, partition=0, offset=5, key=b"g", timestamp=0.0, headers=[],
                              value=AvroSerde().dumps(make_trajectory(8)), incref=lambda: None,
                              ack=lambda consumer: pytest.fail("a revoked record must not be acked"))

    async def run() -> None:
        gate = engine.gate(0)
        await gate.acquire()  # e.g. the revocation's commit holds it
        task = asyncio.ensure_future(engine.handle_event(SimpleNamespace(message=message)))
        await asyncio.sleep(0.01)
        engine.on_revoked({0})  # the rebalance forgets the partition
        gate.release()
        await task

    asyncio.run(run())
    assert handled == []


def _take(takeover: Any, tracker: Any, offsets: list[int], rebalance: int) -> list[int]:
    """What an agent handles of `offsets` (partition 0 of "src") in Faust's rebalance number `rebalance`."""
    handled = []
    for offset in offsets:
        if not takeover.skip("src", 0, offset, rebalance):
            tracker.received(("src", 0), offset)
            handled.append(offset)
    return handled


def test_records_handed_over_while_the_tables_recover_are_held_back_and_handled_once_after_the_seek() -> None:
    from astraflow.kafka.offsets import OffsetTracker
    from stream_apps.takeover import Takeover

    tracker = OffsetTracker()
    takeover = Takeover(tracker, has_tables=True)
    takeover.tables_assigned(1)
    # Fetched before Faust paused the source partition: the agent gets 16 and 17 while the tables recover.
    assert _take(takeover, tracker, [16, 17], 1) == []
    takeover.tables_recovered(1)
    # 18 was fetched in the same batch but reaches the agent after the recovery: handling it before
    # 16 and 17 would let offset 19 commit past them; held back too.
    assert _take(takeover, tracker, [18], 1) == []
    # Faust's seek to the committed offset 16 hands all of them over again, in order.
    assert _take(takeover, tracker, [16, 17, 18, 19], 1) == [16, 17, 18, 19]
    assert takeover.held_back == 3


def test_a_record_handled_before_the_seek_is_not_handled_again_after_it() -> None:
    from astraflow.kafka.offsets import OffsetTracker
    from stream_apps.takeover import Takeover

    tracker = OffsetTracker()
    takeover = Takeover(tracker, has_tables=False)  # e.g. reward: no recovery, but Faust seeks all the same
    assert _take(takeover, tracker, [4, 5], 1) == [4, 5]
    tracker.finished(("src", 0), 4, 1)
    tracker.mark_committed({("src", 0): 5})
    assert _take(takeover, tracker, [4, 5, 6], 1) == [6]  # 4 committed, 5 received: read twice
    assert takeover.redelivered == 2


def test_a_recovery_overtaken_by_another_rebalance_does_not_open_the_agent() -> None:
    from astraflow.kafka.offsets import OffsetTracker
    from stream_apps.takeover import Takeover

    tracker = OffsetTracker()
    takeover = Takeover(tracker, has_tables=True)
    takeover.tables_assigned(1)
    takeover.tables_recovered(2)  # rebalance 2 began before recovery 1 reported
    assert takeover.recovering(2)
    assert _take(takeover, tracker, [3], 2) == []
    takeover.forget({("src", 0)})  # revoked by rebalance 2, assigned again
    takeover.tables_assigned(2)
    takeover.tables_recovered(2)
    assert _take(takeover, tracker, [3], 2) == [3]


def test_resuming_the_flow_keeps_the_records_queued_for_the_agent() -> None:
    from stream_apps.transactions import KeepQueuesOnResume

    engine = StreamEngine(RewardApp(), EngineSettings("unit", KafkaSettings(), source_partitions=1))
    engine.build()
    assert isinstance(engine.app.flow_control, KeepQueuesOnResume)

    async def run() -> None:
        queue = engine.app.FlowControlQueue(maxsize=8, clear_on_resume=True)  # as Faust makes channel queues
        engine.app.flow_control.resume()
        await queue.put("record 66")  # handed over after the recovery's seek
        changelog = engine.app.tables.changelog_queue
        await changelog.put("changelog record read before the recovery's seek")
        engine.app.flow_control.resume()  # what Faust then does: the record must still reach the agent
        assert queue.qsize() == 1
        assert changelog.qsize() == 0  # recovery's queue: emptied as Faust does
        engine.app.flow_control.suspend()
        engine.app.flow_control.clear()  # a revocation still empties the queues
        assert queue.qsize() == 0

    asyncio.run(run())
