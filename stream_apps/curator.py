"""The curator app: datasets -> tasks, chosen from feedback, at most `max-ahead` tasks in flight.

    astraflow app run curator --experiment EXP --policy solver --dataset train.jsonl \
        --n-samples 8 --max-ahead 64 [--workflow rlvr] [--max-tasks N]
    astraflow control set --experiment EXP curator curator filter_solved --param threshold=0.8
    astraflow control set --experiment EXP curator pause on      # stop issuing; `off` resumes

The curator is a Faust app like the others: its agent reads `feedback` (the per-prompt
statistics curate publishes for every finished group) into the Faust table `prompt_stats`
(`<policy>/<prompt id>` -> latest PromptStats, for the first `--policy` and the throttled
ones, backed by the changelog topic
`af.<experiment>.curator-prompt_stats-changelog` and written in the transaction of the feedback
record, so a restarted worker, or one that takes the partitions over, starts from exactly the
statistics the committed feedback offsets imply), and a short timer issues tasks.
With `--region-share b=0.4` (a region with a Kafka cluster of its own, fed by MirrorMaker 2:
`astraflow kafka mirror up`), 40% of the tasks go to `af.<experiment>.tasks.b` instead, which
only region b's nodes read (`raas serve --tasks-region b`): 0.4 is the share until the nodes'
metrics arrive; from then on each region's share follows its live nodes' reported busy speed,
beyond a reserve for the tasks on their way through the mirror (at most its reserve and its share
of `--max-ahead` outstanding), and a region whose nodes all went dark (`--region-dead-s`) gets no new task
and its outstanding ones are given back to the others with the same group ids
(`stream_apps.region_fleet`, `astraflow.dataflow.region_shares`).
Run one curator worker per experiment: the task accounting below is global. Whenever fewer
than `--max-ahead` tasks are ahead of the trainer (see **Issuing**), it asks the curator
strategy (slot `curator`, default `accept_all`) for that many prompts, given the prompts'
latest statistics from `feedback` (those of the first `--policy`: the task's main policy), and
writes one Task per prompt (`--n-samples` samples: one group) to `tasks`, keyed by group id,
with lineage `StrategyRef("curator", "curator", name, version)`.

**Tasks ahead** (in tasks; everything restart-safe because it comes from Kafka), for each
policy P of `--throttle` (default: every `--policy`), and the curator keeps the largest
below `--max-ahead` (the slowest trainer sets the pace, so none of them falls behind further
than max-ahead; the others never wait for it anywhere else):

    ahead(P) = issued - curated(P) + ceil(train_backlog(P) / n_samples)

* `issued`: tasks ever written to `tasks` (sum of its end offsets at start, plus what this
  process wrote since), and to each region's `tasks.<region>` with `--region-share`;
* `curated(P)`: groups curate has finished, emitted or filtered out: the sum of `groups` over
  P's PromptStats (each record is cumulative, so compaction loses nothing, and a record read
  twice changes nothing), from the `prompt_stats` table;
* `train_backlog(P)`: samples in `<P>.train` P's trainer has not consumed: per partition, the
  last stable offset (the end of what read_committed readers see: records of a transaction
  curate has not committed yet are not there, and their groups are not in `curated(P)` either)
  minus the committed offset of the trainer's consumer group (`af.<experiment>.<P>.trainer`,
  what `astraflow train` commits when it takes a batch, and again as it reads more); a partition without a commit counts
  from its start. Curate's transactions leave markers between the samples, which offsets would
  count as samples: the trainer's commit metadata says how many samples it already holds past
  its offset and up to where it has read (`astraflow.kafka.backlog`), so only offsets past that
  count by offset. The figure can only be too high (fewer tasks issued, never more).
  `--trainer-group none` leaves the trainers out (then only tasks not yet curated are counted);
  with one policy, `--trainer-group GROUP` names its trainer's group.

A policy that trains in only some of a task's groups (curate publishes statistics only for the
policies that trained in a group) must be left out of `--throttle`, or it would hold slots.

So a task counts from the moment it is issued until the trainer consumed its samples (or
curate dropped its group), which bounds staleness by about max-ahead / (tasks per version).
A group that never reaches curate (every rollout of it lost before `scored`) keeps its slot
until the curator restarts with a larger max-ahead; curate publishes statistics even for
groups it drops as incomplete, so lost trajectories alone do not leak slots.

**Issuing.** Tasks go out on a short tick (50 ms) as soon as the count leaves room. The count is
`issued` (exact, kept by this process) with `curated` and `train_backlog` as of the last
measurement of the trainers' backlogs: figures that only fall as time passes (groups curated
later are counted in `issued - curated` in full, samples trained later in the backlog), so a
count from an older measurement is never below the truth and issuing on it never exceeds
max-ahead. The backlogs are measured again (in a thread, so that feedback keeps being read
meanwhile: the committed offsets of its trainer's group, one request per policy, and the train
topic's end offsets when they may have moved, see below) while the count leaves no room, every
`lag_interval_s` (each tick), so a trainer taking a batch frees its slots within a tick; at the
next tick after feedback arrives (curate may have dropped a group); and once a second for the
gauges. The end offsets move only when curate commits samples, in the same transaction as their
feedback, so they are read again only when feedback arrived since they were last read (and at
least once a second); in between, the last ones serve, counted with the `curated` read before
them, which can only count more (older end offsets leave out only samples of groups that still
count as not curated). While paused (`control set ... pause on`) the curator sends no request
at all; its first tick after that measures before it issues.
"""

from __future__ import annotations

import asyncio
import logging
import math
import time
import uuid
from collections.abc import Awaitable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from confluent_kafka import KafkaException

from astraflow.data import DatasetSpec
from astraflow.errors import AstraflowError, ConfigError
from astraflow.kafka.backlog import pending_samples
from astraflow.kafka.received import Received
from astraflow.records import PromptStats, SamplingParams, Task
from stream_apps.datasets import DatasetRow, as_specs, load_dataset_rows
from stream_apps.handler import AppHandler
from stream_apps.slots import Slot, SlotDefault

log = logging.getLogger("astraflow.stream.curator")

DEFAULTS = {"curator": SlotDefault("accept_all")}
PLACE_INTERVAL_S = 0.2  # how often the placement observes the nodes' committed offsets
PAUSE_ON = frozenset({"on", "true", "1", "yes", "pause", "paused"})


def tasks_ahead(issued: int, curated: int, backlog_samples: int, n_samples: int) -> int:
    """Tasks between the curator and the trainer (see the module doc)."""
    return max(0, issued - curated + math.ceil(max(0, backlog_samples) / max(1, n_samples)))


@dataclass
class CuratorOptions:
    """What the curator app issues and how far ahead."""

    datasets: Sequence[str | Path | DatasetSpec]  # files, directories, hub names (stream_apps.datasets)
    policies: Sequence[str]  # Task.policies; the first one's feedback chooses prompts
    n_samples: int = 8  # samples per prompt (one group)
    max_ahead: int = 64  # most tasks ahead of the trainer
    workflow: str = "rlvr"  # workflow of rows that do not name one
    sampling: SamplingParams = field(default_factory=SamplingParams)  # decoding parameters of every task
    max_tasks: int = 0  # stop after issuing this many (0: never)
    batch: int = 64  # most tasks issued per tick
    trainer_group: str | None = None  # one policy: its trainer's consumer group; "none" ignores the trainers
    throttle: Sequence[str] = ()  # policies whose progress bounds tasks ahead (empty: every policy)
    lag_interval_s: float = 0.05  # how often the trainers' backlogs are measured while no task can be issued
    gauge_interval_s: float = 1.0  # how often they are measured otherwise (gauges)
    region_share: dict[str, float] = field(default_factory=dict)  # region -> fraction of tasks to af.<exp>.tasks.<region>
    region_dead_s: float = 15.0  # a region with no node metric for this long is dark: no new tasks, its tasks given back
    system_prompt: str | None = None  # Task.metadata["system_prompt"]: workflows render it through the chat template


class CuratorApp(AppHandler):
    """Issues tasks (see the module doc)."""

    name = "curator"
    sources = ("feedback",)
    expect = PromptStats
    tick_interval_s = 0.05  # issues when room is made (measuring first when due); returns at once otherwise
    tables = ("prompt_stats",)

    def __init__(self, options: CuratorOptions, defaults: dict[str, SlotDefault] | None = None) -> None:
        if not options.policies:
            raise ConfigError("the curator needs at least one --policy (the policies each task is rolled out with)")
        if options.n_samples < 1 or options.max_ahead < 1:
            raise ConfigError("--n-samples and --max-ahead must be >= 1")
        self.options = options
        self.defaults = {**DEFAULTS, **(defaults or {})}
        self.primary = options.policies[0]  # its statistics choose prompts
        self.throttled = tuple(dict.fromkeys(options.throttle or options.policies))
        unknown = [p for p in self.throttled if p not in options.policies]
        if unknown:
            raise ConfigError(f"--throttle {', '.join(unknown)}: not among the tasks' policies ({', '.join(options.policies)})")
        if options.trainer_group and options.trainer_group.lower() != "none" and len(self.throttled) > 1:
            raise ConfigError("--trainer-group names one trainer's group; with several policies each trainer's group is "
                              "af.<experiment>.<policy>.trainer (or pass --trainer-group none)")
        shared = sum(options.region_share.values())
        if any(v <= 0 for v in options.region_share.values()) or shared >= 1:
            raise ConfigError("--region-share: each fraction above 0, together below 1 (the rest stays in region A)")
        self.rows: list[DatasetRow]
        self.rows, loaded = load_dataset_rows(as_specs(options.datasets))
        self.bad_rows = sum(b.total for b in loaded.bad.values())  # skipped at load (logged by source and reason)
        self.by_id = {r.prompt.prompt_id: r for r in self.rows}
        self.pool = [r.prompt for r in self.rows]
        self.stats: dict[str, PromptStats] = {}  # prompt_id -> latest PromptStats of the primary policy
        self.curated_by: dict[str, int] = dict.fromkeys(self.throttled, 0)  # policy -> sum of its stats' groups
        self.groups_seen: dict[str, dict[str, int]] = {p: {} for p in self.throttled}  # policy -> prompt -> groups
        self.issued = 0  # tasks ever written to the tasks topic(s)
        self.issued_to: dict[str, int] = {}  # per tasks topic (--region-share)
        self.task_shares: dict[str, float] = {}  # tasks topic -> share of the tasks (bind)
        self.issued_here = 0  # by this process
        self.skipped = 0  # prompts the strategy passed over
        self.backlog_by: dict[str, int] = dict.fromkeys(self.throttled, 0)  # policy -> samples its trainer has not consumed
        self.ahead = 0
        self.paused = False
        self._zv = [0, 0, 0]  # zero-variance groups seen since the last observe(): easy, hard, total
        self._run = uuid.uuid4().hex[:6]
        self._lag_due = 0.0  # next backlog measurement while blocked
        self._gauge_due = 0.0  # ...and while not
        self._admin: Any = None  # end offsets of the train topics
        self._partitions: dict[str, list[int]] = {}  # train topic -> its partitions (read once, as the trainer does)
        self._curated_at_lag: dict[str, int] = dict.fromkeys(self.throttled, 0)  # `curated_by` when the end offsets were read
        self._ends: dict[str, dict[int, int]] = {}  # policy -> its train topic's end offsets, as last read
        self._starts: dict[str, dict[int, int]] = {}  # train topic -> start offsets of partitions never committed
        self._fed = True  # feedback arrived since the end offsets were last read: read them again
        self._ends_due = 0.0  # ...and at least every gauge_interval_s
        self.measured = self.ends_read = 0  # backlog measurements, and those that read the end offsets
        self._lag_consumer: Any = None
        self._readers: dict[str, Any] = {}  # trainer group -> consumer that reads its committed offsets
        self._recovered = False  # the prompt_stats table was recovered: statistics are known
        self.placer: Any = None  # region A's tasks: partition of each (astraflow.kafka.task_placer)
        self._signer: Any = None  # astraflow.kafka.signing.Signer of the curator role (`signer`)
        self._place_due = 0.0  # next observation of the nodes' progress (placement)
        self.fleet: Any = None  # with --region-share: shares that follow the regions' nodes (stream_apps.region_fleet)
        self._fleet_reader: Any = None
        self._fleet_msgs: list[Any] = []  # read in the measuring thread, applied in the event loop

    def bind(self, worker: Any) -> None:
        from confluent_kafka.admin import AdminClient

        from astraflow.kafka.clients import reader as new_reader
        from astraflow.kafka.topics import reader_group

        super().bind(worker)
        self.slot = Slot(worker.control, self.name, "curator", "curator", self.defaults["curator"])
        self.signer  # noqa: B018  (made now: a host without the curator's key says so at start)
        self.tasks_topic = worker.topics.tasks
        # Tasks of a region with a cluster of its own (MirrorMaker 2 carries them there): a topic of
        # their own, which region A's nodes never read, so no task is rolled out in two regions.
        shares = self.options.region_share
        self.task_shares = {self.tasks_topic: 1.0 - sum(shares.values()),
                            **{worker.topics.tasks_of(r): f for r, f in shares.items()}}
        given = self.options.trainer_group
        if given is not None and given.lower() == "none":
            self.trainer_groups: dict[str, str] = {}
        else:
            self.trainer_groups = {p: given or worker.topics.trainer_group(p) for p in self.throttled}
        self.train_topics = {p: worker.topics.train(p) for p in self.throttled}
        # Never subscribes: only reads watermarks and each trainer group's committed offsets.
        self._lag_consumer = new_reader(worker.kafka, reader_group("curator_lag", self._run))
        self._admin = AdminClient(worker.kafka.client_config())
        marks = {t: self._watermarks(t) for t in self.task_shares}
        self.issued_to = {t: sum(high for _, high in m.values()) for t, m in marks.items()}
        self.issued = sum(self.issued_to.values())
        from astraflow.kafka.task_placer import TaskPlacer

        # Each task goes to the partition where it would wait least, so work follows node speed.
        self.placer = TaskPlacer(worker.kafka, self.tasks_topic, worker.topics.raas_group, marks[self.tasks_topic])
        if shares:
            from stream_apps.region_fleet import RegionFleet, fleet_reader

            self.fleet = RegionFleet({"": self.tasks_topic, **{r: worker.topics.tasks_of(r) for r in shares}},
                                     self.task_shares, self.options.n_samples, self.options.region_dead_s,
                                     time.monotonic(), window=self.options.max_ahead)
            from astraflow.ops.provenance import Provenance

            self._provenance = Provenance(worker.topics.experiment)
            self._fleet_reader, unread = fleet_reader(worker.kafka, reader_group("curator_lag", self._run + "-fleet"),
                                                      worker.topics.metrics, worker.topics.rollouts, self.options.region_dead_s)
            self.fleet.expect_metrics(unread)
        log.info("curator: %d prompts, %d tasks issued so far", len(self.pool), self.issued)

    def on_recovered(self, table: str) -> None:
        """The `prompt_stats` table was recovered (start, takeover): statistics and `curated` from it."""
        self.stats = {}
        self.curated_by = dict.fromkeys(self.throttled, 0)
        self.groups_seen = {p: {} for p in self.throttled}
        for key, value in list(self.worker.table("prompt_stats").items()):
            self._on_feedback(key.decode(), self.worker.serde.loads(value, PromptStats))
        self._zv = [0, 0, 0]  # history is not news: observe only what arrives from now on
        if not self._recovered:
            log.info("curator: statistics of %d prompts, %d groups curated", len(self.stats), self.curated)
        self._recovered = True

    def _watermarks(self, topic: str) -> dict[int, tuple[int, int]]:
        from astraflow.kafka.clients import watermarks

        md = self._lag_consumer.list_topics(topic, timeout=10.0)
        meta = md.topics.get(topic)
        if meta is None or meta.error is not None:
            raise ConfigError(f"topic {topic} does not exist; create the experiment's topics with `astraflow topics create`")
        return {p: watermarks(self._lag_consumer, topic, p) for p in meta.partitions}

    def handle(self, inc: Received[Any]) -> None:
        """A feedback record (curate finished a group of this prompt): into the table, in its transaction."""
        key = inc.key_str or ""
        if self._on_feedback(key, inc.record) and inc.value is not None:
            self.worker.table("prompt_stats")[key.encode()] = inc.value
            self._lag_due = 0.0  # a group curate dropped frees its slot: measure at the next tick
            self._fed = True  # curate committed samples (in the transaction of this record): new end offsets

    def _on_feedback(self, key: str, stats: PromptStats | None) -> bool:
        """Takes newer statistics of a prompt (primary or throttled policy); returns whether it did."""
        policy, _, prompt_id = key.partition("/")
        if stats is None:
            return False
        seen = self.groups_seen.get(policy)
        kept = False
        if seen is not None:  # a throttled policy: count its newly curated groups
            new = stats.groups - seen.get(prompt_id, 0)
            if new > 0:
                seen[prompt_id] = stats.groups
                self.curated_by[policy] += new
                kept = True
        if policy != self.primary:
            return kept
        old = self.stats.get(prompt_id)
        if old is not None and stats.groups <= old.groups:
            return kept
        self.stats[prompt_id] = stats
        if stats.zero_variance_streak > 0:
            self._zv[0 if stats.last_pass_rate >= 0.5 else 1] += 1
        self._zv[2] += 1
        return True

    @property
    def curated(self) -> int:
        """Groups curated by the slowest throttled policy."""
        return min(self.curated_by.values(), default=0)

    @property
    def backlog(self) -> int:
        """Train samples not consumed yet, of the policy with the most."""
        return max(self.backlog_by.values(), default=0)

    def measure_backlog(self, policy: str, ends: bool = True) -> int:
        """Train samples of `policy` its trainer has not consumed yet (0 when trainers are ignored):
        the end offsets first (read_committed: the last stable offsets; with `ends` False, those
        read last time), then the committed ones."""
        group = self.trainer_groups.get(policy)
        if group is None:
            return 0
        from confluent_kafka import IsolationLevel, TopicPartition
        from confluent_kafka.admin import OffsetSpec

        from astraflow.kafka.clients import reader as new_reader

        topic = self.train_topics[policy]
        parts = self._partitions.get(topic)
        if parts is None:
            parts = self._partitions[topic] = sorted(self._watermarks(topic))

        def offsets(spec: Any, which: list[int]) -> dict[int, int]:
            asked = self._admin.list_offsets({TopicPartition(topic, p): spec for p in which},
                                             isolation_level=IsolationLevel.READ_COMMITTED, request_timeout=10.0)
            return {tp.partition: f.result().offset for tp, f in asked.items()}

        if ends or policy not in self._ends:
            self._ends[policy] = offsets(OffsetSpec.latest(), parts)
        end = self._ends[policy]
        # committed() reads the offsets of the consumer's own group: one reader per trainer group.
        reader = self._readers.get(group)
        if reader is None:
            reader = self._readers[group] = new_reader(self.worker.kafka, group)
        done = {tp.partition: tp for tp in reader.committed([TopicPartition(topic, p) for p in parts], timeout=10.0)}
        fresh = [p for p in parts if p not in done or done[p].offset < 0]  # never committed: from the partition's start
        start = self._starts.setdefault(topic, {})
        if any(p not in start for p in fresh):  # read once: a start that moved later (retention) only counts more
            start.update(offsets(OffsetSpec.earliest(), [p for p in fresh if p not in start]))
        return sum(max(0, end[p] - start[p]) if p in fresh else pending_samples(end[p], done[p].offset, done[p].metadata)
                   for p in parts)

    def ahead_by(self) -> dict[str, int]:
        """Tasks ahead per throttled policy, with the counts taken at the last backlog measurement."""
        return {p: tasks_ahead(self.issued, self._curated_at_lag[p], self.backlog_by[p], self.options.n_samples)
                for p in self.throttled}

    def room(self) -> int:
        """Tasks that may be issued now, by the count of the last measurement (see the module doc)."""
        self.ahead = max(self.ahead_by().values(), default=0)
        room = self.options.max_ahead - self.ahead
        if self.options.max_tasks:
            room = min(room, self.options.max_tasks - self.issued_here)
        return room

    def _backlogs(self, ends: bool, place_at: float | None = None) -> dict[str, int | Exception]:
        """Each throttled policy's backlog, or why it could not be measured (runs in a thread);
        `ends`: read the end offsets again; with `place_at`, the placement observes the nodes'
        progress first."""
        if place_at is not None and self.placer is not None:
            self.placer.observe(place_at)
        if self._fleet_reader is not None:
            from astraflow.kafka.clients import consume_ready

            try:
                self._fleet_msgs = consume_ready(self._fleet_reader, 5000, 0.0)
            except KafkaException as exc:
                log.warning("could not read the nodes' metrics and trajectories (%s); the shares wait", exc)
        out: dict[str, int | Exception] = {}
        for policy in self.throttled:
            try:
                out[policy] = self.measure_backlog(policy, ends)
            except (KafkaException, AstraflowError) as exc:
                out[policy] = exc
        return out

    async def measure(self, now: float, place_at: float | None = None) -> None:
        """The trainers' backlogs, and `curated` as it was just before the end offsets were read
        (see below). The requests run in a thread: the event loop meanwhile reads feedback (a
        blocked loop would leave groups counted twice, in the backlog and as not curated, for
        longer). The end offsets are read again only when feedback arrived since they were last
        read (curate writes samples and feedback in one transaction) or `gauge_interval_s` has
        passed; otherwise the last ones serve, with the `curated` read before them."""
        # Groups curated after the end offsets were read are in `curated` but their samples are
        # not in the backlog: counting them as done would issue more than max-ahead. So `curated`
        # is read BEFORE the end offsets (a group counts as ahead a little longer). Older end
        # offsets with newer committed ones only count more: the samples of the groups in that
        # `curated` all lie below those end offsets.
        curated = dict(self.curated_by)
        ends = self._fed or now >= self._ends_due
        if ends:
            self._fed, self._ends_due = False, now + self.options.gauge_interval_s
        self.measured, self.ends_read = self.measured + 1, self.ends_read + ends
        for policy, backlog in (await asyncio.to_thread(self._backlogs, ends, place_at)).items():
            if isinstance(backlog, Exception):  # a slow broker: keep the last figures, retry later
                log.warning("could not measure the %s trainer's backlog (%s); using the last value", policy, backlog)
                self._fed = True  # and read the end offsets again then
                continue
            self.backlog_by[policy] = backlog
            if ends:
                self._curated_at_lag[policy] = curated[policy]
        if self.fleet is not None:
            from stream_apps.region_fleet import feed_fleet

            msgs, self._fleet_msgs = self._fleet_msgs, []
            feed_fleet(self.fleet, msgs, self.worker.serde, self.worker.topics.metrics, time.monotonic(), time.time(),
                       self._provenance)

    def tick(self, now: float) -> Awaitable[None] | None:
        """Issues what the count allows; measures the backlogs first when due (then returns that work)."""
        if not self._recovered:
            return None  # statistics not known yet: nothing to count or choose from
        self._observe()
        control = self.worker.control.get("pause")
        self.paused = control is not None and control.strategy.lower() in PAUSE_ON
        if self.paused:  # nothing to issue: no requests either (the first tick after it measures, as due)
            self.issue()
            return None
        place_at = None
        if (self.placer is not None or self.fleet is not None) and now >= self._place_due:  # the placement's own pace
            self._place_due, place_at = now + PLACE_INTERVAL_S, now
        if (now >= self._lag_due and self.room() <= 0) or now >= self._gauge_due or place_at is not None:
            self._lag_due, self._gauge_due = now + self.options.lag_interval_s, now + self.options.gauge_interval_s
            return self._measured_then_issue(now, place_at)
        self.issue()
        return None

    async def _measured_then_issue(self, now: float, place_at: float | None) -> None:
        await self.measure(now, place_at)
        self.issue()

    def issue(self) -> None:
        """As many tasks as the count leaves room for (at most `batch`); first, with regions, the
        tasks of a dark region given back to live ones (they hold no new slot: see region_fleet)."""
        if self.fleet is not None and not self.paused:
            for task, topic in self.fleet.to_give_back():
                self._send(topic, task)
                self.fleet.given_back += 1
        room = self.room()
        if self.paused or room <= 0:
            if self.options.max_tasks and self.issued_here >= self.options.max_tasks:
                log.info("curator: issued the %d tasks asked for; stopping", self.issued_here)
                self.worker.stop()
            return
        strategy = self.slot.get()
        assert strategy is not None
        selection = strategy(self.pool, self.stats, min(room, self.options.batch))
        self.skipped += len(selection.skipped)
        ref = strategy.ref(self.name, "curator")
        for prompt in selection.chosen:
            topic = self.fleet.next_topic() if self.fleet is not None else self.tasks_topic
            if topic is None:  # every region dark or at its limit: nowhere to send a task now
                break
            self._send(topic, self._task(self.by_id[prompt.prompt_id], ref))
            self.issued += 1
            self.issued_here += 1
        self.room()

    def _send(self, topic: str, task: Task) -> None:
        """Writes `task` to `topic` (region A's: to the partition the placement chooses)."""
        partition = self.placer.choose() if self.placer is not None and topic == self.tasks_topic else None
        value = self.worker.serde.dumps(task)
        self.worker.send_encoded(topic, value, task.group_id, partition, self.signer.headers("tasks", task.group_id, value))
        if partition is not None:
            self.placer.sent(partition)
        if self.fleet is not None:
            self.fleet.sent(topic, task)
        self.issued_to[topic] = self.issued_to.get(topic, 0) + 1

    @property
    def signer(self) -> Any:
        """Signs every task: curate takes each group's size and members from its task, and only
        from one its curator signed (stream_apps.task_book)."""
        if self._signer is None:
            from astraflow.kafka.signing import Signer

            self._signer = Signer(self.worker.topics.experiment, "curator")
        return self._signer

    def _task(self, row: DatasetRow, ref: Any) -> Task:
        task_id = f"{self._run}-{self.issued_here}"
        o = self.options
        return Task(
            task_id=task_id,
            group_id=task_id,
            prompt_id=row.prompt.prompt_id,
            dataset=row.prompt.dataset,
            workflow=row.workflow or o.workflow,
            prompt=row.text,
            policies=list(o.policies),
            n_samples=o.n_samples,
            reference=row.reference,
            sampling=o.sampling,
            metadata={**row.metadata, **({"system_prompt": o.system_prompt} if o.system_prompt else {}),
                      **({"difficulty": f"{row.prompt.difficulty:g}"} if row.prompt.difficulty is not None else {})},
            lineage=[ref],
            created_at=int(time.time() * 1000),
        )

    def _observe(self) -> None:
        easy, hard, total = self._zv
        if total:
            observe = getattr(self.slot.get().impl, "observe", None)  # type: ignore[union-attr]
            if observe is not None:
                observe(easy, hard, total)
            self._zv = [0, 0, 0]

    def gauges(self) -> dict[str, float]:
        return {
            "tasks_ahead": float(self.ahead), "tasks_issued_total": float(self.issued),
            "groups_curated_total": float(self.curated), "train_backlog": float(self.backlog),
            "prompts_skipped_total": float(self.skipped), "dataset_bad_rows": float(self.bad_rows),
            "paused": float(self.paused),
            "backlog_measurements_total": float(self.measured), "end_offset_reads_total": float(self.ends_read),
            "control_version.curator": float(self.slot.version),
            **{f"tasks_ahead.{p}": float(a) for p, a in self.ahead_by().items()},
            **{f"train_backlog.{p}": float(b) for p, b in self.backlog_by.items()},
            **(self.fleet.gauges() if self.fleet is not None else {}),
        }

    def close(self) -> None:
        log.info("curator: %d tasks issued here, %d backlog measurements, %d of them read the end offsets",
                 self.issued_here, self.measured, self.ends_read)
        if self.placer is not None:
            self.placer.close()
        for consumer in [self._lag_consumer, self._fleet_reader, *self._readers.values()]:
            if consumer is not None:
                consumer.close()
        self._readers.clear()
