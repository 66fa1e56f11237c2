"""Built-in workflows: `rlvr` (single turn), `tool_use` (multi-turn with tools), `solver_verifier`.

They speak the plain-text protocol of `astraflow.models.protocol`: the prompt is the task text,
a tool call is `<NAME>ARGS</NAME>` for a tool the node offers (`calc`, `python`, `search`), the
tool's reply is appended as `<result>...</result>` (masked out of the loss), and the final answer
is the text after the last `Answer:`.
"""

from __future__ import annotations

import re

from astraflow.raas.workflows.base import RolloutContext
from astraflow.records import Trajectory, TrajectoryStatus

TOOL_CALL = re.compile(r"<(\w+)>(.*?)</\1>\s*$", re.S)
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
    policy = ctx.task.policies[0]
    ctx.add_context(policy, "prompt", ctx.task.prompt, add_bos=True)
    gen = await ctx.generate(policy)
    status = TrajectoryStatus.TRUNCATED if gen.finish_reason == "length" else TrajectoryStatus.OK
    return ctx.finish(extract_answer(gen.text) or gen.text.strip(), status)


async def tool_use(ctx: RolloutContext) -> Trajectory:
    """Multi-turn: the model may call tools; each result is appended (masked) and it continues."""
    policy = ctx.task.policies[0]
    ctx.add_context(policy, "prompt", ctx.task.prompt, add_bos=True)
    stops = [f"</{name}>" for name in ctx.tools.tools]
    text = ""
    status = TrajectoryStatus.OK
    for turn in range(max(1, ctx.task.sampling.max_turns)):
        gen = await ctx.generate(policy, stop=stops + list(ctx.task.sampling.stop))
        text += gen.text
        call = TOOL_CALL.search(gen.text)
        if call is None or gen.finish_reason == "length":
            status = TrajectoryStatus.TRUNCATED if gen.finish_reason == "length" else TrajectoryStatus.OK
            break
        record = await ctx.call_tool(call.group(1), call.group(2).strip(), turn)
        reply = f"<result>{record.result if record.error is None else 'error: ' + record.error}</result>"
        ctx.add_context(policy, "tool", reply)
        text += reply
    else:
        status = TrajectoryStatus.TRUNCATED  # used every turn without answering
    answer = extract_answer(text)
    return ctx.finish(answer, status if answer is not None or status is not TrajectoryStatus.OK else TrajectoryStatus.OK)


async def solver_verifier(ctx: RolloutContext) -> Trajectory:
    """Two policies: the solver answers, the verifier judges the answer ('yes'/'no').

    Both generations are trained segments of their own policy; the curate app routes each to its
    policy's train topic. The verdict is stored in metadata for a reward that scores the verifier.
    """
    solver, verifier = ctx.task.policies[0], ctx.task.policies[-1]
    ctx.add_context(solver, "prompt", ctx.task.prompt, add_bos=True)
    sol = await ctx.generate(solver)
    answer = extract_answer(sol.text) or sol.text.strip()
    question = f"{ctx.task.prompt}\nProposed: {answer}\nCorrect (yes/no)?"
    ids = ctx.backend(verifier).encode(question, add_bos=True)
    from astraflow.records import Segment

    ctx.segments.append(Segment.context(verifier, "user", ids, question))
    verdict = await ctx.generate(verifier, prompt_ids=ids, max_tokens=8)
    said = "yes" if "yes" in verdict.text.lower() else ("no" if "no" in verdict.text.lower() else "unclear")
    return ctx.finish(answer, metadata={"verifier_verdict": said})
