"""Several policies: curate (per-policy samples, sequences, slots) and the curator (per-policy throttling); no broker."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
from stream_fakes import FakeWorker, curator_on_fake_worker, feed, gen_segment, make_curate, tick

from astraflow.errors import ConfigError
from astraflow.records import PromptStats, Segment, Trajectory
from astraflow.testing import make_trajectory
from stream_apps.curator import CuratorApp, CuratorOptions


def traj(group: str, i: int, reward: float, segments: list[Segment], components: dict[str, float] | None = None) -> Trajectory:
    t = make_trajectory(8, task_id=group, sample_index=i, group_size=2)
    t.segments, t.reward, t.group_id, t.prompt_id = segments, reward, group, f"prompt-{group}"
    t.reward_components = dict(components or {})
    return t


def test_every_sequence_of_a_trajectory_gets_its_trajectory_advantage_counted_once() -> None:
    app, w = make_curate(policies=("a", "b", "c"))
    rewritten = [Segment.context("a", "prompt", [1]), gen_segment("a", [2], 1), Segment.context("a", "prompt", [3]), gen_segment("a", [4], 1),
                 Segment.context("a", "prompt", [5]), gen_segment("a", [6], 1)]
    plain = [Segment.context("a", "prompt", [1]), gen_segment("a", [7], 1)]
    judges = [Segment.context("b", "prompt", [9]), gen_segment("b", [1], 1), Segment.context("c", "prompt", [9]), gen_segment("c", [0], 1)]
    feed(app, [traj("g", 0, 1.0, rewritten + judges, {"policy.b": 1.0, "policy.c": 0.0}),
               traj("g", 1, 0.0, plain + judges, {"policy.b": 0.0, "policy.c": 1.0})])
    sent = {s.sample_id: s for _, s, _ in w.sent}
    assert sorted(sent) == ["g/0#a", "g/0#a#1", "g/0#a#2", "g/0#b", "g/0#c", "g/1#a", "g/1#b", "g/1#c"]
    # a: rewards 1, 0 per trajectory (not 1, 1, 1, 0 per sequence) -> +1 and -1
    assert [sent[k].advantage for k in ("g/0#a", "g/0#a#1", "g/0#a#2", "g/1#a")] == pytest.approx([1, 1, 1, -1], abs=1e-5)
    assert [sent[k].token_ids.tolist() for k in ("g/0#a", "g/0#a#1", "g/0#a#2")] == [[1, 2], [3, 4], [5, 6]]
    assert (sent["g/0#b"].advantage, sent["g/0#c"].advantage) == pytest.approx((1, -1), abs=1e-5)  # own rewards
    assert {topic for topic, _, _ in w.sent} == {app.worker.topics.train(p) for p in "abc"}
    assert {k for _, _, k in w.side} == {"a/prompt-g", "b/prompt-g", "c/prompt-g"}


def test_a_malformed_sequence_dead_letters_its_group_only() -> None:
    app, w = make_curate(policies=("a",))
    bad = Segment("a", "assistant", np.array([1, 2], np.int32), np.zeros(1, np.float32), np.ones(2, np.uint8), np.zeros(2, np.int32))
    feed(app, [traj("bad", 0, 1.0, [bad]), traj("bad", 1, 0.0, [gen_segment("a", [3], 1)])])
    feed(app, [traj("ok", i, float(i), [gen_segment("a", [3], 1)]) for i in range(2)])
    assert len(w.dead) == 2 and all("unequal lengths" in err for _, err, _ in w.dead)
    assert sorted(s.sample_id for _, s, _ in w.sent) == ["ok/0#a", "ok/1#a"]


def test_a_policy_can_have_its_own_staleness_limit_and_advantage() -> None:
    app, w = make_curate(policies=("a", "b", "c"), versions={"a": 10, "b": 10, "c": 10})
    w.control.set("curate", "filter.staleness@b", "staleness", max_staleness="1")
    w.control.set("curate", "advantage@c", "dr_grpo")
    judges = [[Segment.context(p, "prompt", [9]), gen_segment(p, [1], 7)] for p in "bc"]  # 3 versions behind
    feed(app, [traj("g", i, float(i), [gen_segment("a", [2], 7), *judges[0], *judges[1]]) for i in range(2)])
    sent = {s.sample_id: s for _, s, _ in w.sent}
    assert sorted(sent) == ["g/0#a", "g/0#c", "g/1#a", "g/1#c"] and w.dropped["staleness"] == 2  # b's limit only
    assert sent["g/1#a"].advantage == pytest.approx(1, abs=1e-5) and sent["g/1#c"].advantage == pytest.approx(0.5)
    assert sent["g/1#c"].lineage[-1].slot == "advantage@c" and sent["g/1#a"].lineage[-1].slot == "advantage"
    assert not any(r.slot.startswith("filter.staleness@") for r in sent["g/1#a"].lineage)  # not an extra filter


def make_curator(tmp_path: Path, policies: list[str], throttle: tuple[str, ...] = (), max_ahead: int = 2) -> tuple[CuratorApp, FakeWorker]:
    data = tmp_path / "d.jsonl"
    data.write_text("".join(f'{{"prompt": "q{i}", "answer": "{i}"}}\n' for i in range(6)))
    return curator_on_fake_worker(CuratorOptions([data], policies, n_samples=2, max_ahead=max_ahead, throttle=throttle,
                                                 trainer_group="none"))


def stats(policy: str, prompt: str, groups: int) -> PromptStats:
    return PromptStats(prompt, "d", policy, groups, 2 * groups, 1, 1, 1, 0, 4, 0, 0)


def test_the_curator_waits_for_the_slowest_of_its_policies(tmp_path: Path) -> None:
    app, w = make_curator(tmp_path, ["a", "b", "c"])
    tick(app, 0.0)
    assert len(w.sent) == 2 and w.sent[0][1].policies == ["a", "b", "c"]
    first = w.sent[0][1].prompt_id
    for p in ("a", "b"):
        app._on_feedback(f"{p}/{first}", stats(p, first, 1))
    tick(app, 1.0)
    assert len(w.sent) == 2 and app.ahead_by() == {"a": 1, "b": 1, "c": 2}  # c's group is not curated yet
    app._on_feedback(f"c/{first}", stats("c", first, 1))
    tick(app, 2.0)
    assert len(w.sent) == 3 and app.curated == 1
    app.measure_backlog = lambda policy, ends=True: 4 if policy == "b" else 0  # b's trainer has 2 groups of samples to go
    tick(app, 3.0)
    assert len(w.sent) == 3 and app.ahead == 4
    assert app.gauges()["tasks_ahead.b"] == 4 and app.gauges()["train_backlog.b"] == 4


def test_throttling_on_some_policies_only(tmp_path: Path) -> None:
    app, w = make_curator(tmp_path, ["a", "b"], throttle=("a",))
    tick(app, 0.0)
    for _, task, _ in w.sent:
        app._on_feedback(f"a/{task.prompt_id}", stats("a", task.prompt_id, 1))  # b never reports: not throttled
    tick(app, 1.0)
    assert len(w.sent) == 4
    with pytest.raises(ConfigError, match="not among the tasks' policies"):
        make_curator(tmp_path, ["a", "b"], throttle=("z",))
    with pytest.raises(ConfigError, match="each trainer's group"):
        CuratorApp(CuratorOptions([tmp_path / "d.jsonl"], ["a", "b"], trainer_group="mine"))


def judged(answer: str | None, verdicts: dict[str, str], solver: str = "s") -> Trajectory:
    segs = [Segment.context(solver, "prompt", [1]), gen_segment(solver, [2], 1)]
    for p in verdicts:
        segs += [Segment.context(p, "prompt", [3]), gen_segment(p, [4], 1)]
    t = traj("g", 0, 0.0, segs)
    t.reward, t.final_answer, t.reference = None, answer, '{"answer": "6"}'
    t.metadata = {"solver": solver, **{f"verdict.{p}": v for p, v in verdicts.items()}}
    return t


def test_solver_verifier_reward_gives_each_policy_its_own() -> None:
    from astraflow.dataflow.registry import get

    reward = get("reward", "solver_verifier", bonus=0.5)
    right = reward(judged("6", {"v1": "yes", "v2": "no", "v3": "unclear"}))
    assert right.reward == pytest.approx(1 + 0.5 / 3) and right.components["policy.s"] == right.reward
    assert [right.components[f"policy.v{i}"] for i in (1, 2, 3)] == [1.0, 0.0, 0.0]
    wrong = reward(judged("7", {"v1": "yes", "v2": "no"}))
    assert wrong.reward == 0.0 and [wrong.components[f"policy.v{i}"] for i in (1, 2)] == [0.0, 1.0]
    assert reward(judged(None, {"v1": "no"})).components == {"correct": 0.0, "accepted": 0.0, "policy.s": 0.0,
                                                              "policy.v1": 1.0, "verifier_accuracy": 1.0}


@pytest.mark.parametrize("meta", [{"solver": "nobody", "verdict.v": "yes"}, {"verdict.v": "yes"},
                                  {"solver": "s", "verdict.v": "maybe"}, {"solver": "s", "verdict.ghost": "yes"},
                                  {"solver": "s", "verdict.s": "yes"}])
def test_solver_verifier_reward_refuses_metadata_the_workflow_cannot_write(meta: dict[str, str]) -> None:
    from astraflow.dataflow.registry import get
    from astraflow.errors import RewardError

    t = judged("6", {"v": "yes"})
    t.metadata = meta
    with pytest.raises(RewardError):
        get("reward", "solver_verifier")(t)
