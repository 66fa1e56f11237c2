"""The curator app: datasets -> tasks, chosen from feedback, at most `max-ahead` tasks in flight.

    astraflow app run curator --experiment EXP --policy solver --dataset train.jsonl \
        --n-samples 8 --max-ahead 64 [--workflow rlvr] [--max-tasks N]
    astraflow control set --experiment EXP curator curator filter_solved --param threshold=0.8
    astraflow control set --experiment EXP curator pause on      # stop issuing; `off` resumes

The curator is a Faust app like the others: its agent reads `feedback` (the per-prompt
statistics curate publishes for every finished group) and a timer issues tasks. Every tick
(0.2 s) it measures how many tasks are ahead of the trainer, and if fewer than
`--max-ahead`, asks the curator strategy (slot `curator`, default `accept_all`) for that many
prompts, given the prompts' latest statistics from `feedback` (those of the first `--policy`),
and writes one Task per prompt (`--n-samples` samples: one group) to `tasks`, keyed by group
id, with lineage `StrategyRef("curator", "curator", name, version)`.

**Tasks ahead** (in tasks; everything restart-safe because it comes from Kafka):

    ahead = issued - curated + ceil(train_backlog / n_samples)

* `issued`: tasks ever written to `tasks` (sum of its end offsets at start, plus what this
  process wrote since);
* `curated`: groups curate has finished, emitted or filtered out: the sum of `groups` over the
  first policy's PromptStats on the compacted `feedback` topic (each record is cumulative, so
  compaction loses nothing, and a record read twice changes nothing): read to its end at start,
  then followed by the agent;
* `train_backlog`: samples in `<policy>.train` the trainer has not consumed: end offsets minus
  the committed offsets of the trainer's consumer group (`--trainer-group`, default
  `af.<experiment>.<policy>.trainer`, what `astraflow train` commits); a partition without a
  commit counts from its start. `--trainer-group none` leaves the trainer out (then only
  tasks not yet curated are counted).

So a task counts from the moment it is issued until the trainer consumed its samples (or
curate dropped its group), which bounds staleness by about max-ahead / (tasks per version).
A group that never reaches curate (every rollout of it lost before `scored`) keeps its slot
until the curator restarts with a larger max-ahead; curate publishes statistics even for
groups it drops as incomplete, so lost trajectories alone do not leak slots.
"""

from __future__ import annotations

import logging
import math
import time
import uuid
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from confluent_kafka import KafkaException

from astraflow.errors import AstraflowError, ConfigError
from astraflow.records import PromptStats, SamplingParams, Task
from stream_apps.datasets import DatasetRow, load_datasets
from stream_apps.handler import AppHandler, Incoming
from stream_apps.slots import Slot, SlotDefault

log = logging.getLogger("astraflow.stream.curator")

DEFAULTS = {"curator": SlotDefault("accept_all")}
PAUSE_ON = frozenset({"on", "true", "1", "yes", "pause", "paused"})


def tasks_ahead(issued: int, curated: int, backlog_samples: int, n_samples: int) -> int:
    """Tasks between the curator and the trainer (see the module doc)."""
    return max(0, issued - curated + math.ceil(max(0, backlog_samples) / max(1, n_samples)))


@dataclass
class CuratorOptions:
    """What the curator app issues and how far ahead."""

    datasets: Sequence[str | Path]  # JSONL / Parquet files
    policies: Sequence[str]  # Task.policies; the first one's feedback drives choices and accounting
    n_samples: int = 8  # samples per prompt (one group)
    max_ahead: int = 64  # most tasks ahead of the trainer
    workflow: str = "rlvr"  # workflow of rows that do not name one
    sampling: SamplingParams = field(default_factory=SamplingParams)  # decoding parameters of every task
    max_tasks: int = 0  # stop after issuing this many (0: never)
    batch: int = 64  # most tasks issued per tick
    trainer_group: str | None = None  # consumer group of the first policy's trainer; "none" to ignore it
    lag_interval_s: float = 0.2  # how often the trainer's backlog is measured (every tick)


class CuratorApp(AppHandler):
    """Issues tasks (see the module doc)."""

    name = "curator"
    sources = ("feedback",)
    expect = PromptStats
    tick_interval_s = 0.2

    def __init__(self, options: CuratorOptions, defaults: dict[str, SlotDefault] | None = None) -> None:
        if not options.policies:
            raise ConfigError("the curator needs at least one --policy (the policies each task is rolled out with)")
        if options.n_samples < 1 or options.max_ahead < 1:
            raise ConfigError("--n-samples and --max-ahead must be >= 1")
        self.options = options
        self.defaults = {**DEFAULTS, **(defaults or {})}
        self.primary = options.policies[0]
        self.rows: list[DatasetRow] = load_datasets(options.datasets)
        self.by_id = {r.prompt.prompt_id: r for r in self.rows}
        self.pool = [r.prompt for r in self.rows]
        self.stats: dict[str, PromptStats] = {}  # prompt_id -> latest PromptStats of the primary policy
        self.curated = 0  # sum of stats[*].groups
        self.issued = 0  # tasks ever written to the tasks topic
        self.issued_here = 0  # by this process
        self.skipped = 0  # prompts the strategy passed over
        self.backlog = 0  # train samples the trainer has not consumed
        self.ahead = 0
        self.paused = False
        self._zv = [0, 0, 0]  # zero-variance groups seen since the last observe(): easy, hard, total
        self._run = uuid.uuid4().hex[:6]
        self._lag_due = 0.0
        self._curated_at_lag = 0  # `curated` when the backlog was last measured
        self._lag_consumer: Any = None

    def bind(self, worker: Any) -> None:
        from confluent_kafka import Consumer

        from astraflow.control import CompactedReader

        super().bind(worker)
        self.slot = Slot(worker.control, self.name, "curator", "curator", self.defaults["curator"])
        self.tasks_topic = worker.topics.tasks
        self.train_topic = worker.topics.train(self.primary)
        group = self.options.trainer_group or f"af.{worker.settings.experiment}.{self.primary}.trainer"
        self.trainer_group = None if group.lower() == "none" else group
        # Never subscribes: only reads watermarks and the trainer group's committed offsets.
        self._lag_consumer = Consumer({**worker.kafka.client_config(), "group.id": self.trainer_group or f"af-curator-{self._run}",
                                       "enable.auto.commit": False})
        self.issued = sum(high for _, high in self._watermarks(self.tasks_topic).values())
        history = CompactedReader(
            worker.kafka, worker.topics.feedback, serde=worker.serde, expect=PromptStats, on_record=self._on_feedback
        )
        try:
            history.catch_up()
        finally:
            history.close()
        self._zv = [0, 0, 0]  # history is not news: observe only what arrives from now on
        log.info("curator: %d prompts, %d tasks issued so far, %d groups curated", len(self.pool), self.issued, self.curated)

    def _watermarks(self, topic: str) -> dict[int, tuple[int, int]]:
        from astraflow.kafka.clients import watermarks

        md = self._lag_consumer.list_topics(topic, timeout=10.0)
        meta = md.topics.get(topic)
        if meta is None or meta.error is not None:
            raise ConfigError(f"topic {topic} does not exist; create the experiment's topics with `astraflow topics create`")
        return {p: watermarks(self._lag_consumer, topic, p) for p in meta.partitions}

    def handle(self, inc: Incoming) -> None:
        """A feedback record (curate finished a group of this prompt)."""
        self._on_feedback(inc.key_str or "", inc.record)

    def _on_feedback(self, key: str, stats: PromptStats | None) -> None:
        policy, _, prompt_id = key.partition("/")
        if policy != self.primary or stats is None:
            return
        old = self.stats.get(prompt_id)
        new_groups = stats.groups - (old.groups if old else 0)
        if new_groups <= 0:
            return
        self.stats[prompt_id] = stats
        self.curated += new_groups
        if stats.zero_variance_streak > 0:
            self._zv[0 if stats.last_pass_rate >= 0.5 else 1] += 1
        self._zv[2] += 1

    def measure_backlog(self) -> int:
        """Train samples of the primary policy the trainer has not consumed yet."""
        if self.trainer_group is None:
            return 0
        from confluent_kafka import TopicPartition

        marks = self._watermarks(self.train_topic)
        committed = self._lag_consumer.committed([TopicPartition(self.train_topic, p) for p in marks], timeout=10.0)
        done = {tp.partition: tp.offset for tp in committed}
        return sum(high - max(low, done.get(p, -1)) for p, (low, high) in marks.items())

    def tick(self, now: float) -> None:
        self._observe()
        if now >= self._lag_due:
            self._lag_due = now + self.options.lag_interval_s
            curated = self.curated  # read BEFORE the backlog: see below the measurement
            try:
                self.backlog = self.measure_backlog()
                self._curated_at_lag = curated
            except (KafkaException, AstraflowError) as exc:  # a slow broker: keep the last figures, retry next tick
                log.warning("could not measure the trainer's backlog (%s); using the last value", exc)
        control = self.worker.control.get("pause")
        self.paused = control is not None and control.strategy.lower() in PAUSE_ON
        # Groups curated since the backlog was measured are in `curated` but their samples are not
        # in `backlog` yet: counting them as done would issue more than max-ahead. So `curated` is
        # the count taken just before that measurement (a group counts as ahead a little longer).
        self.ahead = tasks_ahead(self.issued, self._curated_at_lag, self.backlog, self.options.n_samples)
        room = self.options.max_ahead - self.ahead
        if self.options.max_tasks:
            room = min(room, self.options.max_tasks - self.issued_here)
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
            task = self._task(self.by_id[prompt.prompt_id], ref)
            self.worker.send(self.tasks_topic, task, task.group_id)
            self.issued += 1
            self.issued_here += 1
        self.ahead = tasks_ahead(self.issued, self._curated_at_lag, self.backlog, self.options.n_samples)

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
            metadata={**row.metadata, **({"difficulty": f"{row.prompt.difficulty:g}"} if row.prompt.difficulty is not None else {})},
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
            "prompts_skipped_total": float(self.skipped), "paused": float(self.paused),
            "control_version.curator": float(self.slot.version),
        }

    def close(self) -> None:
        if self._lag_consumer is not None:
            self._lag_consumer.close()
