"""astraflow.ops.trace reads the tasks of every region: a task the curator gave region B
(`--region-share`, on `af.EXP.tasks.b`) is traced like one of region A."""

from __future__ import annotations

from astraflow.archive.format import ArchivedRecord
from astraflow.kafka.topics import Topics
from astraflow.ops.trace import trace
from astraflow.records import Task
from astraflow.serde import AvroSerde
from astraflow.testing import make_trajectory

EXP = "tr"


def _source():
    t, serde = Topics(EXP), AvroSerde()
    task_b = Task("gb", "gb", "p-b", "synthetic", "rlvr", "Q: 2+2?", ["solver"], 1)
    task_a = Task("ga", "ga", "p-a", "synthetic", "rlvr", "Q: 3+3?", ["solver"], 1)
    traj = make_trajectory(16, task_id="gb", sample_index=0, group_size=1, policy="solver", seed=0, version=3)
    traj.group_id = "gb"
    records = {
        t.tasks: [ArchivedRecord(t.tasks, 0, 0, 1000, serde.dumps(task_a), b"ga")],
        t.tasks_of("b"): [ArchivedRecord(t.tasks_of("b"), 0, 0, 1001, serde.dumps(task_b), b"gb")],
        t.rollouts: [ArchivedRecord(t.rollouts, 0, 0, 1500, serde.dumps(traj), b"gb")],
    }
    return records


def test_a_task_of_region_b_is_traced_from_its_own_topic():
    records = _source()
    result = trace(EXP, "gb", lambda topic: records.get(topic, []), list(records))
    assert result.kind in ("group", "task") and result.group_id == "gb"
    assert [(h.stage, h.topic) for h in result.hops] == [("curated", Topics(EXP).tasks_of("b")),
                                                        ("rolled_out", Topics(EXP).rollouts)]


def test_a_task_of_region_a_is_still_found():
    records = _source()
    result = trace(EXP, "ga", lambda topic: records.get(topic, []), list(records))
    assert [h.topic for h in result.hops] == [Topics(EXP).tasks]
