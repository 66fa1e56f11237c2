"""Chat messages to token ids and back: the endpoint's chat format and OpenAI tool calls.

The chat format is the plain-text protocol of `astraflow.models.protocol`, message by message:

| message | text |
|---|---|
| system / developer | `{content}\\n` |
| user | `Q: {content}\\nA:` |
| assistant | the token ids the model sampled for it, exactly (else its text, with each tool call as `<name>ARGS</name>`) |
| tool | `<result>{content}</result>` |

Each message is encoded on its own and the ids are concatenated (the first with `<bos>`), so a
conversation that grows by messages grows its token ids by suffixes: the ids recorded for an
earlier turn stay a prefix of every later prompt, and what the model sampled is never re-tokenised.

A tool call is the text protocol's `<name>ARGS</name>` at the end of a generation, for a tool
the request offered; it becomes an OpenAI `tool_calls` entry whose arguments are the JSON object
`{"<param>": ARGS}`, `<param>` being the function's only declared parameter (else `input`).
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass

from astraflow.raas.agent_api.protocol import Message, ToolCallSpec

_CALL = re.compile(r"<([A-Za-z0-9_-]{1,64})>(.*?)</\1>\s*$", re.S)


@dataclass(frozen=True, slots=True)
class Piece:
    """The token ids of one message of a prompt."""

    role: str  # the message's role
    ids: list[int]  # its token ids
    text: str  # its text as rendered


def message_text(m: Message) -> str:
    """The text a message renders to (assistant messages: only when no sampled ids are known)."""
    if m.role in ("system", "developer"):
        return f"{m.content}\n"
    if m.role == "user":
        return f"Q: {m.content.strip()}\nA:"
    if m.role == "tool":
        return f"<result>{m.content}</result>"
    return m.content + "".join(f"<{c.name}>{call_argument(c.arguments)}</{c.name}>" for c in m.tool_calls)


def call_argument(arguments: str) -> str:
    """The text inside `<name>...</name>` for a call's JSON arguments: the value of a one-key
    object, else the arguments as written."""
    try:
        parsed = json.loads(arguments) if arguments else {}
    except (json.JSONDecodeError, RecursionError):
        return arguments
    if isinstance(parsed, dict) and len(parsed) == 1:
        value = next(iter(parsed.values()))
        return value if isinstance(value, str) else json.dumps(value)
    return arguments


def assistant_key(content: str, calls: tuple[ToolCallSpec, ...] | list[ToolCallSpec]) -> tuple:
    """What identifies an assistant message the endpoint returned, when an agent sends it back."""
    return (content, tuple((c.name, call_argument(c.arguments)) for c in calls))


def split_tool_call(text: str, tools: dict[str, str]) -> tuple[str, list[tuple[str, str]]]:
    """(content before the call, [(name, JSON arguments)]) for a generation that ends in a call
    of an offered tool (`tools`: name -> parameter name); else (text, [])."""
    m = _CALL.search(text)
    if m is None or m.group(1) not in tools:
        return text, []
    name = m.group(1)
    return text[: m.start()], [(name, json.dumps({tools[name]: m.group(2).strip()}))]


__all__ = ["Piece", "assistant_key", "call_argument", "message_text", "split_tool_call"]
