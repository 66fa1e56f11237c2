"""The tasks the curator issued, as curate needs them: which groups exist, and what each one is.

A GRPO group is whatever its task says: `n_samples` members, sample indices `0..n-1`, each
trajectory's id `Trajectory.make_id(task_id, sample_index)`. Curate takes that from the task,
never from the trajectories (a rollout writer could otherwise claim another node's group with
`group_size=1` and complete it alone). `TaskBook` follows the experiment's tasks topics (region
A's `tasks` and every region's own `tasks.<region>`) and keeps, per `group_id`, the claims of
the task signed by the experiment's curator key (`astraflow.kafka.signing`, stream `tasks`); a
task without a valid signature is dead-lettered by the reader and authorises nothing.

Why the topic and not a copy carried with the trajectory: the tasks topic is already where the
curator writes, so nodes, the reward app and the trajectory schema stay as they are, and a
trajectory cannot bring its own authority along. A trajectory's task is always written before
the trajectory (a node reads it first), so a group curate does not know yet is looked up again
in what the readers already fetched, then after reading every tasks topic to its current end
(`claim`): only then is it "no task". Curate's event loop waits for that read, so it must be
short: the end offsets of all partitions come in one request (`CompactedReader.catch_up`; asked
partition by partition through the reader's own connection they took 0.4-0.5 s each, 10-12 s
for the 24 partitions of `tasks` and `tasks.b`, during which curate handled nothing). The
book is rebuilt from the topics at start, so a worker that takes a partition over decides as
its previous owner did (curate's decisions stay exactly-once). Tasks older than the topics'
retention are gone: their late trajectories are refused as "no task issued" (keep the tasks'
retention longer than the longest rollout).

A task the curator issues again under the same `group_id` (a redelivery, work given back by a
region that went dark) is the same task: same id, same trajectory ids, so their late duplicates
are recognised as superseded (`stream_apps.groups`).
"""

from __future__ import annotations

import time
from typing import Any

from astraflow.records import Task
from stream_apps.groups import TaskClaim

LIST_INTERVAL_S = 1.0  # on a miss, the tasks topics are listed again (a region's may be new) at most this often


class TaskBook:
    """group_id -> the claims of the task its curator signed, read from the tasks topics."""

    def __init__(self, kafka: Any, experiment: str, serde: Any = None, component: str = "curate") -> None:
        from astraflow.kafka.topics import Topics

        self.kafka, self.experiment, self.serde = kafka, experiment, serde
        self.topics = Topics(experiment)
        self.component = component
        self.claims: dict[str, TaskClaim] = {}
        self.readers: dict[str, Any] = {}  # tasks topic -> its CompactedReader
        self.lookups = 0  # `claim`s that had to read the topics again
        self._admin: Any = None
        self._listed_at = 0.0  # monotonic time the tasks topics were last listed (a region's may be new)
        self._follow_new_topics()
        for reader in self.readers.values():
            reader.catch_up(60.0)

    def _follow_new_topics(self) -> None:
        from astraflow.control import CompactedReader
        from astraflow.kafka.topics import TopicAdmin

        now = time.monotonic()
        if self.readers and now - self._listed_at < LIST_INTERVAL_S:
            return
        self._listed_at = now
        if self._admin is None:
            self._admin = TopicAdmin(self.kafka)
        base = self.topics.tasks
        for topic in [base, *sorted(self._admin.list(base + "."))]:
            if topic in self.readers:
                continue
            self.readers[topic] = CompactedReader(
                self.kafka, topic, serde=self.serde, expect=Task, on_record=self._on_task,
                signed=(self.experiment, "tasks"), component=f"{self.component}-tasks", keep=False)

    def _on_task(self, key: str, task: Task | None) -> None:
        if task is None or key != task.group_id:
            return  # a tombstone, or a task not keyed by its group (never the curator's)
        self.claims[task.group_id] = TaskClaim.of(task)

    def refresh(self) -> None:
        """Takes the tasks that arrived since (never blocks)."""
        for reader in self.readers.values():
            reader.refresh()

    def claim(self, group_id: str) -> TaskClaim | None:
        """The claims of `group_id`'s task; when not known yet, after reading every tasks topic
        (and any region's new one) to its end. None: no task the curator signed made this group."""
        found = self.claims.get(group_id)
        if found is None:  # mostly a task the readers already hold: `tick` takes them every 0.25 s
            self.refresh()
            found = self.claims.get(group_id)
        if found is None:
            self.lookups += 1
            self._follow_new_topics()
            for reader in self.readers.values():
                reader.catch_up(30.0)
            found = self.claims.get(group_id)
        return found

    @property
    def refused(self) -> int:
        """Tasks refused (unsigned, forged, replayed), each dead-lettered by its reader."""
        return sum(r.refused for r in self.readers.values())

    def close(self) -> None:
        for reader in self.readers.values():
            reader.close()
