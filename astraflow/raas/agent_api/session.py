"""One rollout's side of the endpoint: serve an agent's calls and record them in its trajectory.

Every call is served by the rollout's backend for the policy the request names (`model`; the
task's first policy when absent or `default`) and recorded in the rollout's context:

- the prompt tokens the model had not seen in this sequence become a context segment (masked,
  version -1), the sampled tokens a trained segment with the backend's exact ids, logprobs and
  per-token versions. An assistant message the agent sends back is matched to what the model
  sampled for it and rendered with those ids (`render`), so nothing is re-tokenised;
- a prompt that extends the policy's current sequence adds only its new messages; any other
  prompt (the agent rewrote, summarised or dropped its history) starts a new sequence, whose
  first segment has role `prompt` (`astraflow.dataflow.sequences` splits them, one training
  sample each);
- a tool call the model made is returned in OpenAI format; the tool message that answers it
  becomes a `ToolCall` of the trajectory (name, arguments, result, latency from the call to
  the answer); calls never answered are recorded with an error when the rollout ends.

A prompt that, with the agent's `max_tokens`, does not fit the policy's context is refused with
a 400 `context_length_exceeded` before any segment is recorded (tool results it carries are). `logprobs` returns the sampled
tokens' logprobs, the very values recorded in the segment.

Sampling temperature and top_p are the task's (the trainer needs the behaviour distribution
the experiment chose); an agent's values are checked and not used. Calls are served one at a
time per rollout, at most `sampling.max_turns` of them.
"""

from __future__ import annotations

import asyncio
import time
import uuid
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from astraflow.raas.agent_api.protocol import (
    ApiError,
    ChatRequest,
    CompletionRequest,
    Limits,
    Sampling,
    ToolCallSpec,
)
from astraflow.raas.agent_api.render import (
    Piece,
    assistant_key,
    chat_template,
    message_text,
    split_tool_call,
    template_pieces,
)
from astraflow.raas.backends.base import GenerateRequest, Generation
from astraflow.raas.workflows.base import RolloutContext
from astraflow.records import Segment, ToolCall


@dataclass
class _Sequence:
    """What one policy has seen so far in its current sequence."""

    ids: list[int]  # every token of the sequence
    kind: str  # chat | completion: a completion prompt is matched by text
    text: str = ""  # completion sequences: the text the agent sees


@dataclass
class _OpenCall:
    name: str
    arguments: str
    issued: float  # time.monotonic() when the call was returned to the agent
    turn: int  # model call that made it


@dataclass
class AgentSession:
    """The endpoint state of one rollout (see the module doc)."""

    ctx: RolloutContext
    limits: Limits
    key: str
    calls: int = 0  # model calls served
    _seqs: dict[str, _Sequence] = field(default_factory=dict)
    _sampled: dict[tuple, list[int]] = field(default_factory=dict)  # (policy, assistant message) -> sampled ids
    _open: dict[str, _OpenCall] = field(default_factory=dict)  # tool call id -> call not answered yet
    _lock: asyncio.Lock = field(default_factory=asyncio.Lock)
    closed: bool = False

    # ---- the two endpoints ---------------------------------------------------------------------

    async def chat(self, req: ChatRequest) -> dict[str, Any]:
        async with self._lock:
            self._check_turns()
            policy = self._policy(req.sampling.model)
            self._record_tool_results(req)  # the tools ran, whatever happens to this call
            pieces = self._render(policy, req)
            ids = [t for p in pieces for t in p.ids]
            max_tokens = self._budget(policy, len(ids), req.sampling, "messages")
            self._extend(policy, ids, pieces, "chat")
            stops = req.sampling.stop or list(self.ctx.task.sampling.stop)
            stops = stops + [f"</{name}>" for name in req.tools]
            gen = await self._generate(policy, ids, max_tokens, stops)
            content, calls = split_tool_call(gen.text, req.tools)
            specs = [ToolCallSpec(f"call_{uuid.uuid4().hex[:20]}", n, a) for n, a in calls]
            self._sampled[(policy, assistant_key(content, specs))] = [int(t) for t in gen.token_ids]
            for s in specs:
                self._open[s.id] = _OpenCall(s.name, s.arguments, time.monotonic(), self.calls - 1)
            message: dict[str, Any] = {"role": "assistant", "content": content if content or not specs else None}
            if specs:
                message["tool_calls"] = [{"id": s.id, "type": "function",
                                          "function": {"name": s.name, "arguments": s.arguments}} for s in specs]
            reason = "tool_calls" if specs else gen.finish_reason
            logprobs = chat_logprobs(self._token_texts(policy, gen)) if req.sampling.logprobs else None
            return self._response("chat.completion", policy, len(ids), gen,
                                  {"index": 0, "message": message, "finish_reason": reason, "logprobs": logprobs})

    async def complete(self, req: CompletionRequest) -> dict[str, Any]:
        async with self._lock:
            self._check_turns()
            policy = self._policy(req.sampling.model)
            seq = self._seqs.get(policy)
            if seq is not None and seq.kind == "completion" and req.prompt.startswith(seq.text):
                rest = req.prompt[len(seq.text):]
                ids = seq.ids + (self.ctx.backend(policy).encode(rest) if rest else [])
                pieces = [Piece("prompt", list(seq.ids), seq.text), Piece("user", ids[len(seq.ids):], rest)]
            else:
                ids = self.ctx.backend(policy).encode(req.prompt, add_bos=True)
                pieces = [Piece("prompt", ids, req.prompt)]
            max_tokens = self._budget(policy, len(ids), req.sampling, "prompt")
            self._extend(policy, ids, pieces, "completion")
            gen = await self._generate(policy, ids, max_tokens, req.sampling.stop or list(self.ctx.task.sampling.stop))
            self._seqs[policy].text = req.prompt + gen.text
            logprobs = (completion_logprobs(self._token_texts(policy, gen), len(req.prompt))
                        if req.sampling.logprobs else None)
            return self._response("text_completion", policy, len(ids), gen,
                                  {"index": 0, "text": gen.text, "finish_reason": gen.finish_reason,
                                   "logprobs": logprobs})

    def close(self) -> None:
        """The rollout is over: tool calls never answered are recorded with an error."""
        self.closed = True
        for call in self._open.values():
            self.ctx.tool_calls.append(ToolCall(call.turn, call.name, call.arguments, "", 0.0,
                                                "the agent never returned this call's result"))
        self._open.clear()

    # ---- pieces --------------------------------------------------------------------------------

    def _check_turns(self) -> None:
        limit = self.ctx.task.sampling.max_turns
        if self.calls >= limit:
            raise ApiError(f"this rollout allows {limit} model calls (the task's sampling.max_turns); "
                           "end the episode", status=429, type="rate_limit_error")
        if self.closed:
            raise ApiError("this rollout has ended", status=410, type="invalid_request_error")

    def _policy(self, model: str | None) -> str:
        policies = self.ctx.task.policies
        if model in (None, "", "default"):
            return policies[0]
        if model not in policies:
            raise ApiError(f"model {model[:80]!r} is not a policy of this rollout; use one of {policies} "
                           "(or 'default' for the first)", status=404, type="not_found_error", param="model")
        return model

    def _budget(self, policy: str, prompt_tokens: int, s: Sampling, param: str) -> int:
        """New tokens this call may sample; `ApiError` (400, `context_length_exceeded`) when the
        prompt plus the agent's `max_tokens` does not fit the policy's context. Without an explicit
        `max_tokens` the task's is used, cut to what the context leaves (finish_reason `length`)."""
        p = self.ctx.task.sampling
        asked = min(s.max_tokens or p.max_tokens, p.max_tokens, self.limits.max_tokens)
        context = context_length(self.ctx.backend(policy))
        if context is None:
            return asked
        if prompt_tokens + (asked if s.max_tokens else 1) > context:
            wanted = f"{prompt_tokens + asked} tokens ({prompt_tokens} in the {param}, {asked} in the completion)" \
                if s.max_tokens else f"{prompt_tokens} tokens in the {param} and at least 1 new one"
            raise ApiError(f"policy {policy!r} has a context of {context} tokens; this request needs {wanted}. "
                           f"Shorten the {param} or lower max_tokens.", param=param, code="context_length_exceeded")
        return min(asked, context - prompt_tokens)

    def _token_texts(self, policy: str, gen: Generation) -> list[tuple[str, float]]:
        """(text, logprob) of each sampled token, special tokens written out."""
        backend = self.ctx.backend(policy)
        tok = getattr(backend, "tokenizer", None)
        texts = [tok.decode([int(t)], skip_special_tokens=False) if tok is not None else backend.decode([int(t)])
                 for t in gen.token_ids]
        return list(zip(texts, (float(x) for x in gen.logprobs), strict=True))

    def _render(self, policy: str, req: ChatRequest) -> list[Piece]:
        backend = self.ctx.backend(policy)
        sampled = [self._sampled.get((policy, assistant_key(m.content, m.tool_calls))) if m.role == "assistant"
                   else None for m in req.messages]
        tok = chat_template(backend)
        if tok is not None:
            return template_pieces(tok, backend.encode, req.messages, sampled)
        pieces = []
        for i, m in enumerate(req.messages):
            if sampled[i] is not None:
                pieces.append(Piece("assistant", sampled[i] or [], message_text(m)))
            else:
                text = message_text(m)
                pieces.append(Piece(m.role, backend.encode(text, add_bos=i == 0), text))
        return pieces

    def _extend(self, policy: str, ids: list[int], pieces: list[Piece], kind: str) -> None:
        """Record the part of `ids` this policy's sequence has not seen (see the module doc)."""
        seq = self._seqs.get(policy)
        if seq is not None and seq.kind == kind and len(ids) >= len(seq.ids) and ids[: len(seq.ids)] == seq.ids:
            at = 0
            for p in pieces:  # the new tail, message by message
                lo, hi = max(at, len(seq.ids)), at + len(p.ids)
                if hi > lo:
                    self.ctx.segments.append(Segment.context(policy, p.role, ids[lo:hi], p.text if lo == at else ""))
                at += len(p.ids)
            seq.ids = list(ids)
            return
        text = "".join(p.text for p in pieces)
        self.ctx.segments.append(Segment.context(policy, "prompt", ids, text))  # a new sequence
        self._seqs[policy] = _Sequence(list(ids), kind)

    async def _generate(self, policy: str, ids: list[int], max_tokens: int, stops: list[str]) -> Generation:
        p = self.ctx.task.sampling
        self.calls += 1
        request = GenerateRequest(list(ids), max_tokens, p.temperature, p.top_p, stops[: self.limits.max_stop_strings * 2])
        t0 = time.perf_counter()
        gen = await self.ctx.backend(policy).generate(request)
        self.ctx.generate_s += time.perf_counter() - t0
        if self.closed:  # the workflow finished meanwhile: its trajectory must not change any more
            raise ApiError("this rollout has ended", status=410, type="invalid_request_error")
        n = len(gen.token_ids)
        self.ctx.segments.append(Segment(policy, "assistant", gen.token_ids, gen.logprobs, np.ones(n, np.uint8),
                                         gen.versions, gen.text))
        self._seqs[policy].ids = list(ids) + [int(t) for t in gen.token_ids]
        return gen

    def _record_tool_results(self, req: ChatRequest) -> None:
        for m in req.messages:
            call = self._open.pop(m.tool_call_id, None) if m.role == "tool" and m.tool_call_id else None
            if call is not None:
                self.ctx.tool_calls.append(ToolCall(call.turn, call.name, call.arguments, m.content[:20_000],
                                                    time.monotonic() - call.issued))
                self.ctx.tool_s += time.monotonic() - call.issued

    def _response(self, kind: str, policy: str, prompt_tokens: int, gen: Generation, choice: dict) -> dict[str, Any]:
        n = len(gen.token_ids)
        return {"id": f"{'chatcmpl' if kind == 'chat.completion' else 'cmpl'}-{uuid.uuid4().hex[:24]}",
                "object": kind, "created": int(time.time()), "model": policy, "choices": [choice],
                "usage": {"prompt_tokens": prompt_tokens, "completion_tokens": n, "total_tokens": prompt_tokens + n}}


def context_length(backend: Any) -> int | None:
    """The most tokens (prompt + new) the backend's model takes: its `context_length`, else its
    tokenizer's `model_max_length` when that is a real bound; None when unknown."""
    n = getattr(backend, "context_length", None)
    if n is None:
        n = getattr(getattr(backend, "tokenizer", None), "model_max_length", None)
        n = n if isinstance(n, int) and n < 10**8 else None  # transformers' "no limit" is ~1e30
    return n if isinstance(n, int) and not isinstance(n, bool) and n > 0 else None


def chat_logprobs(tokens: list[tuple[str, float]]) -> dict[str, Any]:
    """OpenAI's `choices[0].logprobs` of a chat completion (no alternatives: `top_logprobs` is [])."""
    return {"content": [{"token": t, "logprob": lp, "bytes": list(t.encode()), "top_logprobs": []}
                        for t, lp in tokens], "refusal": None}


def completion_logprobs(tokens: list[tuple[str, float]], offset: int) -> dict[str, Any]:
    """OpenAI's `choices[0].logprobs` of a text completion; `text_offset` counts from the prompt's start."""
    offsets, at = [], offset
    for t, _ in tokens:
        offsets.append(at)
        at += len(t)
    return {"tokens": [t for t, _ in tokens], "token_logprobs": [lp for _, lp in tokens], "top_logprobs": None,
            "text_offset": offsets}


__all__ = ["AgentSession", "chat_logprobs", "completion_logprobs", "context_length"]
