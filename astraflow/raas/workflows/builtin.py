"""Built-in workflows: `rlvr` (single turn), `tool_use` (multi-turn with tools), `solver_verifier`
(one solver, any number of verifiers).

Prompts go through the model's chat template when it has one (`chat.Chat`: system prompt from
the task's metadata, tool calls in the model's format, sampled ids never re-tokenised); without
one they speak the plain-text protocol of `astraflow.models.protocol`: the prompt is the task
text, a tool call is `<NAME>ARGS</NAME>` for a tool the node offers (`calc`, `python`, `search`),
the tool's reply is appended as `<result>...</result>` (masked out of the loss). Either way the
final answer is the text after the last `Answer:`, else the whole completion (rlvr).
"""

from __future__ import annotations

import asyncio
import re

from astraflow.models.protocol import parse_verdict, verification_prompt
from astraflow.raas.workflows.base import RolloutContext
from astraflow.raas.workflows.chat import TEXT_TOOL_CALL, Chat
from astraflow.records import Trajectory, TrajectoryStatus

TOOL_CALL = TEXT_TOOL_CALL  # the plain-text call pattern (bench/vs_trl.py reads it here)
_ANSWER = re.compile(r"Answer:\s*(.+?)\s*$", re.S)


def extract_answer(text: str) -> str | None:
    """The text after the last 'Answer:' (first line only), or None."""
    idx = text.rfind("Answer:")
    if idx < 0:
        return None
    m = _ANSWER.match(text[idx:])
    return m.group(1).splitlines()[0].strip() if m else None


async def rlvr(ctx: RolloutContext) -> Trajectory:
    """Single turn: prompt -> completion; the reward app checks the answer against the reference."""
    chat = Chat(ctx, ctx.task.policies[0])
    chat.start(ctx.task.prompt)
    gen = await chat.generate()
    status = TrajectoryStatus.TRUNCATED if gen.finish_reason == "length" else TrajectoryStatus.OK
    return ctx.finish(extract_answer(gen.text) or gen.text.strip(), status)


async def tool_use(ctx: RolloutContext) -> Trajectory:
    """Multi-turn: the model may call tools; each result is appended (masked) and it continues."""
    answer, status = await solve_with_tools(ctx, ctx.task.policies[0], ctx.task.prompt)
    return ctx.finish(answer, status)


async def solve_with_tools(ctx: RolloutContext, policy: str, prompt: str) -> tuple[str | None, TrajectoryStatus]:
    """One sequence of `policy`: `prompt` (a new `prompt` segment), then turns of generation and
    tool calls until it answers; returns (its answer or None, how it ended). The answer is the text
    after the last `Answer:`; with a chat template, else the last turn's text."""
    chat = Chat(ctx, policy, tools=list(ctx.tools.tools))
    chat.start(prompt)
    text = ""
    status = TrajectoryStatus.OK
    for turn in range(max(1, ctx.task.sampling.max_turns)):
        gen = await chat.generate(stop=chat.stops + list(ctx.task.sampling.stop))
        text += gen.text
        call = chat.tool_call(gen.text)
        if call is None or gen.finish_reason == "length":
            status = TrajectoryStatus.TRUNCATED if gen.finish_reason == "length" else TrajectoryStatus.OK
            break
        record = await ctx.call_tool(call[0], call[1], turn)
        result = record.result if record.error is None else "error: " + record.error
        chat.add_tool_result(f"call-{turn}", result)
        text += f"<result>{result}</result>"
    else:
        status = TrajectoryStatus.TRUNCATED  # used every turn without answering
    answer = extract_answer(text)
    if answer is None and chat.templated and status is TrajectoryStatus.OK:
        answer = gen.text.strip() or None  # an instruct model answers in its last turn (\boxed{}, ...), not 'Answer:'
    return answer, status if answer is not None or status is not TrajectoryStatus.OK else TrajectoryStatus.OK


async def solver_verifier(ctx: RolloutContext) -> Trajectory:
    """The first policy solves (with the node's tools); every other policy verifies its answer.

    Any number of verifiers (a panel), each judging on its own and concurrently: it gets the
    question and the proposed answer as text in a sequence of its own, so every policy trains
    on exactly what it saw. Metadata: `solver` (its policy) and `verdict.<policy>` (`yes`, `no`
    or `unclear`) per verifier, which the `solver_verifier` reward scores.
    """
    solver, verifiers = ctx.task.policies[0], ctx.task.policies[1:]
    answer, status = await solve_with_tools(ctx, solver, ctx.task.prompt)
    proposed = answer if answer is not None else ""
    question = verification_prompt(ctx.task.prompt, proposed)
    verdicts = await asyncio.gather(*(solve_with_tools(ctx, v, question) for v in verifiers))
    metadata = {"solver": solver, **{f"verdict.{v}": parse_verdict(f"Answer: {a}" if a is not None else None)
                                     for v, (a, _) in zip(verifiers, verdicts, strict=True)}}
    return ctx.finish(answer, status, metadata=metadata)


# How many policies each built-in takes (min, max; None: any number); the node refuses other tasks.
POLICY_COUNTS = {"rlvr": (1, 1), "tool_use": (1, 1), "solver_verifier": (2, None)}
