"""Chat messages to token ids and back: the model's chat template or the endpoint's own format.

When the policy's tokenizer has a chat template (`tokenizer.chat_template`, as transformers
models ship it), messages are rendered through `apply_chat_template` (`template_pieces`). Each
assistant message the model sampled is put in as a random placeholder; the text between
placeholders is encoded, and each placeholder is replaced by the ids the model sampled, exactly
(an end-of-turn special token the template writes after a message that already ends with it is
not repeated). A template that drops or rewrites earlier assistant messages renders them as text
instead, which starts a new sequence (see `session`).

Without a template, the chat format is the plain-text protocol of `astraflow.models.protocol`,
message by message:

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
import secrets
from dataclasses import dataclass
from typing import Any

from astraflow.raas.agent_api.protocol import ApiError, Message, ToolCallSpec

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


def chat_template(backend: Any) -> Any | None:
    """The backend's tokenizer when it has a chat template, else None."""
    tok = getattr(backend, "tokenizer", None)
    return tok if tok is not None and getattr(tok, "chat_template", None) else None


def _template_text(tok: Any, conv: list[dict[str, Any]], tools: list[dict[str, Any]] | None = None) -> str:
    try:
        text = tok.apply_chat_template(conv, tools=tools or None, tokenize=False, add_generation_prompt=True)
    except Exception as exc:  # the template's own checks (jinja raise_exception, unknown roles, ...)
        raise ApiError(f"the model's chat template cannot render these messages: {type(exc).__name__}: "
                       f"{str(exc)[:300]}", param="messages") from None
    if not isinstance(text, str):
        raise ApiError("the model's chat template did not render text", status=500, type="server_error")
    return text


def template_pieces(tok: Any, encode: Any, messages: list[Message], sampled: list[list[int] | None],
                    tools: list[dict[str, Any]] | None = None) -> list[Piece]:
    """The prompt of `messages` through the tokenizer's chat template, as pieces: encoded text
    between the assistant messages the model sampled (`sampled[i]`: their ids, else None), and
    those ids exactly. `encode(text)` encodes without adding special tokens; `tools` (OpenAI
    function specs) go to the template as its `tools`."""
    marks = {i: f"<<af-{secrets.token_hex(8)}-{i}>>" for i, ids in enumerate(sampled) if ids is not None}
    conv: list[dict[str, Any]] = []
    for i, m in enumerate(messages):
        if i in marks:
            conv.append({"role": "assistant", "content": marks[i]})
        elif m.role == "tool":
            conv.append({"role": "tool", "content": m.content, "tool_call_id": m.tool_call_id or ""})
        else:
            role = "system" if m.role == "developer" else m.role
            conv.append({"role": role, "content": message_text(m) if m.role == "assistant" else m.content})
    text = _template_text(tok, conv, tools)
    order = sorted(marks)
    where = [text.find(marks[i]) for i in order]
    if any(w < 0 or text.count(marks[i]) != 1 for w, i in zip(where, order, strict=True)) or where != sorted(where):
        # the template drops or rewrites earlier assistant turns: render them as text
        conv = [{**c, "content": message_text(messages[i])} if i in marks else c for i, c in enumerate(conv)]
        text = _template_text(tok, conv, tools)
        return [Piece("prompt", encode(text), text)]
    specials = set(getattr(tok, "all_special_ids", []) or [])
    pieces, at, covered = [], 0, 0  # `covered`: messages before the current chunk
    for i, w in zip(order, where, strict=True):
        chunk = text[at:w]
        pieces.append(Piece(_chunk_role(messages, covered, i), encode(chunk), chunk))
        ids = sampled[i] or []
        pieces.append(Piece("assistant", list(ids), ""))
        at, covered = w + len(marks[i]), i + 1
        if ids and ids[-1] in specials:  # the sampled end-of-turn token: not written twice
            end = tok.decode([ids[-1]], skip_special_tokens=False)
            if end and text.startswith(end, at):
                at += len(end)
    chunk = text[at:]
    pieces.append(Piece(_chunk_role(messages, covered, len(messages)), encode(chunk), chunk))
    return [p for p in pieces if p.ids]


def _chunk_role(messages: list[Message], lo: int, hi: int) -> str:
    """The role a chunk of template text is recorded under: its last message's, else `template`."""
    return messages[hi - 1].role if hi > lo else "template"


__all__ = ["Piece", "assistant_key", "call_argument", "chat_template", "message_text", "split_tool_call",
           "template_pieces"]
