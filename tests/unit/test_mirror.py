"""MirrorMaker 2's configuration (astraflow.kafka.mirror) and the curator's task split between regions."""

from __future__ import annotations

import re
import time

import pytest

from astraflow.errors import ConfigError, LocalKafkaError
from astraflow.kafka.mirror import IDENTITY, MirrorPlan, loop_free, mirror_properties, render
from astraflow.kafka.topics import Topics
from stream_apps.curator import CuratorOptions
from stream_apps.region_fleet import RegionFleet


def plan(**kw) -> MirrorPlan:
    return MirrorPlan("exp-1", "b", "127.0.0.1:19092", "127.0.0.1:29140", **kw)


def mirrored(props: dict[str, str], flow: str, name: str) -> bool:
    return any(re.fullmatch(p.strip(), name) for p in props[f"{flow}.topics"].split(","))


def test_each_flow_mirrors_exactly_its_topics_and_none_loops() -> None:
    t, props = Topics("exp-1"), mirror_properties(plan())
    out, back = "a-exp-1->b-exp-1", "b-exp-1->a-exp-1"
    assert props["clusters"] == "a-exp-1, b-exp-1" and props[f"{out}.enabled"] == props[f"{back}.enabled"] == "true"
    for name in (t.tasks_of("b"), t.policies, t.weights("policy"), t.weights("critic-2")):
        assert mirrored(props, out, name) and not mirrored(props, back, name), name
    # snapshot_requests: a follower in B asks A's trainer for a snapshot; A's commands never go to B
    for name in (t.rollouts, t.metrics, t.dlq, t.snapshot_requests):
        assert mirrored(props, back, name) and not mirrored(props, out, name), name
    # Region A's own tasks, training data and every other experiment stay where they are.
    for name in (t.tasks, t.tasks_of("c"), t.scored, t.train("policy"), t.feedback, "af.exp-10.rollouts",
                 "af.exp-1x.tasks.b", "af.exp.1.rollouts", Topics("exp-2").weights("policy")):
        assert not mirrored(props, out, name) and not mirrored(props, back, name), name
    assert props["replication.policy.class"] == IDENTITY  # same names: no record may loop
    assert loop_free(plan(), [t.tasks_of("b"), t.rollouts, t.weights("p"), t.metrics]) == []


def test_local_settings_replication_factor_one_and_committed_reads() -> None:
    props = mirror_properties(plan(exactly_once=False))
    for key in ("replication.factor", "offset-syncs.topic.replication.factor", "checkpoints.topic.replication.factor",
                "heartbeats.topic.replication.factor", "config.storage.replication.factor",
                "offset.storage.replication.factor", "status.storage.replication.factor"):
        assert props[key] == "1", key
    assert props["a-exp-1.consumer.isolation.level"] == "read_committed"  # aborted weight chunks never cross
    assert int(props["b-exp-1.producer.max.request.size"]) >= 16 * 1024 * 1024
    assert "exactly.once.source.support" not in " ".join(mirror_properties(plan(exactly_once=False)))
    eos = mirror_properties(plan())  # the default
    assert eos["a-exp-1.exactly.once.source.support"] == eos["b-exp-1.exactly.once.source.support"] == "enabled"
    assert eos["dedicated.mode.enable.internal.rest"] == "true"


def test_rendered_properties_keep_regex_backslashes() -> None:
    """Java's .properties reader drops a lone backslash: `af\\.x` must be written `af\\\\.x`."""
    text = render(mirror_properties(plan()))
    line = next(x for x in text.splitlines() if x.startswith("b-exp-1->a-exp-1.topics"))
    assert r"af\\.exp\-1\\.rollouts" in line or r"af\\.exp\\-1\\.rollouts" in line
    assert "\\." not in line.replace("\\\\", "")


def test_a_region_named_like_the_source_is_refused() -> None:
    with pytest.raises(LocalKafkaError):
        MirrorPlan("e", "a", "x", "y")
    with pytest.raises(ConfigError):
        MirrorPlan("e", "b.c", "x", "y")


def test_region_shares_are_checked(tmp_path) -> None:
    from stream_apps.curator import CuratorApp

    data = tmp_path / "d.jsonl"
    data.write_text('{"prompt": "1+1", "reference": "2"}\n')
    for bad in ({"b": 0.0}, {"b": 1.0}, {"b": 0.6, "c": 0.5}):
        with pytest.raises(ConfigError, match="region-share"):
            CuratorApp(CuratorOptions([data], ["policy"], region_share=bad))
    CuratorApp(CuratorOptions([data], ["policy"], region_share={"b": 0.4}))


def test_curator_sends_region_b_its_share_on_its_own_topic(tmp_path) -> None:
    from stream_fakes import EXP, curator_on_fake_worker, tick

    from astraflow.ops.provenance import Provenance

    data = tmp_path / "d.jsonl"
    data.write_text("".join(f'{{"prompt": "q{i}", "answer": "{i}"}}\n' for i in range(5)))
    app, w = curator_on_fake_worker(CuratorOptions([data], ["solver"], n_samples=2, max_ahead=10, trainer_group="none",
                                                   region_share={"b": 0.4}))
    t = Topics(EXP)
    app.task_shares, app.issued_to = {t.tasks: 0.6, t.tasks_of("b"): 0.4}, {t.tasks: 0, t.tasks_of("b"): 0}  # as bind sets them
    app.fleet = RegionFleet({"": t.tasks, "b": t.tasks_of("b")}, app.task_shares, 2, 15.0, time.monotonic(),
                            window=app.options.max_ahead)
    app._provenance = Provenance(EXP)
    tick(app, 0.0)  # no node heard from yet: the configured shares  # the curator's tick may measure first (an awaitable), then issue
    topics = [topic for topic, _, _ in w.sent]
    assert len(topics) == 10 and topics.count(t.tasks_of("b")) == 4 and topics.count(t.tasks) == 6
    ids = [task.task_id for _, task, _ in w.sent]
    assert len(set(ids)) == 10  # each task goes to one region's topic only
    assert app.issued == 10 and app.issued_to == {t.tasks: 6, t.tasks_of("b"): 4}
