"""`coder_tester`: one policy writes a function, another writes test cases for it.

Both read the task's specification (the prompt of a `code` dataset row) in sequences of their
own: the coder `Q: <spec>\\nA:` and answers with the function (a fenced block or bare code);
the tester `Q: Write assert tests for: <spec>\\nA:` and answers with `assert ...` lines. The
trajectory's `final_answer` is the coder's code; metadata `coder`, `tester` and `tests` (the
tester's asserts, JSON, at most `MAX_TESTS` of at most `MAX_TEST_CHARS` characters each). The
`coder_tester` reward runs them in the sandbox (`astraflow.dataflow.code_pair_reward`).
"""

from __future__ import annotations

import asyncio
import json

from astraflow.raas.workflows.base import RolloutContext
from astraflow.raas.workflows.chat import Chat
from astraflow.records import Trajectory, TrajectoryStatus

MAX_TESTS = 8
MAX_TEST_CHARS = 300


def tester_prompt(spec: str) -> str:
    return f"Q: Write assert tests for: {spec.strip()}\nA:"


def coder_prompt(spec: str) -> str:
    return f"Q: {spec.strip()}\nA:"


def parse_tests(text: str) -> list[str]:
    """The `assert` lines of a tester's answer (first `MAX_TESTS`, each cut at `MAX_TEST_CHARS`)."""
    lines = [line.strip() for line in text.splitlines()]
    return [line[:MAX_TEST_CHARS] for line in lines if line.startswith("assert ")][:MAX_TESTS]


async def coder_tester(ctx: RolloutContext) -> Trajectory:
    """The first policy codes, the second writes tests, concurrently (see the module doc)."""
    from astraflow.dataflow.code_reward import extract_code

    coder, tester = ctx.task.policies[0], ctx.task.policies[1]

    async def turn(policy: str, prompt: str) -> tuple[str, str]:
        chat = Chat(ctx, policy)
        chat.start(prompt)
        gen = await chat.generate()
        return gen.text, gen.finish_reason

    (code, code_end), (tests, _) = await asyncio.gather(turn(coder, coder_prompt(ctx.task.prompt)),
                                                        turn(tester, tester_prompt(ctx.task.prompt)))
    status = TrajectoryStatus.TRUNCATED if code_end == "length" else TrajectoryStatus.OK
    metadata = {"coder": coder, "tester": tester, "tests": json.dumps(parse_tests(tests))}
    return ctx.finish(extract_code(code), status, metadata=metadata)
