"""Faust's fetch loop (`Consumer._drain_messages`), without four tasks per record.

Faust hands every fetched record to its topic's conductor with
`await self.wait_first(callback(message), self.suspend_flow.wait())`: `mode`'s `wait_first`
wraps the callback, the flow's suspend event and the service's stopped and crashed events in
four tasks, waits for the first, and cancels the other three, for every record. Measured alone
(`mode`'s `Service.wait_first` on a callback that returns at once, a single-core loop of 20,000
records), that is 40-46 us per record, against 2.6-3.9 us for awaiting the callback directly
followed by one `sleep(0)`.

The callback (the conductor's `on_message`: flow control, the producer's buffer, decoding the
raw bytes into an event, `put_nowait` into the agent's queue) nearly always returns without
suspending. `hand_over` runs it directly; only when it does suspend (flow control during a
rebalance, a full queue) does the rest of it run as Faust runs it, under `wait_first` with
`suspend_flow`, so a rebalance that suspends the flow abandons it the same way. One
`sleep(0)` per record keeps Faust's pace: the agent takes each record as it is handed over
(handing a whole fetch over at once filled the agent's queue until Faust paused the
partition's fetches, and the agent then waited for fetches).

Everything else is Faust 0.15.3's loop as it is (read offsets, gaps, `commit_every`).

Refilling after a full queue, at once. When the agent's queue passes its high-pressure mark
for a partition, Faust takes that partition out of the fetcher's active partitions until the
queue drains to its low mark (`Consumer.on_buffer_full` / `on_buffer_drop`). Faust 0.15.3 then
waits up to a second for nothing: with every partition out, `_wait_next_records` sleeps a fixed
second instead of fetching (`wait_next_records` here waits for the drop, a second at most); with
some out, the fetch already waiting in the consumer thread (`getmany(timeout=1.0)`) holds the
others' fetched records and only wakes for new data from the broker, so a partition that drained
meanwhile waits until that second is over (`buffer_dropped` here wakes it). Seen in the reward
stage of `bench/apps.py`, which took about a second more in one of its two repeats in most runs
(1.87-2.33 s against 0.94-1.16 s); a diagnostic of that stage alone: both partitions full at
0.28 s, drained at 0.64 s, the next record at 1.34 s.
"""

from __future__ import annotations

import asyncio
from collections.abc import Coroutine, Generator
from typing import Any, cast


async def _rest(coro: Coroutine[Any, Any, Any], waiting: Any) -> Any:
    """Runs a coroutine that suspended on `waiting` (what it yielded) to its end, as a Task would:
    it is resumed once `waiting` is done (or at the next loop turn for a bare yield), and a
    cancellation of this coroutine is passed into it."""
    gen = cast(Generator[Any, None, Any], coro)
    while True:
        try:
            if waiting is None:
                await asyncio.sleep(0)
            else:
                await asyncio.wait([waiting])
        except asyncio.CancelledError:
            if waiting is not None:
                waiting.cancel()
            gen.close()
            raise
        try:
            waiting = gen.send(None)  # it reads the result (or the exception) of `waiting` itself
        except StopIteration as done:
            return done.value


async def hand_over(consumer: Any, callback: Any, message: Any) -> None:
    """`await consumer.wait_first(callback(message), consumer.suspend_flow.wait())`, without its
    tasks when the callback returns without suspending (module doc)."""
    coro = callback(message)
    try:
        waiting = coro.send(None)
    except StopIteration:
        return
    await consumer.wait_first(_rest(coro, waiting), consumer.suspend_flow.wait())


def buffer_dropped(self: Any, tp: Any, on_buffer_drop: Any) -> None:
    """Faust's `Consumer.on_buffer_drop` (`tp` is fetched again), then wakes the fetch that may be
    waiting without `tp` in the consumer thread and a `wait_next_records` waiting with no
    partition active (module doc)."""
    refetch = tp in self._buffered_partitions
    on_buffer_drop(self, tp)
    if not refetch:
        return
    dropped = getattr(self, "_astraflow_buffer_dropped", None)
    if dropped is not None:
        dropped.set()
    thread = getattr(self, "_thread", None)
    fetcher = getattr(getattr(thread, "_consumer", None), "_fetcher", None)
    thread_loop = getattr(thread, "thread_loop", None)
    if fetcher is not None and thread_loop is not None and not thread_loop.is_closed():
        thread_loop.call_soon_threadsafe(wake_fetch_waiters, fetcher)


def wake_fetch_waiters(fetcher: Any) -> None:
    """Ends aiokafka's `Fetcher.fetched_records` waits (in the consumer thread's loop): each then
    looks again at the records already fetched, for the partitions now active."""
    for waiter in list(fetcher._fetch_waiters):
        if not waiter.done():
            waiter.set_result(None)


async def wait_next_records(self: Any, timeout: float) -> Any:  # Faust's `_wait_next_records`, one branch changed
    """Faust's `Consumer._wait_next_records`; with no partition active it waits for a queue to
    drain (`buffer_dropped`), one second at most, instead of sleeping one second."""
    if not self.flow_active:
        await self.wait(self.can_resume_flow)
    try:
        self.not_waiting_next_records.set()
        dropped = getattr(self, "_astraflow_buffer_dropped", None)
        if dropped is None:
            dropped = self._astraflow_buffer_dropped = asyncio.Event()
        dropped.clear()
        active_partitions = None if self.app.client_only else self._get_active_partitions()
        records: Any = {}
        if self.app.client_only or active_partitions:
            records = await self._getmany(active_partitions=active_partitions, timeout=timeout)
        else:
            await self.wait(dropped, timeout=1.0)
        return records, active_partitions
    finally:
        self.not_waiting_next_records.set()


async def drain_messages(self: Any, fetcher: Any) -> None:  # pragma: no cover - Faust's loop, one line changed
    """Faust's `Consumer._drain_messages` with `hand_over` in place of its `wait_first` per record."""
    from faust.transport.consumer import CONSUMER_FETCHING

    callback = self.callback
    getmany = self.getmany
    consumer_should_stop = self._stopped.is_set
    fetcher_should_stop = fetcher._stopped.is_set
    get_read_offset = self._read_offset.__getitem__
    set_read_offset = self._read_offset.__setitem__
    set_flag = self.diag.set_flag
    unset_flag = self.diag.unset_flag
    commit_every = self._commit_every
    acks_enabled_for = self.app.topics.acks_enabled_for
    sleep = asyncio.sleep
    try:
        while not (consumer_should_stop() or fetcher_should_stop()):
            set_flag(CONSUMER_FETCHING)
            ait = getmany(timeout=1.0)
            await self.sleep(0)
            if not self.should_stop:
                async for tp, message in ait:
                    offset = message.offset
                    r_offset = get_read_offset(tp)
                    if r_offset is None or offset >= r_offset:
                        gap = offset - (r_offset or 0)
                        if gap > 1 and r_offset and acks_enabled_for(message.topic):
                            await self._add_gap(tp, r_offset + 1, offset)
                        if commit_every is not None and self._n_acked >= commit_every:
                            self._n_acked = 0
                            await self.commit()
                        await hand_over(self, callback, message)
                        set_read_offset(tp, offset)
                        await sleep(0)
                    else:
                        self.log.dev("DROPPED MESSAGE ROFF %r: k=%r v=%r", offset, message.key, message.value)
                unset_flag(CONSUMER_FETCHING)
    except self.consumer_stopped_errors:
        if self.transport.app.should_stop:
            self.log.info("Broker stopped consumer, shutting down...")
            return
        raise
    except asyncio.CancelledError:
        if self.transport.app.should_stop:
            self.log.info("Consumer shutting down for user cancel.")
            return
        raise
    except Exception as exc:
        self.log.exception("Drain messages raised: %r", exc)
        raise
    finally:
        unset_flag(CONSUMER_FETCHING)
