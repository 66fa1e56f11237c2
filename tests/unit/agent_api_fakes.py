"""Shared by the agent-API tests (test_agent_api_*.py): the scripted backend they use, a rollout
context with the endpoint, a JSON POST, and an example tool."""

from __future__ import annotations

import json
from pathlib import Path

import aiohttp
from helpers import ScriptedBackend

from astraflow.raas.agent_api import AgentEndpoint
from astraflow.raas.tools import ToolBox
from astraflow.raas.workflows import RolloutContext
from astraflow.records import NodeInfo, SamplingParams
from astraflow.testing import make_task


def char_backend(model_dir: Path, script: list[str], context_length: int | None = None) -> ScriptedBackend:
    """Replays `script`, each text as one token id per character (not how the tokenizer would split
    it) and the end-of-sequence token, logprobs -0.25, -0.26, ..., version 5."""
    return ScriptedBackend("policy", model_dir, script, version=5, context_length=context_length, per_char=True,
                           eos=True, first_logprob=-0.25, logprob_step=-0.01)


def rollout_ctx(backend: ScriptedBackend, endpoint: AgentEndpoint, max_turns: int = 8) -> RolloutContext:
    task = make_task(1)
    task.sampling = SamplingParams(max_tokens=64, max_turns=max_turns)
    return RolloutContext(task, 0, {"policy": backend}, ToolBox({}), NodeInfo("n", "cpu", "local", "scripted"),
                          agent_api=endpoint)


async def post_json(url: str, key: str | None, body: object, raw: bytes | None = None) -> tuple[int, dict]:
    headers = {"Authorization": f"Bearer {key}"} if key else {}
    async with aiohttp.ClientSession() as s, s.post(url, data=raw if raw is not None else json.dumps(body),
                                                    headers={**headers, "Content-Type": "application/json"}) as r:
        return r.status, await r.json(content_type=None)


SQL_TOOL = {"type": "function", "function": {"name": "sql", "parameters": {
    "type": "object", "properties": {"query": {"type": "string"}}}}}
