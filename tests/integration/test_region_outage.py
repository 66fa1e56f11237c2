"""A region that goes dark does not stop the others (the curator's `--region-share` with shares that
follow the fleet), on a real broker: one cluster with two task topics, `tasks` (region A) and
`tasks.b` (region B), exercising the same curator code as two clusters joined by MirrorMaker 2
(which only carries those topics, the metrics and the trajectories between them).

The test plays each region's node (reads its region's topic, writes one trajectory per task keyed
by group id and its `raas` metrics every 0.5 s, as RaaS nodes do) and curate (a group is trained the
first time one of its trajectories arrives, a later one is a duplicate, and each trained group's
prompt statistics go to `feedback`, which frees the curator's slot). Region B's node is killed
(no more tasks taken, no metrics) while it holds tasks, then comes back.
"""

from __future__ import annotations

import json
import time
from collections import Counter
from pathlib import Path

from astraflow.config import KafkaSettings
from astraflow.kafka.clients import RecordProducer, reader
from astraflow.kafka.topics import TopicAdmin, Topics, TopicSpec, reader_group
from astraflow.records import Metric, PromptStats, Task
from astraflow.testing import make_trajectory
from stream_apps.curator import CuratorOptions
from stream_apps.engine import EngineSettings
from stream_apps.launch import AppOptions, build_worker


class Region:
    """One region's node: takes `per_step` tasks a step from its topic while alive; a dead one
    takes none and sends no metric, and its tasks wait for it (as in its topic and committed offsets)."""

    def __init__(self, kafka: KafkaSettings, t: Topics, region: str) -> None:
        from confluent_kafka import OFFSET_BEGINNING, TopicPartition

        self.t, self.name = t, region
        self.topic = t.tasks if region == "a" else t.tasks_of(region)
        self.alive = True
        self.consumer = reader(kafka, reader_group("test"))
        self.consumer.assign([TopicPartition(self.topic, p, OFFSET_BEGINNING) for p in (0, 1)])
        self.queue: list[Task] = []  # fetched, not done
        self.done: list[Task] = []
        self.seen: list[Task] = []  # every task written to its topic, in the order read
        self.last_beat = 0.0

    def step(self, producer: RecordProducer, now: float) -> list[Task]:
        for m in self.consumer.consume(200, 0.05):
            if m.error() is None:
                task = producer.serde.loads(m.value(), Task)
                self.seen.append(task)
                self.queue.append(task)
        if not self.alive:
            return []
        took, self.queue = self.queue[:1], self.queue[1:]
        for task in took:
            traj = make_trajectory(64, task_id=task.task_id, group_size=1, prompt_tokens=8)
            traj.group_id, traj.prompt_id = task.group_id, task.prompt_id
            producer.send(self.t.rollouts, traj, key=task.group_id)
        self.done += took
        if now - self.last_beat >= 0.5:
            self.last_beat = now
            labels = {"region": self.name, "tasks_region": "" if self.name == "a" else self.name}
            for name, value in (("rollouts_per_s", 5.0), ("busy_tasks_per_s", 5.0)):
                producer.send(self.t.metrics, Metric(name, value, "raas", f"node-{self.name}", labels),
                              key=f"node-{self.name}")
        return took


def test_a_dark_region_does_not_stop_the_other_and_nothing_is_lost_or_trained_twice(
        kafka: KafkaSettings, experiment: str, tmp_path: Path) -> None:
    t = Topics(experiment)
    admin = TopicAdmin(kafka)
    admin.create([TopicSpec(t.tasks_of("b"), 2)])
    data = tmp_path / "d.jsonl"
    data.write_text("".join(json.dumps({"id": f"q{i}", "prompt": f"{i}+{i}=?", "reference": {"answer": str(2 * i)},
                                        "dataset": "arith"}) + "\n" for i in range(40)))
    total = 90
    options = CuratorOptions([data], ["policy"], n_samples=1, max_ahead=8, trainer_group="none", max_tasks=total,
                             region_share={"b": 0.5}, region_dead_s=3.0)
    worker = build_worker("curator", EngineSettings(experiment, kafka, metrics_interval_s=60), AppOptions(curator=options))
    producer = RecordProducer(kafka)
    a, b = Region(kafka, t, "a"), Region(kafka, t, "b")
    trained: set[str] = set()  # curate: groups emitted
    attempts: Counter[str] = Counter()  # groups rolled out, by either region
    groups_of: Counter[str] = Counter()
    a_done_dark = 0
    b_stranded: set[str] = set()
    b_seen_back = 0
    thread = worker.start_thread()
    phase, phase_at = "both", time.monotonic()
    try:
        deadline = time.monotonic() + 150
        while True:
            now = time.monotonic()
            assert now < deadline, f"timed out in phase {phase}: {len(trained)} of {total} groups trained"
            for r in (a, b):
                for task in r.step(producer, now):
                    attempts[task.group_id] += 1
                    if task.group_id in trained:
                        continue  # curate drops a trajectory id it already emitted: not trained again
                    trained.add(task.group_id)
                    groups_of[task.prompt_id] += 1
                    n = groups_of[task.prompt_id]
                    producer.send(t.feedback, PromptStats(task.prompt_id, "arith", "policy", n, n, 0.5, 0.5, 0.5, 0.5,
                                                          4.0, 0, 0), key=f"policy/{task.prompt_id}")
                    a_done_dark += phase == "dark" and r is a
            producer.flush()
            if phase == "both" and len(b.done) >= 10 and len(a.done) >= 10:
                b.alive = False  # killed: what it fetched, and what still comes, waits for it
                phase, phase_at = "dark", now
            elif phase == "dark" and now - phase_at > 8.0:
                b_stranded = {x.group_id for x in b.queue}
                b_seen_back = len(b.seen)
                b.alive = True  # back: it does what waited for it, then what it gets from now on
                phase, phase_at = "back", now
            elif phase == "back" and len(trained) == total and not thread.is_alive():
                break
            time.sleep(0.1)
    finally:
        worker.stop()
        thread.join(timeout=30)
        producer.flush()
        for r in (a, b):
            r.consumer.close()
        admin.delete([t.tasks_of("b")])
    issued = {x.group_id for x in a.seen} | {x.group_id for x in b.seen}
    assert len(issued) == total and trained == issued  # nothing lost; a given-back task kept its group id
    given_back = [x.group_id for x in a.seen if x.metadata.get("given_back_from") == t.tasks_of("b")]
    assert given_back, "region B's outstanding tasks were not given back"
    assert len(given_back) == len(set(given_back))
    assert set(given_back) <= b_stranded  # only tasks B held and had not done
    assert a_done_dark >= 10, "region A was not kept fed while region B was dark"
    assert all(attempts[g] <= 2 for g in given_back) and all(attempts[g] == 1 for g in issued - set(given_back))
    new_for_b = [x for x in b.seen[b_seen_back:] if x.group_id not in given_back]
    assert new_for_b, "region B got no new task after it came back"
