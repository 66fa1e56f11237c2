"""A minimal tool-using agent that knows only the OpenAI chat API over plain HTTP.

It is what an agent framework does, without the framework: send the conversation and the tool
definitions to `/v1/chat/completions`, run the tool calls that come back, append their results
as `tool` messages, and repeat until the model answers without a call (or `max_turns`). It runs
against any OpenAI-compatible server; the environments' workflows run it against their
rollout's endpoint, where every call is recorded in the trajectory.
"""

from __future__ import annotations

import json
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from astraflow.errors import AstraflowError

if TYPE_CHECKING:
    import aiohttp


class AgentHttpError(AstraflowError):
    """Raised when the server answers a call with an error (the message is the server's)."""

    def __init__(self, status: int, message: str) -> None:
        super().__init__(f"HTTP {status}: {message}")
        self.status = status


@dataclass(frozen=True)
class AgentTool:
    """A function the agent offers the model."""

    name: str
    description: str
    param: str  # its one string parameter
    run: Callable[[str], Awaitable[str]]  # argument -> result text (raising: the model sees the error)

    def schema(self) -> dict[str, Any]:
        return {"type": "function", "function": {
            "name": self.name, "description": self.description,
            "parameters": {"type": "object", "properties": {self.param: {"type": "string"}}, "required": [self.param]}}}


@dataclass
class AgentRun:
    """How an episode went."""

    final: str = ""  # content of the last assistant message
    messages: list[dict[str, Any]] = field(default_factory=list)  # the whole conversation
    turns: int = 0  # model calls made
    error: str | None = None  # why it stopped early, if it did


async def chat(session: aiohttp.ClientSession, base_url: str, api_key: str, body: dict[str, Any]) -> dict[str, Any]:
    """One POST to `{base_url}/chat/completions`; the parsed JSON or `AgentHttpError`."""
    async with session.post(f"{base_url}/chat/completions", json=body,
                            headers={"Authorization": f"Bearer {api_key}"}) as resp:
        data = await resp.json(content_type=None)
        if resp.status != 200:
            raise AgentHttpError(resp.status, str((data or {}).get("error", {}).get("message", data))[:500])
        return data


async def run_agent(base_url: str, api_key: str, model: str, user: str, tools: list[AgentTool], *,
                    system: str | None = None, max_turns: int = 8, max_tokens: int | None = None) -> AgentRun:
    """Runs one episode (see the module doc)."""
    import aiohttp  # here, not at import: a node that never runs an agent does not pay for it

    run = AgentRun()
    by_name = {t.name: t for t in tools}
    if system:
        run.messages.append({"role": "system", "content": system})
    run.messages.append({"role": "user", "content": user})
    timeout = aiohttp.ClientTimeout(total=None, sock_read=None)
    async with aiohttp.ClientSession(timeout=timeout) as session:
        while run.turns < max_turns:
            body: dict[str, Any] = {"model": model, "messages": run.messages}
            if tools:
                body["tools"] = [t.schema() for t in tools]
            if max_tokens:
                body["max_tokens"] = max_tokens
            try:
                data = await chat(session, base_url, api_key, body)
            except AgentHttpError as exc:
                run.error = str(exc)
                break
            run.turns += 1
            message = data["choices"][0]["message"]
            run.messages.append(message)
            run.final = message.get("content") or ""
            calls = message.get("tool_calls") or []
            if not calls:
                break
            for call in calls:
                fn = call["function"]
                tool = by_name.get(fn["name"])
                try:
                    args = json.loads(fn["arguments"] or "{}")
                    arg = args.get(tool.param, "") if tool is not None and isinstance(args, dict) else ""
                    result = await tool.run(arg) if tool is not None else f"error: no tool named {fn['name']}"
                except Exception as exc:  # a failing tool is an observation for the model
                    result = f"error: {type(exc).__name__}: {exc}"
                run.messages.append({"role": "tool", "tool_call_id": call["id"], "content": str(result)})
        else:
            run.error = f"no answer after {max_turns} model calls"
    return run


__all__ = ["AgentHttpError", "AgentRun", "AgentTool", "chat", "run_agent"]
