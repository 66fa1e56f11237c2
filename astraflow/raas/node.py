"""The RaaS node: pull tasks from the shared consumer group, run workflows, publish trajectories.

Guarantees (DESIGN.md, "RaaS node"):
- at most `max_inflight` rollouts run: samples are counted, not tasks. Tasks start in the order
  fetched, once a rollout slot is free and every sample of the tasks started before has a slot;
  a task's samples start one by one as slots free (the first at once, each next one in the slot
  of a rollout that ends), so a node never holds a slot empty while a started group still has
  samples to run, and the engine never queues rollouts behind its rows (with `max_inflight` at
  most its rows). The group's later samples find its prompt in the engine's cache (the first
  sample's slot) and copy it instead of prefilling it again; tasks fetched
  beyond that wait in a small local buffer (`prefetch` tasks, uncommitted, so a crash redelivers them); while that buffer is full the
  node stops fetching, and once it has been full for `PAUSE_AFTER_S` it pauses its partitions
  and polls again, so a rollout that takes minutes never costs it its group membership. (A
  pause is kept for long stalls: librdkafka drops its prefetched records on pause and refetches
  about a second after resume, which would starve a node whose rollouts take less than that.)
- a task's offset is committed only after every trajectory of that task was acknowledged by
  Kafka, and only once every earlier task of its partition is done (at-least-once);
- trajectory ids are `<task_id>/<sample_index>`, so a redelivered task yields the same ids;
- every task is checked before any work (`astraflow.raas.admission`: values within the
  `raas.*` limits, served policies, an allowed workflow); one that fails goes to the DLQ with
  its reason and is committed like any other;
- whatever a workflow does (raises anything, hangs past `raas.rollout_timeout_s`, blocks the
  event loop (`astraflow.raas.watchdog`), returns something else than its Trajectory), its
  sample becomes an ERROR trajectory (`astraflow.raas.guard`), so its group still completes
  and the node keeps serving; a
  trajectory that cannot be encoded is replaced by an ERROR trajectory without segments;
- a workflow may hand an agent program an OpenAI-compatible base URL and a key scoped to its
  rollout (`ctx.openai_endpoint()`, `astraflow.raas.agent_api`): one listener on 127.0.0.1;
- on SIGTERM it stops taking work, drains what is in flight, commits and leaves the group;
- the main loop's commits are asynchronous (`commit(asynchronous=True)` between polls, one at a
  time, its report served by a later poll), so the loop goes on fetching and starting tasks while
  a commit crosses a slow link; a commit that fails is sent again with the next loop's offsets,
  so a broker outage of any length only delays it. A revocation's commit (in the rebalance
  callback, synchronous) follows the loop's in Kafka's order and carries the group's new
  generation, so the loop's older commit can never land after it (the broker refuses an old
  generation); before its final synchronous commit the node waits for the loop's to be answered.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import logging
import os
import socket
import time
import uuid
import weakref
from collections.abc import Callable
from dataclasses import dataclass, field

from confluent_kafka import KafkaException, TopicPartition

from astraflow.config import AstraflowConfig
from astraflow.dataflow.placement import SpeedMeter
from astraflow.errors import AstraflowError, SerdeError
from astraflow.kafka.clients import RecordConsumer, RecordProducer, commit_offsets
from astraflow.kafka.offsets import OffsetTracker
from astraflow.kafka.received import DeadLetterWriter, Received
from astraflow.kafka.task_placer import commit_metadata
from astraflow.kafka.topics import Topics
from astraflow.raas.admission import InvalidTaskError, admit
from astraflow.raas.agent_api.server import AgentEndpoint
from astraflow.raas.backends.base import InferenceBackend
from astraflow.raas.guard import error_trajectory, run_workflow
from astraflow.raas.tools import ToolBox, ToolFn, default_tools
from astraflow.raas.watchdog import STALL_LIMIT_S, StallWatchdog
from astraflow.raas.workflows import RolloutContext, Workflow
from astraflow.records import Metric, NodeInfo, Task, Trajectory

log = logging.getLogger("astraflow.raas")
PAUSE_AFTER_S = 1.0  # a local buffer full for this long pauses the partitions (see the module docstring)
COMMIT_REPORT_WAIT_S = 90.0  # the loop's commit unanswered this long (librdkafka answers within its 60 s request timeout): send another


@dataclass(frozen=True)
class NodeSettings:
    """How one node serves an experiment."""

    experiment: str
    max_inflight: int = 8  # rollouts running at once
    region: str = "local"  # reported in trajectories and metrics
    node_id: str = field(default_factory=lambda: f"{socket.gethostname()}-{os.getpid()}-{uuid.uuid4().hex[:4]}")
    metrics_interval_s: float = 5.0  # how often metrics are published
    prefetch: int = 16  # tasks fetched ahead of the running rollouts (not started, not committed)
    tool_timeout_s: float = 10.0  # per tool call
    group_id: str | None = None  # default: af.<experiment>.raas
    tasks_region: str | None = None  # read af.<experiment>.tasks.<region> (a region fed by MirrorMaker 2), not tasks


def _resolve(fut: asyncio.Future) -> None:
    if not fut.done():
        fut.set_result(None)


class RaasNode:
    """Serves tasks with the given backends (policy name -> backend)."""

    def __init__(self, config: AstraflowConfig, settings: NodeSettings, backends: dict[str, InferenceBackend],
                 tools: dict[str, ToolFn] | None = None) -> None:
        self.cfg = config
        self.s = settings
        self.backends = backends
        self.topics = Topics(settings.experiment)
        self.tools = ToolBox(tools if tools is not None else default_tools(), settings.tool_timeout_s)
        first = next(iter(backends.values()))
        self.node = NodeInfo(settings.node_id, first.hardware(), settings.region, first.name)
        self.producer = RecordProducer(config.kafka)
        self.dlq = DeadLetterWriter(self.producer, self.topics.dlq, component="raas", dlq_max_bytes=config.topics.max_message_bytes)
        self.consumer: RecordConsumer[Task] = self._make_consumer()
        self.offsets = OffsetTracker()
        self.inflight = 0  # rollouts started and not yet finished
        self.rollouts_done = 0
        self.tokens_done = 0
        self.tasks_done = 0
        self.tasks_refused = 0  # dead-lettered by admission
        self.rollouts_failed = 0  # ERROR trajectories (workflow raised, timed out or returned garbage)
        self._stop = asyncio.Event()
        self._slot_freed = asyncio.Event()  # a rollout ended: the main loop starts a buffered task at once
        # Samples of started tasks waiting for a rollout slot, in order: a rollout that ends hands its slot on.
        self._waiting: collections.deque[asyncio.Future[None]] = collections.deque()
        self._paused = False
        self._full_since: float | None = None  # when the local buffer last became full
        self._pending: collections.deque[Received[Task]] = collections.deque()  # fetched, not started
        self._head: tuple[Received[Task], Workflow] | None = None  # the first pending task, admitted
        self._running: set[asyncio.Task] = set()
        self._workflows: weakref.WeakSet[asyncio.Future] = weakref.WeakSet()  # rollouts' own tasks
        self.metric_observers: list[Callable[[Metric], None]] = []  # e.g. a Prometheus collector's observe
        self.agent_api = AgentEndpoint(config.raas)  # OpenAI-compatible endpoint, listening once a rollout asks

    # The loop's asynchronous commit in flight (positions, when sent), and librdkafka's commit
    # reports (error, partitions, when), queued by the polling thread for the loop.
    _commit_sent: tuple[dict[tuple[str, int], int], float] | None = None
    _commit_reports: collections.deque | None = None

    _commit_rtts: collections.deque[float] | None = None  # durations of the last commits (the shortest is reported)
    _speed_meter: SpeedMeter | None = None  # tasks/s while rollouts are in flight (reported with commits)
    _owned: frozenset[tuple[str, int]] = frozenset()  # partitions assigned (the speed reported is split over them)
    tasks_done: int = 0  # (set in __init__; a default, like the three above, for nodes that only commit)

    def _speed(self) -> SpeedMeter:
        if self._speed_meter is None:
            self._speed_meter = SpeedMeter()
        return self._speed_meter

    def _busy_changed(self) -> None:
        self._speed().update(time.monotonic(), self.inflight > 0)

    def _make_consumer(self) -> RecordConsumer[Task]:
        # Subscribing joins the tasks group: the node is built only once it can serve (serve_node:
        # backends built, weights caught up), so the partitions it takes never wait on its start-up.
        log.info("joining the tasks group (ready to serve)")  # bench/regions.py splits joins at this line
        return RecordConsumer(
            self.cfg.kafka, self.s.group_id or self.topics.raas_group,
            [self.topics.tasks_of(self.s.tasks_region) if self.s.tasks_region else self.topics.tasks],
            component="raas", dlq=self.dlq, expect=Task, on_assign=self._on_assign,
            on_revoke=self._on_revoke, on_commit=self._on_commit,
            # Tasks are small and a node waits on them: fetch as soon as any arrive (fetch.min.bytes
            # 1: the broker answers a held fetch when a task lands, a transaction's commit
            # included). An empty fetch is held up to librdkafka's default 500 ms: an idle node
            # fetched 50 times a second with the 20 ms it had before, 0.5-0.9 ms of broker CPU each.
            **{"fetch.wait.max.ms": 500, "fetch.min.bytes": 1, "queued.max.messages.kbytes": 1024, **self._session()},
        )

    def _session(self) -> dict[str, int]:
        """The node's own group session (`raas.group_session_timeout_s`), when set."""
        session = self.cfg.raas.group_session_timeout_s
        if session is None:
            return {}
        return {"session.timeout.ms": round(session * 1000), "heartbeat.interval.ms": round(min(1.0, session / 3) * 1000)}

    # ---- rebalance -----------------------------------------------------------------------------

    def _on_assign(self, consumer, partitions: list[TopicPartition]) -> None:
        log.info("assigned %s", [p.partition for p in partitions])
        self._owned = self._owned | {(p.topic, p.partition) for p in partitions}
        if self._paused:
            consumer.pause(partitions)

    def _on_revoke(self, consumer, partitions: list[TopicPartition]) -> None:
        self._commit()  # commit what is done before losing the partitions
        lost = {(p.topic, p.partition) for p in partitions}
        self._owned = self._owned - lost
        self.offsets.forget(lost)  # late finishes of their tasks are ignored; others redo them
        kept = [r for r in self._pending if (r.topic, r.partition) not in lost]
        self._pending.clear()
        self._pending.extend(kept)

    # ---- main loop -----------------------------------------------------------------------------

    def stop(self) -> None:
        """Asks the node to drain and exit (what SIGTERM does)."""
        self._stop.set()

    async def run(self) -> None:
        stall_s = min(self.cfg.raas.rollout_timeout_s, STALL_LIMIT_S)
        with StallWatchdog(asyncio.get_running_loop(), stall_s, self._workflows):
            await self._run()

    async def _run(self) -> None:
        last_metrics = time.monotonic()
        t_start = time.monotonic()
        mark = (0, 0, t_start)
        try:
            while not self._stop.is_set():
                self._backpressure()
                room = max(1, self.s.prefetch - len(self._pending))
                # Short polls while rollouts run, so a freed slot is refilled at once from the buffer.
                timeout = 0.005 if self.inflight else 0.05
                if self._full_since is not None and not self._paused:
                    # Full for a moment: fetch nothing, keep what librdkafka holds, and wake as soon
                    # as a rollout ends so that its slot is refilled from the buffer at once.
                    await self._wait_slot(timeout)
                elif self._pending and not self._can_start():
                    # Buffered tasks wait for a slot: top the buffer up without blocking, then wake
                    # as soon as a rollout ends (a blocking poll held a freed slot empty until it
                    # returned: up to its timeout once the topic has nothing more).
                    self._pending.extend(await asyncio.to_thread(self.consumer.poll_batch, room, 0))
                    await self._wait_slot(timeout)
                else:
                    self._pending.extend(await asyncio.to_thread(self.consumer.poll_batch, room, timeout))
                self._slot_freed.clear()  # a rollout ending from here on wakes the next wait
                self._start_ready()
                self.producer.poll(0)
                await self._commit_async()
                if time.monotonic() - last_metrics >= self.s.metrics_interval_s:
                    mark = self._publish_metrics(mark)
                    last_metrics = time.monotonic()
            log.info("stopping: draining %d rollouts", self.inflight)
            self.consumer.pause_all()
            while self._running:
                await asyncio.to_thread(self.consumer.poll_batch, 1, 0.1)  # keep membership while draining
                self.producer.poll(0)
                await self._commit_async()
                await asyncio.sleep(0.05)
            self.producer.flush()
            await self._settle_commit()
            self._commit()
            self._publish_metrics(mark)
            self.producer.flush()
        finally:
            await self.agent_api.close()
            self.consumer.close()  # leaves the group: partitions move to the other nodes at once

    async def _wait_slot(self, timeout: float) -> None:
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(self._slot_freed.wait(), timeout)

    def _backpressure(self) -> None:
        full = len(self._pending) >= self.s.prefetch
        if not full:
            self._full_since = None
        elif self._full_since is None:
            self._full_since = time.monotonic()
        if full and not self._paused and time.monotonic() - self._full_since >= PAUSE_AFTER_S:
            self.consumer.pause_all()
            self._paused = True
        elif not full and self._paused:
            self.consumer.resume_all()
            self._paused = False

    def _can_start(self) -> bool:
        """Whether the next buffered task may start: a rollout slot is free and every sample of the
        tasks started before has one."""
        return not self._waiting and self.inflight < self.s.max_inflight

    def _start_ready(self) -> None:
        """Starts buffered tasks, in order, while `_can_start`; a task that fails admission is
        refused at once, whatever its size."""
        while self._pending:
            rec = self._pending[0]
            if self._head is None or self._head[0] is not rec:
                try:
                    self._head = (rec, admit(rec.record, self.cfg.raas, self.backends).workflow)
                except InvalidTaskError as exc:
                    self._pending.popleft()
                    self._refuse(rec, exc)
                    continue
            if not self._can_start():
                return
            workflow = self._head[1]
            self._pending.popleft()
            self._head = None
            self._start_task(rec, workflow)

    def _refuse(self, rec: Received[Task], exc: InvalidTaskError) -> None:
        log.warning("task refused: %s", exc)
        tp = (rec.topic, rec.partition)
        epoch = self.offsets.received(tp, rec.offset)
        self.consumer.dead_letter(rec, exc)
        self.offsets.finished(tp, rec.offset, epoch)
        self.tasks_refused += 1

    def _start_task(self, rec: Received[Task], workflow: Workflow) -> None:
        """Starts the task's samples that have a free slot; the others wait in `_waiting`, in order."""
        epoch = self.offsets.received((rec.topic, rec.partition), rec.offset)
        n = rec.record.n_samples
        now = min(n, self.s.max_inflight - self.inflight)
        self.inflight += now
        self._busy_changed()
        loop = asyncio.get_running_loop()
        grants: list[asyncio.Future[None] | None] = [None] * now + [loop.create_future() for _ in range(n - now)]
        self._waiting.extend(g for g in grants if g is not None)
        t = asyncio.create_task(self._serve(rec, workflow, epoch, grants))
        self._running.add(t)
        t.add_done_callback(self._running.discard)

    async def _serve(self, rec: Received[Task], workflow: Workflow, epoch: int,
                     grants: list[asyncio.Future[None] | None]) -> None:
        """Runs the task's samples (each once its grant is set: None, a slot from the start) and
        publishes their trajectories; marks the task finished once all are acknowledged."""
        task = rec.record
        contexts = [RolloutContext(task, i, dict(self.backends), self.tools, self.node, agent_api=self.agent_api)
                    for i in range(task.n_samples)]
        results = await asyncio.gather(*(self._rollout(ctx, workflow, g) for ctx, g in zip(contexts, grants, strict=True)))
        # Delivery reports may be served by the commit thread's DLQ flush: appends only (thread-safe).
        reports: list[str | None] = []
        failed: list[str] = []
        loop = asyncio.get_running_loop()
        acked = loop.create_future()  # done once every trajectory of the task has its report

        def on_delivery(err, _msg) -> None:
            if err is not None:
                failed.append(err.str())
            reports.append(None if err is None else err.str())
            if len(reports) == len(results):
                with contextlib.suppress(RuntimeError):  # the loop is closed: nobody waits any more
                    loop.call_soon_threadsafe(_resolve, acked)

        for ctx, traj in zip(contexts, results, strict=True):
            try:
                self.producer.send(self.topics.rollouts, traj, key=task.group_id, on_delivery=on_delivery)
            except SerdeError as exc:  # e.g. a workflow put non-string metadata or too many tokens in it
                log.error("task %s/%d: trajectory cannot be encoded (%s); sending an ERROR trajectory", task.task_id,
                          ctx.sample_index, exc)
                self.rollouts_failed += traj.error is None  # not counted yet
                bare = error_trajectory(ctx, task, f"trajectory cannot be encoded: {exc}", keep_segments=False)
                self.producer.send(self.topics.rollouts, bare, key=task.group_id, on_delivery=on_delivery)
        while len(reports) < len(results):  # the main loop polls the producer too; this wakes on the report
            self.producer.poll(0)
            await asyncio.wait([acked], timeout=0.01)
        if failed:
            log.error("task %s: %d trajectories not acknowledged (%s); it will be redelivered", task.task_id, len(failed), failed[0])
            return  # offset stays uncommitted: another delivery will redo it
        self.offsets.finished((rec.topic, rec.partition), rec.offset, epoch)  # ignored if revoked meanwhile
        self.tasks_done += 1

    async def _rollout(self, ctx: RolloutContext, workflow: Workflow, grant: asyncio.Future[None] | None = None) -> Trajectory:
        if grant is not None:
            try:
                await grant  # a rollout that ended handed this sample its slot (`_release`)
            except asyncio.CancelledError:
                if grant.done() and not grant.cancelled():  # the slot came, the sample will not run
                    self._release()
                raise
        try:
            traj = await run_workflow(workflow, ctx, self.cfg.raas.rollout_timeout_s, self._workflows)
        finally:
            self._release()
        self.rollouts_done += 1
        self.rollouts_failed += traj.error is not None
        self.tokens_done += traj.num_tokens
        return traj

    def _release(self) -> None:
        """A rollout ended: its slot goes to the first waiting sample of a started task (one whose
        rollout was cancelled meanwhile is skipped), else it is free for the next task."""
        while self._waiting:
            grant = self._waiting.popleft()
            if not grant.done():
                grant.set_result(None)
                return
        self.inflight -= 1
        self._busy_changed()
        self._slot_freed.set()

    def _commit(self) -> None:
        """Commits finished tasks, blocking (rebalance callback, drain)."""
        positions = self.offsets.to_commit()
        if positions and self._commit_positions(positions):
            self.offsets.mark_committed(positions)

    def _on_commit(self, err, partitions: list[TopicPartition]) -> None:
        """librdkafka's report of a commit, served by a poll in the polling thread: queued for the loop."""
        if self._commit_reports is None:
            self._commit_reports = collections.deque()
        self._commit_reports.append((err, partitions, time.monotonic()))

    def _take_commit_reports(self) -> None:
        """The loop's commit answered: its offsets marked committed where Kafka took them (a report
        of other offsets is a synchronous commit's, handled where it was made)."""
        while self._commit_reports:
            err, partitions, at = self._commit_reports.popleft()
            sent = self._commit_sent
            if sent is None or {(tp.topic, tp.partition): tp.offset for tp in partitions or []} != sent[0]:
                continue
            self._commit_sent = None
            took = {} if err is not None else {(tp.topic, tp.partition): tp.offset for tp in partitions if tp.error is None}
            if took:
                self._rtts().append(at - sent[1])
                self.offsets.mark_committed(took)
            if len(took) < len(sent[0]):  # sent again with the next loop's offsets (unless revoked meanwhile)
                log.info("commit of %s not taken (%s); sending it again", sent[0],
                         err.str() if err is not None else [tp.error for tp in partitions if tp.error])

    async def _commit_async(self) -> None:
        """The main loop's commit: sent without waiting for it (see the module docstring), one at
        a time; what finishes meanwhile goes with the next."""
        self._take_commit_reports()
        if self._commit_sent is not None:
            if time.monotonic() - self._commit_sent[1] < COMMIT_REPORT_WAIT_S:
                return
            log.warning("commit of %s unanswered after %.0f s; sending another", self._commit_sent[0], COMMIT_REPORT_WAIT_S)
            self._commit_sent = None
        positions = self.offsets.to_commit()
        if not positions:
            return
        try:
            if self.dlq.count:  # a dead-lettered task must be durable before its offset is committed
                await asyncio.to_thread(self.dlq.producer.flush)
            offsets = [TopicPartition(t, p, o, metadata=self._commit_meta()) for (t, p), o in positions.items()]
            self.consumer.raw.commit(offsets=offsets, asynchronous=True)
        except (AstraflowError, KafkaException) as exc:  # a dead letter refused; no partitions (revoked)
            log.warning("tasks before %s not committed: %s", positions, exc)
            return
        self._commit_sent = (positions, time.monotonic())

    async def _settle_commit(self, timeout_s: float = 30.0) -> None:
        """Wait (polling: reports come with polls) until the loop's commit is answered, so that
        the final synchronous commit cannot be overtaken by it."""
        deadline = time.monotonic() + timeout_s
        self._take_commit_reports()
        while self._commit_sent is not None and time.monotonic() < deadline:
            await asyncio.to_thread(self.consumer.poll_batch, 1, 0.1)
            self._take_commit_reports()

    def _rtts(self) -> collections.deque[float]:
        if self._commit_rtts is None:
            self._commit_rtts = collections.deque(maxlen=32)
        return self._commit_rtts

    def _commit_meta(self) -> str:
        """The round trip for the placement's refill delay (astraflow.kafka.task_placer): the
        shortest of the last commits, so that a node's own stalls (a CPU quota, a busy loop) do not
        count; and its speed while busy, split over the partitions it owns (the placement's reserve)."""
        rtts = self._rtts()
        speed = self._speed().speed(time.monotonic(), self.tasks_done)
        return commit_metadata(min(rtts) if rtts else None, None if speed is None else speed / max(1, len(self._owned)))

    def _commit_positions(self, positions: dict[tuple[str, int], int]) -> bool:
        """Blocking: dead letters made durable first, then the offsets; waits out an outage. False
        when the commit cannot succeed (partitions revoked: their next owner redoes those tasks)."""
        try:
            if self.dlq.count:  # a dead-lettered task must be durable before its offset is committed
                self.dlq.producer.flush()
            meta = self._commit_meta()
            began = time.monotonic()
            commit_offsets(self.consumer.raw, [TopicPartition(t, p, o, metadata=meta) for (t, p), o in positions.items()])
            self._rtts().append(time.monotonic() - began)
            return True
        except AstraflowError as exc:  # KafkaLayerError (revoked, fenced), ProduceError (a dead letter refused)
            log.warning("tasks before %s not committed: %s", positions, exc)
            return False

    def _publish_metrics(self, mark: tuple[int, int, float]) -> tuple[int, int, float]:
        now = time.monotonic()
        r0, k0, t0 = mark
        dt = max(now - t0, 1e-6)
        labels = {"node_id": self.node.node_id, "hardware": self.node.hardware, "region": self.node.region,
                  "backend": self.node.backend, "tasks_region": self.s.tasks_region or ""}  # "": it reads `tasks`
        values = {
            "rollouts_per_s": (self.rollouts_done - r0) / dt,
            "tokens_per_s": (self.tokens_done - k0) / dt,
            "inflight": float(self.inflight),
            "rollouts_total": float(self.rollouts_done),
            "rollouts_failed_total": float(self.rollouts_failed),
            "tasks_refused_total": float(self.tasks_refused),
        }
        busy = self._speed().speed(now, self.tasks_done)  # its speed when fed (the curator's region shares)
        if busy is not None:
            values["busy_tasks_per_s"] = busy
        metrics = [Metric(name, v, "raas", self.node.node_id, labels) for name, v in values.items()]
        metrics += [Metric("policy_version", float(b.version), "raas", self.node.node_id, {**labels, "policy": policy})
                    for policy, b in self.backends.items()]
        for m in metrics:  # the node's own endpoint first, whatever the send does
            for observe in self.metric_observers:
                observe(m)
        for m in metrics:
            self.producer.send(self.topics.metrics, m, key=self.node.node_id)
        return (self.rollouts_done, self.tokens_done, now)
