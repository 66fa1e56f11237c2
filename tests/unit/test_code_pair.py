"""The coder_tester workflow (scripted backends) and its reward (the real sandbox)."""

from __future__ import annotations

import asyncio
import json
from pathlib import Path

import pytest
from helpers import ScriptedBackend
from test_raas_workflows import _ctx

from astraflow.dataflow.registry import get
from astraflow.errors import RewardError
from astraflow.raas.workflows import resolve_workflow
from astraflow.raas.workflows.code_pair import parse_tests
from astraflow.records import Segment, Trajectory
from astraflow.testing import make_task, make_trajectory

REF = json.dumps({"tests": ["assert scale([1, 2]) == [6, 12]", "assert scale([]) == []"],
                  "solution": "def scale(xs):\n    return [x * 6 for x in xs]\n"})
RIGHT, WRONG = "def scale(xs):\n    return [6 * x for x in xs]\n", "def scale(xs):\n    return [5 * x for x in xs]\n"


def test_the_coder_codes_and_the_tester_writes_asserts_each_in_its_own_sequence(tiny_model_dir: Path) -> None:
    task = make_task(1)
    task.workflow, task.policies, task.prompt = "coder_tester", ["coder", "tester"], "Write scale(xs): every x times 6."
    coder = ScriptedBackend("coder", tiny_model_dir, [f"```python\n{RIGHT}```"])
    tester = ScriptedBackend("tester", tiny_model_dir, ["assert scale([2]) == [12]\nprint(1)\nassert scale([]) == []"])
    traj = asyncio.run(resolve_workflow("coder_tester")(_ctx(task, {"coder": coder, "tester": tester})))
    assert traj.final_answer == RIGHT and traj.metadata["coder"] == "coder"
    assert json.loads(traj.metadata["tests"]) == ["assert scale([2]) == [12]", "assert scale([]) == []"]
    assert "assert tests for: Write scale" in tester.decode(tester.requests[0].prompt_ids)
    assert [s.role for s in traj.segments if s.policy == "tester"] == ["prompt", "assistant"]
    assert parse_tests("\n".join(["assert x"] * 20)) == ["assert x"] * 8


def judged(code: str, tests: list[str], meta: dict[str, str] | None = None) -> Trajectory:
    t = make_trajectory(4)
    t.segments = [Segment.context("coder", "prompt", [1]), Segment.context("tester", "prompt", [2])]
    t.final_answer, t.reference = code, REF
    t.metadata = meta if meta is not None else {"coder": "coder", "tester": "tester", "tests": json.dumps(tests)}
    return t


def test_coder_tester_reward_runs_both_sides_in_the_sandbox() -> None:
    reward = get("reward", "coder_tester", timeout_s=10, cpu_s=2, memory_mb=256).impl
    tests = ["assert scale([1]) == [6]", "assert scale([1]) == [7]", "assert scale([0, 1]) == [0, 6]"]
    right = asyncio.run(reward.score_async(judged(RIGHT, tests)))
    assert right.reward == 1.0 and right.components["policy.coder"] == 1.0
    assert right.components["policy.tester"] == pytest.approx(2 / 3) and right.components["caught"] == 0.0  # one test is wrong
    wrong = asyncio.run(reward.score_async(judged(WRONG, tests)))
    assert wrong.components["policy.coder"] == 0.0 and wrong.components["caught"] == 1.0
    assert wrong.components["policy.tester"] == pytest.approx(2 / 3 + 0.5)  # its valid tests caught the bug
    missed = asyncio.run(reward.score_async(judged(WRONG, ["assert scale([]) == []"])))
    assert missed.components["policy.tester"] == 1.0 and missed.components["caught"] == 0.0
    silent = asyncio.run(reward.score_async(judged(RIGHT, [])))
    assert silent.components["policy.tester"] == 0.0 and silent.reward == 1.0


@pytest.mark.parametrize("meta", [{"coder": "coder", "tester": "coder", "tests": "[]"},
                                  {"coder": "ghost", "tester": "tester", "tests": "[]"},
                                  {"coder": "coder", "tester": "tester", "tests": "not json"},
                                  {"coder": "coder", "tester": "tester", "tests": json.dumps(["assert 1"] * 9)},
                                  {"coder": "coder", "tester": "tester", "tests": json.dumps([1])}])
def test_coder_tester_reward_refuses_metadata_the_workflow_cannot_write(meta: dict[str, str]) -> None:
    with pytest.raises(RewardError):
        get("reward", "coder_tester")(judged(RIGHT, [], meta))
