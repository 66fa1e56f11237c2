"""A policy's conversation inside a workflow: the model's chat template when it has one.

    chat = Chat(ctx, policy, tools=["calc"])
    chat.start(ctx.task.prompt)               # system prompt (task metadata) + user turn
    gen = await chat.generate(stop=chat.stops)
    call = chat.tool_call(gen.text)           # (name, argument) in the model's format, or None
    chat.add_tool_result(call_id, result)     # the tool turn, rendered by the template

With a chat template (`tokenizer.chat_template`, as instruct models ship it) the prompt is
`apply_chat_template([system?, user], tools=..., add_generation_prompt=True)`; the system
prompt is the task's `metadata["system_prompt"]` (the curator's `--system-prompt`). Each later
turn is rendered by the template over the whole conversation, with every assistant turn the
model sampled put in as its sampled token ids, exactly (`agent_api.render.template_pieces`): only
the text after the last sampled turn is encoded and appended (masked out of the loss), so the
ids the model generated are never re-tokenised. A template that rewrites earlier turns starts a
new sequence instead. Tool calls use the model's format where the template defines one
(Qwen2.5 / Hermes: `<tool_call>{"name": ..., "arguments": {...}}</tool_call>`, tools described
to the template as OpenAI function specs), else the plain-text protocol `<NAME>ARGS</NAME>`.

Without a template (the tiny test models) the prompt is the task text, encoded with `<bos>`
(after `{system prompt}\\n` when one is set), and tool results are `<result>...</result>`: what
the workflows always did.
"""

from __future__ import annotations

import json
import re
from typing import TYPE_CHECKING, Any

from astraflow.raas.agent_api.protocol import Message
from astraflow.raas.agent_api.render import call_argument, chat_template, template_pieces
from astraflow.raas.backends.base import Generation

if TYPE_CHECKING:
    from astraflow.raas.workflows.base import RolloutContext

SYSTEM_PROMPT_KEY = "system_prompt"  # Task.metadata key
TEXT_TOOL_CALL = re.compile(r"<(\w+)>(.*?)</\1>\s*$", re.S)
JSON_TOOL_CALL = re.compile(r"<tool_call>\s*(\{.*\})\s*</tool_call>\s*$", re.S)
# The node's built-in tools as the template describes them: name -> (description, parameter).
TOOL_SPECS = {
    "calc": ("Evaluate an arithmetic expression exactly; returns its value.", "expression"),
    "python": ("Run Python code in a sandbox; returns what it prints.", "code"),
    "search": ("Search the local corpus; returns the best passages.", "query"),
}


def tool_spec(name: str) -> dict[str, Any]:
    """The OpenAI function spec of a node tool (one string parameter)."""
    doc, param = TOOL_SPECS.get(name, (f"The {name} tool.", "input"))
    return {"type": "function", "function": {"name": name, "description": doc, "parameters": {
        "type": "object", "properties": {param: {"type": "string"}}, "required": [param]}}}


class Chat:
    """One policy's conversation in one rollout (see the module doc)."""

    def __init__(self, ctx: RolloutContext, policy: str, tools: list[str] | None = None) -> None:
        self.ctx = ctx
        self.policy = policy
        self.backend = ctx.backend(policy)
        self.tok = chat_template(self.backend)
        self.tool_names = list(tools or [])
        self.specs = [tool_spec(n) for n in self.tool_names] or None
        self.json_calls = self.tok is not None and "<tool_call>" in str(self.tok.chat_template)
        self.messages: list[Message] = []
        self.sampled: list[list[int] | None] = []  # per message: the ids the model sampled for it

    @property
    def templated(self) -> bool:
        """Whether the model's chat template renders this conversation."""
        return self.tok is not None

    @property
    def stops(self) -> list[str]:
        """Stop strings that end a tool call in the model's format."""
        if not self.tool_names:
            return []
        return ["</tool_call>"] if self.json_calls else [f"</{n}>" for n in self.tool_names]

    def start(self, user: str) -> list[int]:
        """The prompt: a new sequence of this policy; returns its ids."""
        system = self.ctx.task.metadata.get(SYSTEM_PROMPT_KEY) or None
        if self.tok is None:
            return self.ctx.add_context(self.policy, "prompt", f"{system}\n{user}" if system else user, add_bos=True)
        self.messages = [*([Message("system", system)] if system else []), Message("user", user)]
        self.sampled = [None] * len(self.messages)
        return self._append(template_pieces(self.tok, self._encode, self.messages, self.sampled, self.specs), "prompt")

    async def generate(self, stop: list[str] | None = None, max_tokens: int | None = None) -> Generation:
        """The model's next turn (a trained segment); remembered with its ids for later turns."""
        gen = await self.ctx.generate(self.policy, stop=stop, max_tokens=max_tokens)
        self.messages.append(Message("assistant", gen.text))
        self.sampled.append([int(t) for t in gen.token_ids])
        return gen

    def tool_call(self, text: str) -> tuple[str, str] | None:
        """(tool name, argument text) of a call at the end of `text`, for a tool of this chat."""
        if self.json_calls:
            m = JSON_TOOL_CALL.search(text)
            if m is None:
                return None
            try:
                call = json.loads(m.group(1))
            except (json.JSONDecodeError, RecursionError):
                return None
            if not isinstance(call, dict) or not isinstance(call.get("name"), str):
                return None
            args = call.get("arguments", {})
            return call["name"], call_argument(args if isinstance(args, str) else json.dumps(args))
        m = TEXT_TOOL_CALL.search(text)
        return (m.group(1), m.group(2).strip()) if m is not None else None

    def add_tool_result(self, call_id: str, content: str) -> None:
        """The tool's answer as the next turn (masked out of the loss)."""
        if self.tok is None:
            self.ctx.add_context(self.policy, "tool", f"<result>{content}</result>")
            return
        self.messages.append(Message("tool", content, tool_call_id=call_id))
        self.sampled.append(None)
        self._append(template_pieces(self.tok, self._encode, self.messages, self.sampled, self.specs), "tool")

    def _encode(self, text: str) -> list[int]:
        return self.backend.encode(text, add_bos=False)  # a template writes its own special tokens

    def _append(self, pieces: list[Any], role: str) -> list[int]:
        """Appends what the rendered conversation adds to this policy's sequence (a new sequence when
        the template changed what came before)."""
        ids = [int(t) for p in pieces for t in p.ids]
        text = "".join(p.text for p in pieces)
        have = self.ctx.context_ids(self.policy) if role != "prompt" else None
        if have and len(ids) > len(have) and ids[: len(have)] == have:
            tail = ids[len(have):]
            self.ctx.segments.append(_context(self.policy, role, tail, pieces[-1].text))
            return tail
        self.ctx.segments.append(_context(self.policy, "prompt", ids, text))
        return ids


def _context(policy: str, role: str, ids: list[int], text: str) -> Any:
    from astraflow.records import Segment

    return Segment.context(policy, role, ids, text)
