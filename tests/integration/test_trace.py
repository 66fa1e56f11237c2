"""`astraflow trace` on a real broker: tasks and trajectories go through the real reward and curate
apps; the trace of a sample, a dropped group and a dead-lettered trajectory shows every hop, read
from the topics and from an archive of them, checked against what the test reads from the topics."""

from __future__ import annotations

import json
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
from typer.testing import CliRunner

from astraflow.config import KafkaSettings
from astraflow.kafka.clients import RecordProducer
from astraflow.kafka.topics import Topics
from astraflow.records import DeadLetter, Task, TrainSample, Trajectory
from astraflow.testing import make_trajectory, read_records, send_tasks
from stream_apps.engine import EngineSettings
from stream_apps.launch import AppOptions, build_worker
from trainers.publishing import trained_records

POLICY = "solver"


@pytest.fixture
def exp(make_experiment: Callable[..., str]) -> str:
    return make_experiment("trace", [POLICY])


def group(name: str, answers: list[str]) -> list[Trajectory]:
    out = []
    for i, answer in enumerate(answers):
        t = make_trajectory(96, task_id=name, sample_index=i, group_size=len(answers), policy=POLICY, seed=i, version=4)
        t.group_id, t.prompt_id, t.final_answer, t.reference = name, f"p-{name}", answer, '{"answer": "4"}'
        out.append(t)
    return out


def _trace(kafka: KafkaSettings, exp: str, ident: str, *extra: str) -> tuple[int, str]:
    from astraflow_cli.main import app

    res = CliRunner().invoke(app, ["--set", f"kafka.bootstrap_servers={kafka.bootstrap_servers}", "trace", ident,
                                   "-e", exp, *extra], env={"COLUMNS": "250"})
    return res.exit_code, res.output


def test_trace_follows_samples_drops_and_dead_letters_hop_by_hop(kafka: KafkaSettings, exp: str, tmp_path: Path) -> None:
    topics = Topics(exp)
    producer = RecordProducer(kafka)
    groups = {"ok": group("ok", ["4", "5", "4", "5"]), "flat": group("flat", ["5", "5", "5"]), "bad": group("bad", ["4"])}
    groups["bad"][0].reference = "this is not json"  # the reward dead-letters it
    send_tasks(kafka, exp, [Task(name, name, f"p-{name}", "synthetic", "tool_use", "Q: 2+2?", [POLICY], len(trajs))
                            for name, trajs in groups.items()])  # signed, as the curator signs them
    for trajs in groups.values():
        for t in trajs:
            producer.send(topics.rollouts, t, key=t.group_id)
    producer.flush()
    workers = [build_worker("reward", EngineSettings(exp, kafka, commit_interval_s=0.5)),
               build_worker("curate", EngineSettings(exp, kafka, commit_interval_s=0.5), AppOptions(policies=[POLICY]))]
    threads = [w.start_thread() for w in workers]
    try:
        samples = [s for s in read_records(kafka, [topics.train(POLICY)], lambda out: len(out) >= 4) if isinstance(s, TrainSample)]
        letters = [d for d in read_records(kafka, [topics.dlq], lambda out: len(out) >= 1, timeout_s=20) if isinstance(d, DeadLetter)]
        read_records(kafka, [topics.lineage], lambda out: len(out) >= 1, timeout_s=20)
    finally:
        for w in workers:
            w.stop()
        for th in threads:
            th.join(30)
    assert all(w.error is None for w in workers), [w.error for w in workers]
    assert len(samples) == 4 and len(letters) == 1
    # The trainer's lineage record of the version that first carries the samples (what
    # DurablePublication commits with the version; the trainer itself is tested in test_trainer_kafka).
    steps = {s.sample_id: 7 + i % 2 for i, s in enumerate(samples)}
    for rec in trained_records(POLICY, 4, 8, [[sid, step, 0, 0] for sid, step in steps.items()]):
        producer.send(topics.lineage, rec, key=POLICY)
    producer.flush()

    sample = next(s for s in samples if s.trajectory_id == "ok/0")
    code, out = _trace(kafka, exp, sample.sample_id, "--json")
    assert code == 0, out
    tr = json.loads(out)
    assert (tr["kind"], tr["group_id"]) == ("sample", "ok")
    stages = [h["stage"] for h in tr["hops"]]
    assert stages == ["curated", "rolled_out", "scored", "sample", "trained"], stages
    times = [h["at_ms"] for h in tr["hops"]]
    assert times == sorted(times)
    curated, rolled, scored, made, trained = (h["detail"] for h in tr["hops"])
    assert curated["prompt_id"] == "p-ok" and curated["workflow"] == "tool_use"
    t0 = groups["ok"][0]
    assert (rolled["node"], rolled["region"], rolled["backend"]) == (t0.node.node_id, t0.node.region, t0.node.backend)
    assert [t["versions"] for t in rolled["turns"]] == [[4], [4]] and rolled["turns"][0]["policy"] == POLICY
    assert rolled["tool_calls"] == [{"turn": 0, "name": "calculator", "latency_s": 0.01, "error": None}]
    [on_scored] = [t for t in read_records(kafka, [topics.scored], lambda out: len(out) >= 7) if t.trajectory_id == "ok/0"]
    assert scored["reward"] == on_scored.reward == 1.0 and scored["components"] == on_scored.reward_components
    assert scored["strategy"] == ["reward.reward=exact_match@v1"]
    assert made["advantage"] == pytest.approx(sample.advantage) and made["policy"] == POLICY
    assert any("advantage=grpo" in s for s in made["strategy"]) and any("filter.zero_variance" in s for s in made["strategy"])
    assert (trained["step"], trained["version"], trained["published_at_step"]) == (steps[sample.sample_id], 4, 8)

    code, out = _trace(kafka, exp, "flat", "--json")
    tr = json.loads(out)
    assert tr["kind"] == "group"
    assert [h["stage"] for h in tr["hops"]] == ["curated"] + ["rolled_out"] * 3 + ["scored"] * 3 + ["dropped"]
    dropped = tr["hops"][-1]["detail"]
    assert (dropped["filter"], dropped["strategy"], dropped["policy"]) == ("filter.zero_variance", "zero_variance", POLICY)
    assert sorted(dropped["trajectory_ids"]) == ["flat/0", "flat/1", "flat/2"] and dropped["reason"]

    code, out = _trace(kafka, exp, "bad/0")
    assert code == 0, out
    lines = out.splitlines()
    assert "trajectory bad/0 (group bad): 3 hops" in lines[0]
    assert [ln.split()[2] for ln in lines[1::2]] == ["curated", "rolled_out", "dead_lettered"]
    assert "RewardError" in lines[-1] and "exact_match" in lines[-1] and letters[0].error in lines[-1]

    code, out = _trace(kafka, exp, "no-such-id")
    assert code == 1 and "no task, group, trajectory or sample 'no-such-id'" in out

    # The same path from an archive of the experiment's topics.
    from stream_apps.archive import run as archive

    names = [topics.tasks, topics.rollouts, topics.scored, topics.train(POLICY), topics.lineage, topics.dlq]
    archive(kafka, names, str(tmp_path / "arch"), group=f"{exp}-arch", exit_when_idle_s=3)
    live = json.loads(_trace(kafka, exp, sample.sample_id, "--json")[1])
    code, out = _trace(kafka, exp, sample.sample_id, "--json", "--archive", str(tmp_path / "arch"))
    assert code == 0, out
    assert json.loads(out)["hops"] == live["hops"]


@pytest.fixture
def copied_exp(exp: str, kafka: KafkaSettings) -> Iterator[str]:
    """`exp`, and afterwards the topics a processor made in it deleted too."""
    from astraflow.kafka.topics import TopicAdmin

    yield exp
    admin = TopicAdmin(kafka)
    extra = [t for t in admin.list(f"af.{exp}.") if t.endswith(".copies")]
    if extra:
        admin.delete(extra)


def test_trace_follows_lineage_into_a_processor_output(kafka: KafkaSettings, copied_exp: str) -> None:
    import astraflow
    from stream_apps.launch import build_processor_worker

    exp = copied_exp
    topics = Topics(exp)

    @astraflow.processor(source="scored", sink="copies", name="copier", expect=Trajectory)
    def copier(t: Trajectory) -> Trajectory:
        return t

    producer = RecordProducer(kafka)
    trajs = group("cp", ["4", "5"])
    producer.send(topics.tasks, Task("cp", "cp", "p-cp", "synthetic", "tool_use", "Q: 2+2?", [POLICY], 2), key="cp")
    for t in trajs:
        t.reward = 1.0
        producer.send(topics.scored, t, key=t.group_id)
    producer.flush()
    worker = build_processor_worker(copier, EngineSettings(exp, kafka, commit_interval_s=0.5))
    thread = worker.start_thread()
    try:
        copies = read_records(kafka, [topics.stream("copies")], lambda out: len(out) >= 2, timeout_s=60)
    finally:
        worker.stop()
        thread.join(30)
    assert len(copies) == 2 and all(c.lineage[-1].app == "copier" for c in copies)

    code, out = _trace(kafka, exp, "cp/1", "--json")
    assert code == 0, out
    hops = json.loads(out)["hops"]
    assert [h["stage"] for h in hops] == ["curated", "scored", "processed"], hops
    assert hops[-1]["component"] == "copier" and hops[-1]["topic"] == topics.stream("copies")
    assert hops[-1]["detail"]["stream"] == "copies" and hops[-1]["detail"]["processor"] == "copier"
    code, out = _trace(kafka, exp, "cp/1")
    assert "by processor copier" in out and "into copies" in out

    code, out = _trace(kafka, exp, "no-such-id")  # where to find ids
    assert code == 1 and f"astraflow logs show -e {exp} -t {POLICY}.train" in out
    code, out = _trace(kafka, f"nosuch{exp[-6:]}", "cp/1")  # the experiment is what is missing, not the id
    assert code == 1 and f"no experiment 'nosuch{exp[-6:]}'" in out and "astraflow experiments list" in out
    assert "Error" not in out
