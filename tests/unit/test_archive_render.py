"""`logs show` rendering: what a person reads, and the JSON machines read."""

from __future__ import annotations

import json

import numpy as np
from rich.console import Console

from astraflow.archive.format import ArchivedRecord
from astraflow.archive.render import matches_id, record_json, render_record
from astraflow.records import StrategyRef, TrainSample
from astraflow.serde import AvroSerde
from astraflow.testing import make_trajectory


def _text(renderable: object) -> str:
    console = Console(width=160, record=True, color_system=None)
    console.print(renderable)
    return console.export_text()


def _archived(value: bytes | None, key: bytes | None = b"g-task-0") -> ArchivedRecord:
    return ArchivedRecord("af.e.rollouts", 1, 7, 1_700_000_000_000, value, key, [("trace", b"abc")])


def test_trajectory_reads_like_a_conversation() -> None:
    t = make_trajectory(96, reward=0.75, version=3)
    t.segments[1].text = "Let me call [calculator] for 2+2"
    t.reward_components = {"exact_match": 1.0, "format": 0.5}
    t.lineage = [StrategyRef("reward", "score", "exact", 2)]
    serde = AvroSerde()
    rec = _archived(serde.dumps(t))
    name, datum = serde.decode(rec.value)
    out = _text(render_record(rec, name, datum))
    for expected in (
        "trajectory task-0/0", "af.e.rollouts p1 @7", "workflow tool_use", "sample 1/4",
        "reward 0.75 (exact_match 1, format 0.5)", "node node-0", "cpu:2", "backend torch",
        "generate 0.80 s", "versions policy v3", "lineage reward/score=exact v2",
        "[prompt]", "Q: 2+2?", "[assistant]", "turn 0", "mean logprob",
        "Let me call [calculator] for 2+2",  # model text is never read as markup
        'calculator({"expr": "2+2"}) → 4', "[tool]", "<result>4</result>", "turn 1",
    ):
        assert expected in out, expected
    # The tool call prints right after the turn that made it, before the tool segment.
    assert out.index("turn 0") < out.index("calculator(") < out.index("[tool]") < out.index("turn 1")


def test_json_has_coordinates_and_arrays_as_lists() -> None:
    t = make_trajectory(40, reward=1.0)
    serde = AvroSerde()
    rec = _archived(serde.dumps(t))
    name, datum = serde.decode(rec.value)
    d = json.loads(json.dumps(record_json(rec, name, datum)))
    assert d["_topic"] == "af.e.rollouts" and d["_partition"] == 1 and d["_offset"] == 7
    assert d["_key"] == "g-task-0" and d["_schema"] == "astraflow.Trajectory" and d["_headers"] == {"trace": "abc"}
    assert d["segments"][1]["token_ids"] == t.segments[1].token_ids.tolist()
    assert np.allclose(d["segments"][1]["logprobs"], t.segments[1].logprobs)
    assert d["reward"] == 1.0 and d["tool_calls"][0]["name"] == "calculator"


def test_train_sample_and_undecodable_records_render() -> None:
    s = TrainSample("s-1", "task-0/0", "g-0", "p-0", "policy", np.arange(8, dtype=np.int32),
                    np.array([0, 0, 1, 1, 1, 1, 0, 0], np.uint8), np.full(8, -0.5, np.float32),
                    np.array([-1, -1, 4, 4, 5, 5, -1, -1], np.int32), 0.25, 1.0, 4)
    serde = AvroSerde()
    rec = _archived(serde.dumps(s))
    out = _text(render_record(rec, *serde.decode(rec.value)))
    assert "train sample s-1" in out and "advantage 0.25" in out and "trained 4" in out and "v4–v5" in out
    bad = _text(render_record(_archived(b"nonsense"), None, None, "bad header"))
    assert "cannot decode 8 bytes: bad header" in bad
    assert record_json(_archived(b"xy"), None, None, "bad")["_error"] == "bad"


def test_matches_id_by_any_id_or_key() -> None:
    serde = AvroSerde()
    rec = _archived(serde.dumps(make_trajectory(32)))
    _, datum = serde.decode(rec.value)
    assert matches_id(rec, datum, "task-0/0") and matches_id(rec, datum, "task-0") and matches_id(rec, datum, "g-task-0")
    assert not matches_id(rec, datum, "task-1")
