"""Workflows of the AgentBench-style environments: an OpenAI-API agent against the rollout's endpoint.

Each workflow builds its environment from the task's reference (`astraflow.envs`), opens the
rollout's OpenAI-compatible endpoint, and runs the plain-HTTP agent (`astraflow.agents.openai_http`)
with the environment's tool; every model call the agent makes is recorded in the trajectory by
the endpoint, every tool call mapped from its OpenAI form. The final answer is the text after
the last `Answer:` of the agent's last message (or that message).

- `db_agent`: tool `sql` over the rollout's own guarded SQLite database; reward `sql_result`.
- `os_agent`: tool `bash` in the sandboxed shell; when the agent stops, the task's check script
  runs on the final files and writes `metadata.os_check` (`pass` | `fail`); reward `os_check`.
- `code_agent`: tool `python` (the sandbox); the answer is the code; reward `code_tests`.
"""

from __future__ import annotations

import asyncio
import json
from typing import Any

from astraflow.agents.openai_http import AgentRun, AgentTool, run_agent
from astraflow.envs.database import GuardedDb, parse_spec, schema_text
from astraflow.envs.shell import ShellState, run_check, run_command
from astraflow.raas.workflows.base import RolloutContext
from astraflow.raas.workflows.builtin import extract_answer
from astraflow.records import Trajectory, TrajectoryStatus

SYSTEM = "Use the tool when you need it. End with 'Answer: ' and the answer."
CODE_SYSTEM = "Answer with the code of the function in a ```python block."


def _reference(ctx: RolloutContext) -> dict[str, Any]:
    try:
        ref = json.loads(ctx.task.reference or "")
    except json.JSONDecodeError as exc:
        raise ValueError(f"task {ctx.task.task_id}: reference is not JSON ({exc}); the environment needs it") from None
    if not isinstance(ref, dict):
        raise ValueError(f"task {ctx.task.task_id}: reference must be a JSON object")
    return ref


async def _episode(ctx: RolloutContext, user: str, tool: AgentTool) -> tuple[AgentRun, str]:
    async with ctx.openai_endpoint() as access:
        run = await run_agent(access.base_url, access.api_key, access.model, user, [tool], system=SYSTEM,
                              max_turns=ctx.task.sampling.max_turns)
    return run, extract_answer(run.final) or run.final.strip()


def _status(run: AgentRun) -> TrajectoryStatus:
    return TrajectoryStatus.TRUNCATED if run.error else TrajectoryStatus.OK


async def db_agent(ctx: RolloutContext) -> Trajectory:
    """SQL over the rollout's own database (see the module doc)."""
    tables = parse_spec(_reference(ctx).get("db"))
    db = await asyncio.to_thread(GuardedDb, tables)
    try:
        tool = AgentTool("sql", "Run one SQLite statement on the database; returns the rows.", "query",
                         lambda q: asyncio.to_thread(db.run_text, q))
        user = f"{ctx.task.prompt}\nTables:\n{schema_text(tables)}"
        run, answer = await _episode(ctx, user, tool)
    finally:
        db.close()
    return ctx.finish(answer, _status(run), metadata={"agent_turns": str(run.turns)})


async def os_agent(ctx: RolloutContext) -> Trajectory:
    """A shell task in the sandbox, checked by the task's script (see the module doc)."""
    ref = _reference(ctx)
    check = ref.get("check")
    if not isinstance(check, str) or not check.strip() or len(check) > 10_000:
        raise ValueError(f"task {ctx.task.task_id}: reference needs 'check', a shell script of at most 10000 characters")
    state = [ShellState.from_reference(ref)]

    async def bash(command: str) -> str:
        out, state[0] = await run_command(state[0], command)
        return out

    tool = AgentTool("bash", "Run one shell command in your working directory; returns its output.", "command", bash)
    run, answer = await _episode(ctx, ctx.task.prompt, tool)
    passed, output = await run_check(state[0], check, answer)
    return ctx.finish(answer, _status(run), metadata={"os_check": "pass" if passed else "fail",
                                                      "os_check_output": output, "agent_turns": str(run.turns)})


async def code_agent(ctx: RolloutContext) -> Trajectory:
    """Write a function; the `code_tests` reward runs the hidden tests on the answer."""
    from astraflow.raas.tools import python_exec

    tool = AgentTool("python", "Run Python code in a sandbox; returns what it prints.", "code", python_exec)
    async with ctx.openai_endpoint() as access:
        run = await run_agent(access.base_url, access.api_key, access.model, ctx.task.prompt, [tool],
                              system=CODE_SYSTEM,
                              max_turns=ctx.task.sampling.max_turns)
    return ctx.finish(run.final, _status(run), metadata={"agent_turns": str(run.turns)})


ENV_WORKFLOWS = {"db_agent": db_agent, "os_agent": os_agent, "code_agent": code_agent}

__all__ = ["ENV_WORKFLOWS", "code_agent", "db_agent", "os_agent"]
