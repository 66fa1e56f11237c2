"""Attacks on GRPO groups, on the default local cluster: a group is its task's, not its members'.

The curator's tasks are signed (`astraflow.testing.send_tasks` signs them with the curator key,
as the curator does); honest trajectories are written as a node's would reach curate. An
outside client (`outsider.py`: plain fastavro and confluent-kafka) then writes to `scored`
trajectories that claim what their task does not say, and a task of its own. Each must be
dead-lettered naming the rule, the honest groups must complete and train every member exactly
once, and the curator's re-issue of a task (same ids again) must be counted as superseded, not
as an attack.
"""

from __future__ import annotations

import time

import pytest
from helpers import collect
from outsider import Outsider, defaults, encode, forged_signature

from astraflow.config import KafkaSettings
from astraflow.kafka.clients import RecordProducer
from astraflow.kafka.topics import Topics
from astraflow.records import DeadLetter, Task, TrainSample, Trajectory
from astraflow.testing import make_trajectory, send_tasks
from stream_apps.engine import EngineSettings
from stream_apps.launch import AppOptions, build_worker

pytestmark = [pytest.mark.security, pytest.mark.timeout(300)]

POLICY = "policy"
SIZE = 4


def _honest(group: str) -> list[Trajectory]:
    out = []
    for i in range(SIZE):
        t = make_trajectory(48, task_id=group, sample_index=i, group_size=SIZE, policy=POLICY, seed=i, version=0,
                            reward=float(i % 2))  # rewards 0,1,0,1: no zero-variance drop
        t.group_id, t.prompt_id = group, f"p-{group}"
        out.append(t)
    return out


def _task(group: str) -> Task:
    return Task(group, group, f"p-{group}", "synthetic", "tool_use", "Q: 2+2?", [POLICY], SIZE)


def _evil(t: Trajectory, **claims: object) -> bytes:
    """`t` as an outsider re-encodes it (plain fastavro), with the claims it makes up."""
    d = t.to_avro()
    d.update(claims)
    return encode("trajectory", d)


def test_hijacked_and_duplicated_group_members_are_refused_and_honest_groups_train(
        kafka: KafkaSettings, experiment: str) -> None:
    topics, out = Topics(experiment), Outsider(kafka.bootstrap_servers)
    groups = {g: _honest(g) for g in ("g-a", "g-b")}
    send_tasks(kafka, experiment, [_task(g) for g in groups])
    node = RecordProducer(kafka)
    victim = groups["g-a"]
    node.send(topics.scored, victim[0], key="g-a")  # the victim group holds one honest member
    node.flush()

    # 1. the hijack: one trajectory with the victim's group id and group_size=1 (it would complete the group alone)
    out.send(topics.scored, _evil(victim[1], trajectory_id="evil/0", task_id="evil", sample_index=0, group_size=1),
             "g-a")
    # ... and before any honest member of g-b arrived (the first member used to set the size)
    out.send(topics.scored, _evil(groups["g-b"][0], trajectory_id="evil/1", task_id="evil", group_size=1), "g-b")
    # 2. a second trajectory for (g-a, sample 0), which the honest member holds
    out.send(topics.scored, _evil(victim[0], trajectory_id="g-a/0-again"), "g-a")
    # 3. a sample index the task never asked for
    out.send(topics.scored, _evil(victim[1], trajectory_id="g-a/7", sample_index=7), "g-a")
    # 4. a task of its own (unsigned, and with a made-up signature), then a one-member group of it
    forged = encode("task", defaults("task", task_id="own", group_id="own", prompt_id="p", dataset="d", workflow="w",
                                     prompt="q", policies=[POLICY], n_samples=1, sampling={},
                                     created_at=int(time.time() * 1000)))
    out.send(topics.tasks, forged, "own")
    out.send(topics.tasks, forged, "own", forged_signature())
    out.send(topics.scored, _evil(victim[1], trajectory_id="own/0", task_id="own", group_id="own", prompt_id="p",
                                  sample_index=0, group_size=1), "own")
    attacks = 7  # five trajectories (1 twice, 2, 3, and 4's) and 4's two tasks

    for t in [*victim[1:], *groups["g-b"]]:  # the honest members go on arriving
        node.send(topics.scored, t, key=t.group_id)
    node.flush()
    send_tasks(kafka, experiment, [_task("g-b")])  # the curator re-issues g-b (a region went dark) ...
    node.send(topics.scored, groups["g-b"][2], key="g-b")  # ... and its late duplicate arrives: superseded
    node.flush()

    worker = build_worker("curate", EngineSettings(experiment, kafka, commit_interval_s=0.5), AppOptions(policies=[POLICY]))
    thread = worker.start_thread()
    try:
        samples = collect(kafka, topics.train(POLICY), TrainSample, lambda s: len(s) >= 2 * SIZE)
        letters = collect(kafka, topics.dlq, DeadLetter, lambda d: len(d) >= attacks)
        deadline = time.monotonic() + 30
        while worker.stats.dropped.get("superseded", 0) < 1 and time.monotonic() < deadline:
            time.sleep(0.2)
    finally:
        worker.stop()
        thread.join(30)
    assert worker.error is None, worker.error

    honest_ids = sorted(t.trajectory_id for g in groups.values() for t in g)
    assert sorted(s.trajectory_id for s in samples) == honest_ids  # every honest member trained, once; no other
    assert {s.group_id for s in samples} == {"g-a", "g-b"}
    refused = [d for d in letters if d.error_class == "GroupClaimError"]
    rules = sorted(d.error.split("]")[0].lstrip("[") for d in refused)
    assert rules == ["group.duplicate_sample", "group.no_task", "group.sample_index", "group.size", "group.size"], rules
    tasks_refused = [d for d in letters if d.topic == topics.tasks]
    assert len(letters) == attacks and len(tasks_refused) == 2 and all("signed" in d.error or "not in" in d.error for d in tasks_refused)
    assert worker.stats.dropped.get("superseded", 0) == 1  # the re-issue's duplicate: counted, not dead-lettered
    assert not [d for d in letters if d.error_class == "LateTrajectoryError"]
