"""The fault harness's books: which tasks were issued, which samples were trained, how often.

The unit is the **sample**: a task `T` with `n_samples` = n expects the samples
`T/0#policy` .. `T/(n-1)#policy` (trajectory ids are `<task_id>/<index>`, sample ids
`<trajectory_id>#<policy>`; both deterministic, see `Trajectory.make_id` and
`stream_apps.groups.sample_id`). So counting needs no cooperation from the roles beyond what
they already write:

* **issued**: the Task records of the tasks topic, read `read_committed` (a curator killed
  mid-send issued what reached the log, nothing else);
* **trained**: the trainer's trained-sample log (`trainer.trained_log`, JSONL: per optimizer
  step, `run`, `step` and the sample ids it trained), reduced to the **lineage**: a restarted
  trainer resumes from a checkpoint of step k and trains k+1.. again, so the steps an earlier
  run logged after the checkpoint it was restarted from are not in the weights anyone ends up
  with (`lineage`);
* **accounted for**: a sample that was not trained but whose task, trajectory or sample is in
  the DLQ (its reason kept).

Then `lost` = expected, neither trained in the lineage nor accounted for; `trained twice` = a
sample id in two steps of the lineage. Both are exact on this definition; nothing is sampled
or estimated.
"""

from __future__ import annotations

import json
import math
import uuid
from collections import Counter
from collections.abc import Iterable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from confluent_kafka import KafkaError, KafkaException, TopicPartition

from astraflow.config import KafkaSettings
from astraflow.errors import SerdeError
from astraflow.kafka.clients import reader
from astraflow.serde import AvroSerde

POLICY = "policy"


def expected_samples(task_id: str, n_samples: int, policy: str = POLICY) -> list[str]:
    return [f"{task_id}/{i}#{policy}" for i in range(n_samples)]


def task_of(sample_or_trajectory_id: str) -> str:
    """`<task_id>/<index>[#policy]` -> task_id."""
    return sample_or_trajectory_id.split("#", 1)[0].rsplit("/", 1)[0]


@dataclass(frozen=True)
class Step:
    """One line of the trained-sample log: an optimizer step of one trainer process."""

    run: str  # the trainer process (host-pid-start)
    step: int  # its global step (restored steps count)
    samples: tuple[str, ...]  # sample ids trained in it
    line: int  # position in the log (0-based): orders steps in time


PUBLISHED = "published"  # the run of every line of a per-sample log: its lines are all in the lineage


def parse_trained_log(text: str) -> tuple[list[Step], int]:
    """Steps of a trained-sample log, and the number of lines that did not parse (a torn write).

    Two formats: one line per optimizer step (`run`, `step`, `samples` as [partition, offset,
    sample_id]: every step a process trained, the lineage is worked out by `lineage`), or one
    line per sample in published weights (`sample_id`, `step`, `version`: written when the version
    that carries it is published, so every line is in the lineage; each becomes a one-sample step)."""
    steps, bad = [], 0
    for i, line in enumerate(text.splitlines()):
        if not line.strip():
            continue
        try:
            d = json.loads(line)
            if "sample_id" in d:
                steps.append(Step(PUBLISHED, int(d["step"]), (str(d["sample_id"]),), i))
            else:
                steps.append(Step(str(d["run"]), int(d["step"]), tuple(str(s[2]) for s in d["samples"]), i))
        except (ValueError, KeyError, IndexError, TypeError):
            bad += 1
    return steps, bad


def lineage(steps: list[Step]) -> list[Step]:
    """The steps whose updates are in the final weights, oldest first.

    Walking back from the last trainer run: a run that starts at step a resumed from the
    checkpoint of step a-1, so from the runs before it only steps <= a-1 count, and of those only
    the latest run's (it wrote that checkpoint). A run whose steps all lie beyond that bound was
    killed before any checkpoint its successors resumed from: none of its steps count."""
    runs: dict[str, list[Step]] = {}
    for s in steps:
        runs.setdefault(s.run, []).append(s)
    out: list[Step] = []
    upto = math.inf
    for run in reversed(list(runs.values())):
        kept = [s for s in run if s.step <= upto]
        if kept:
            out = kept + out
            upto = min(s.step for s in run) - 1
    return out


@dataclass
class IssuedTask:
    """A task as the tasks topic holds it."""

    task_id: str
    n_samples: int
    ts_ms: int  # Kafka timestamp: when the curator wrote it
    where: tuple[str, int] | None = None  # (topic, partition) it was written to


@dataclass
class Tally:
    """The counts over one set of tasks (one phase, or the whole run)."""

    tasks_issued: int = 0
    tasks_trained: int = 0  # tasks whose every expected sample is trained in the lineage
    samples_expected: int = 0
    samples_trained: int = 0  # distinct sample ids trained in the lineage
    lost: int = 0  # samples neither trained nor accounted for
    accounted: int = 0  # samples not trained, with a reason (DLQ)
    trained_twice: int = 0  # sample ids in two or more lineage steps
    lost_ids: list[str] = field(default_factory=list)  # the first few, for the report
    twice_ids: list[str] = field(default_factory=list)


def tally(tasks: Iterable[IssuedTask], steps: list[Step], accounted: dict[str, str],
          twice_lines: tuple[int, int] | None = None) -> Tally:
    """Counts over `tasks`; trained-twice over the samples whose second training in the lineage
    is in the log lines `twice_lines` [start, end) (all, when None), whatever task they belong to."""
    lin = lineage(steps)
    counts = Counter(sid for s in lin for sid in s.samples)
    t = Tally()
    for task in tasks:
        t.tasks_issued += 1
        ids = expected_samples(task.task_id, task.n_samples)
        t.samples_expected += len(ids)
        done = 0
        for sid in ids:
            if counts[sid]:
                t.samples_trained += 1
                done += 1
            elif sid in accounted:
                t.accounted += 1
            else:
                t.lost += 1
                if len(t.lost_ids) < 10:
                    t.lost_ids.append(sid)
        t.tasks_trained += done == len(ids)
    seen: Counter[str] = Counter()
    for s in lin:
        for sid in s.samples:
            seen[sid] += 1
            if seen[sid] == 2 and (twice_lines is None or twice_lines[0] <= s.line < twice_lines[1]):
                t.trained_twice += 1
                if len(t.twice_ids) < 10:
                    t.twice_ids.append(sid)
    return t


class TopicReader:
    """Reads a topic from its start, `read_committed`, in increments: `read()` returns what is new
    up to the end of every partition (the last stable offset).

    librdkafka reports a partition's end (`_PARTITION_EOF`, at the offset where it arrived) once per
    arrival there: a partition with nothing new since the previous read reports nothing again. So
    the reader keeps where each partition's last end was, asks the broker for each partition's end
    now (`read_committed`: its last stable offset, past any transaction markers) and counts a
    partition whose end has not moved as read; the others it reads until their end is reported."""

    def __init__(self, kafka: KafkaSettings, topic: str, serde: AvroSerde | None = None) -> None:
        self.topic, self.serde = topic, serde or AvroSerde()
        self.consumer = reader(kafka, f"faults-reader-{uuid.uuid4().hex[:8]}", **{"enable.partition.eof": True},
                               log_level=2)  # quiet while the harness has the broker down
        md = self.consumer.list_topics(topic, timeout=30)
        parts = sorted(md.topics[topic].partitions)
        self.partitions = parts
        self.consumer.assign([TopicPartition(topic, p, 0) for p in parts])  # 0: earliest (never deleted here)
        self.undecodable = 0
        self.ended_at: dict[int, int] = {}  # partition -> offset of its last reported end
        self.at_end = False  # the last read ended at every partition's end (False: its deadline came first)

    def read(self, timeout_s: float = 30.0) -> list[tuple[Any, int]]:
        """New records as (record, Kafka timestamp ms); stops at the end of every partition."""
        return [(rec, ts) for rec, ts, _, _ in self.read_located(timeout_s)]

    def _unmoved(self, timeout_s: float) -> set[int]:
        """Partitions whose end is where it was last reported (nothing new to read there)."""
        out = set()
        for p, at in self.ended_at.items():
            try:
                _, end = self.consumer.get_watermark_offsets(TopicPartition(self.topic, p), timeout=timeout_s, cached=False)
            except KafkaException:
                continue  # unknown: read it until its end is reported
            if end == at:
                out.add(p)
        return out

    def read_located(self, timeout_s: float = 30.0) -> list[tuple[Any, int, int, int]]:
        """New records as (record, Kafka timestamp ms, partition, offset); `at_end` says whether the
        read reached every partition's end before `timeout_s`."""
        import time

        out: list[tuple[Any, int, int, int]] = []
        deadline = time.monotonic() + timeout_s
        ended = self._unmoved(min(5.0, timeout_s))
        while len(ended) < len(self.partitions) and time.monotonic() < deadline:
            for msg in self.consumer.consume(500, 0.5):
                err = msg.error()
                if err is not None:
                    if err.code() == KafkaError._PARTITION_EOF:
                        ended.add(msg.partition())
                        self.ended_at[msg.partition()] = msg.offset()
                    continue
                ended.discard(msg.partition())
                try:
                    out.append((self.serde.loads(msg.value()), msg.timestamp()[1], msg.partition(), msg.offset()))
                except SerdeError:
                    self.undecodable += 1
        self.at_end = len(ended) == len(self.partitions)
        return out

    def close(self) -> None:
        self.consumer.close()


class Ledger:
    """Issued tasks, dead letters and the trained-sample log of one experiment (see the module doc)."""

    def __init__(self, kafka: KafkaSettings, tasks_topic: str, dlq_topic: str, trained_log: Path,
                 more_tasks_topics: tuple[str, ...] = ()) -> None:
        # more_tasks_topics: a region's own tasks topic (`--region-share`), issued like the others
        self.tasks_readers = [TopicReader(kafka, t) for t in (tasks_topic, *more_tasks_topics)]
        self.dlq_reader = TopicReader(kafka, dlq_topic)
        self.trained_log = trained_log
        self.tasks: dict[str, IssuedTask] = {}
        self.duplicate_tasks = 0  # one task id written twice to the tasks topic
        # every Task record as written: (task id, topic, Kafka timestamp ms, metadata given_back_from or None)
        self.written: list[tuple[str, str, int, str | None]] = []
        self.accounted: dict[str, str] = {}  # sample id -> reason it was not trained
        self.unattributed_dead_letters: list[str] = []  # dead letters that name no task, trajectory or sample
        self.steps: list[Step] = []
        self.torn_lines = 0
        self.complete = False  # the last refresh read every topic to its end (not cut by its timeout)
        self.serde = AvroSerde()

    def refresh(self, timeout_s: float = 30.0) -> None:
        from astraflow.records import Task

        for r in self.tasks_readers:
            for rec, ts, partition, _ in r.read_located(timeout_s):
                if isinstance(rec, Task):
                    self.written.append((rec.task_id, r.topic, ts, rec.metadata.get("given_back_from")))
                    if rec.task_id in self.tasks:
                        self.duplicate_tasks += 1
                    else:
                        self.tasks[rec.task_id] = IssuedTask(rec.task_id, int(rec.n_samples), ts, (r.topic, partition))
        for rec, _ in self.dlq_reader.read(timeout_s):
            self._dead_letter(rec)
        self.complete = all(r.at_end for r in (*self.tasks_readers, self.dlq_reader))
        self.steps, self.torn_lines = parse_trained_log(self.trained_log.read_text()) if self.trained_log.exists() else ([], 0)

    def _dead_letter(self, dl: Any) -> None:
        from astraflow.records import Task, TrainSample, Trajectory

        reason = f"{dl.component}: {dl.error_class}: {dl.error}"[:300]
        try:
            rec = self.serde.loads(dl.original) if dl.original else None
        except SerdeError:
            rec = None
        if isinstance(rec, Task):
            for sid in expected_samples(rec.task_id, int(rec.n_samples)):
                self.accounted.setdefault(sid, reason)
        elif isinstance(rec, Trajectory):
            self.accounted.setdefault(f"{rec.trajectory_id}#{POLICY}", reason)
        elif isinstance(rec, TrainSample):
            self.accounted.setdefault(rec.sample_id, reason)
        else:
            self.unattributed_dead_letters.append(reason)

    def trained_counts(self) -> Counter[str]:
        """Sample id -> lineage steps that trained it."""
        return Counter(sid for s in lineage(self.steps) for sid in s.samples)

    def outstanding(self) -> int:
        """Expected samples neither trained nor accounted for yet (the drain waits for 0)."""
        trained = self.trained_counts()
        return sum(1 for t in self.tasks.values() for sid in expected_samples(t.task_id, t.n_samples)
                   if sid not in trained and sid not in self.accounted)

    def tally(self, tasks: Iterable[IssuedTask], twice_lines: tuple[int, int] | None = None) -> Tally:
        return tally(tasks, self.steps, self.accounted, twice_lines)

    def close(self) -> None:
        for r in self.tasks_readers:
            r.close()
        self.dlq_reader.close()
