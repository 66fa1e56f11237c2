"""Workflows and tools without a broker: tool calls run, their output is masked, failures are recorded.

The backend here is a scripted test double (it replays fixed completions through a real
tokenizer); the workflow, tool box, sandbox and trajectory building are the real code.
"""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest
from helpers import ScriptedBackend

from astraflow.raas.tools import LocalSearch, ToolBox, default_tools
from astraflow.raas.workflows import RolloutContext, resolve_workflow
from astraflow.records import NodeInfo, SamplingParams, TrajectoryStatus
from astraflow.testing import make_task


def _ctx(task, backends, tools=None) -> RolloutContext:
    return RolloutContext(task, 0, backends, ToolBox(tools if tools is not None else default_tools(), 5.0),
                          NodeInfo("n", "cpu", "local", "scripted"))


def test_tool_use_runs_the_calculator_and_masks_its_output(tiny_model_dir: Path) -> None:
    task = make_task(1)
    task.workflow, task.sampling = "tool_use", SamplingParams(max_tokens=16, max_turns=3)
    b = ScriptedBackend("policy", tiny_model_dir, ["<calc>37*12+5</calc>", "Answer: 449"])
    traj = asyncio.run(resolve_workflow("tool_use")(_ctx(task, {"policy": b})))
    assert traj.final_answer == "449" and traj.status is TrajectoryStatus.OK
    (call,) = traj.tool_calls
    assert (call.name, call.arguments, call.result, call.error) == ("calc", "37*12+5", "449", None)
    roles = [s.role for s in traj.segments]
    assert roles == ["prompt", "assistant", "tool", "assistant"]
    tool_seg = traj.segments[2]
    assert tool_seg.text == "<result>449</result>" and tool_seg.loss_mask.sum() == 0 and (tool_seg.versions == -1).all()
    assert all(s.loss_mask.all() and (s.versions == 3).all() for s in traj.segments if s.role == "assistant")
    # The second model call saw the tool's result in its context.
    assert b.decode(b.requests[1].prompt_ids).endswith("<result>449</result>")


def test_failing_and_unknown_tools_are_recorded_not_fatal(tiny_model_dir: Path) -> None:
    task = make_task(2)
    task.sampling = SamplingParams(max_tokens=16, max_turns=3)
    b = ScriptedBackend("policy", tiny_model_dir, ["<calc>1/0</calc>", "<search>x</search>", "Answer: 3"])
    traj = asyncio.run(resolve_workflow("tool_use")(_ctx(task, {"policy": b}, {"calc": default_tools()["calc"]})))
    assert traj.final_answer == "3"
    assert "CalculatorError" in traj.tool_calls[0].error
    assert traj.tool_calls[1].error.startswith("unknown tool 'search'")
    assert "error:" in traj.segments[2].text


def test_slow_tool_times_out(tiny_model_dir: Path) -> None:
    async def slow(_: str) -> str:
        await asyncio.sleep(5)
        return "late"

    call = asyncio.run(ToolBox({"slow": slow}, timeout_s=0.2).call("slow", "", 0))
    assert call.error == "tool slow timed out after 0s" and call.result == ""


def test_python_tool_runs_in_the_sandbox() -> None:
    tools = default_tools()
    call = asyncio.run(ToolBox(tools, 20).call("python", "print(sum(range(10)))", 0))
    assert call.error is None and call.result.strip() == "45"
    call = asyncio.run(ToolBox(tools, 20).call("python", "import os; print(os.environ.get('HOME_SECRET'))\nraise SystemExit(3)", 0))
    assert call.error is not None and "exit code 3" in call.error


def test_local_search_ranks_by_relevance() -> None:
    s = LocalSearch(["Kafka is a distributed log.", "Avro is a serialization format.", "Paris is in France."], k=1)
    assert s.search("what is avro serialization") == ["Avro is a serialization format."]
    assert asyncio.run(s("zzz")) == "no results"


def test_solver_verifier_takes_any_number_of_verifiers_each_in_its_own_sequence(tiny_model_dir: Path) -> None:
    from astraflow.dataflow.sequences import policy_sequences

    task = make_task(3)
    task.workflow, task.policies = "solver_verifier", ["solver", "v1", "v2"]
    task.prompt, task.sampling = "Q: What is 2*3?\nA:", SamplingParams(max_tokens=16, max_turns=2)
    solver = ScriptedBackend("solver", tiny_model_dir, ["<calc>2*3</calc>", "Answer: 6"], version=5)
    v1 = ScriptedBackend("v1", tiny_model_dir, ["<calc>2*3</calc>", "Answer: yes"], version=9)
    v2 = ScriptedBackend("v2", tiny_model_dir, ["Answer: perhaps"], version=2)
    traj = asyncio.run(resolve_workflow("solver_verifier")(_ctx(task, {"solver": solver, "v1": v1, "v2": v2})))
    assert traj.final_answer == "6"
    assert traj.metadata == {**task.metadata, "solver": "solver", "verdict.v1": "yes", "verdict.v2": "unclear"}
    assert v1.decode(v1.requests[0].prompt_ids).endswith("Q: What is 2*3?\nProposed: 6\nA:")
    assert "<result>6</result>" in v1.decode(v1.requests[1].prompt_ids)  # the verifier used the calculator
    assert "Proposed" not in solver.decode(solver.requests[1].prompt_ids)
    for policy, version in (("solver", 5), ("v1", 9), ("v2", 2)):
        [seq] = policy_sequences(traj, policy)
        assert seq[0].role == "prompt" and {int(v) for s in seq if s.loss_mask.any() for v in s.versions} == {version}
    assert [c.name for c in traj.tool_calls] == ["calc", "calc"]


def test_the_node_refuses_tasks_with_the_wrong_number_of_policies() -> None:
    from astraflow.config import RaasSettings
    from astraflow.raas.admission import InvalidTaskError, admit

    served = {"a", "b", "c"}
    for workflow, policies in (("solver_verifier", ["a"]), ("solver_verifier", ["a", "b", "b"]), ("tool_use", ["a", "b"]),
                               ("rlvr", ["a", "b"])):
        task = make_task(1)
        task.workflow, task.policies = workflow, policies
        with pytest.raises(InvalidTaskError, match="distinct policies"):
            admit(task, RaasSettings(), served)
    task = make_task(1)
    task.workflow, task.policies = "solver_verifier", ["a", "b", "c"]
    assert admit(task, RaasSettings(), served).task is task


def test_tool_latency_option_parses_and_wraps_the_named_tool() -> None:
    from astraflow.errors import ConfigError
    from astraflow.raas.tools import calculator, parse_tool_latency

    assert parse_tool_latency(["calc=0.2:1.5", "python=1:0"]) == {"calc": (0.2, 1.5), "python": (1.0, 0.0)}
    for bad in ("calc", "calc=0.2", "calc=x:1", "calc=0:1", "calc=0.2:-1", "=0.2:1"):
        with pytest.raises(ConfigError, match="NAME=MEDIAN_SECONDS:SIGMA"):
            parse_tool_latency([bad])
    tools = default_tools(latency={"calc": (0.01, 0.0)})
    assert tools["calc"] is not calculator and tools["python"] is default_tools()["python"]
    call = asyncio.run(ToolBox(tools, 5).call("calc", "2+3", 0))
    assert call.error is None and call.result == asyncio.run(calculator("2+3"))
    with pytest.raises(ConfigError, match="does not have; its tools are: calc, python"):
        default_tools(latency={"web": (0.2, 1.0)})
