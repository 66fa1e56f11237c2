"""OpenAI-compatible request bodies, checked: what an agent may ask of a rollout's endpoint.

The agent is untrusted code (or a model driving code), so every field of a request is checked
before any work: types, sizes and ranges, with an OpenAI-style error (`ApiError`: HTTP status,
`type`, `param`, message) naming the field, the value and the limit. Fields this endpoint does
not use are ignored, as OpenAI servers ignore unknown ones; fields it cannot honour (`n` > 1,
`logit_bias`, top-k logprob alternatives, ...) are refused rather than silently dropped.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass, field, replace
from typing import Any

from astraflow.errors import AstraflowError

MAX_MESSAGES = 256  # messages in one chat request
MAX_TOOLS = 64  # tool definitions in one chat request
MAX_TOOL_CALLS = 16  # tool calls inside one assistant message
MAX_NAME_CHARS = 64  # tool / function names (OpenAI's own limit)
ROLES = ("system", "developer", "user", "assistant", "tool")


class ApiError(AstraflowError):
    """Raised for a request the endpoint refuses; becomes an OpenAI-style JSON error response."""

    def __init__(self, message: str, *, status: int = 400, type: str = "invalid_request_error",
                 param: str | None = None, code: str | None = None) -> None:
        super().__init__(message)
        self.status = status
        self.type = type
        self.param = param
        self.code = code  # OpenAI's machine-readable reason, e.g. context_length_exceeded

    def body(self) -> dict[str, Any]:
        return {"error": {"message": str(self), "type": self.type, "param": self.param, "code": self.code}}


@dataclass(frozen=True, slots=True)
class ToolCallSpec:
    """One function call the model made (or an agent echoes back in an assistant message)."""

    id: str  # call id, echoed by the tool message that answers it
    name: str  # function name
    arguments: str  # JSON text of the arguments


@dataclass(frozen=True, slots=True)
class Message:
    """One chat message, checked."""

    role: str  # system | developer | user | assistant | tool
    content: str  # text ("" when absent)
    tool_calls: tuple[ToolCallSpec, ...] = ()  # assistant messages only
    tool_call_id: str | None = None  # tool messages only


@dataclass(frozen=True, slots=True)
class Sampling:
    """What one call asks of the model (temperature and top_p are the task's, see `session`)."""

    model: str | None  # policy name, or None for the rollout's first policy
    max_tokens: int | None  # new tokens at most (None: the task's sampling.max_tokens)
    stop: list[str] = field(default_factory=list)  # the agent's stop strings
    stream: bool = False  # server-sent events instead of one JSON body
    logprobs: bool = False  # return the sampled tokens' logprobs with the answer


@dataclass(frozen=True, slots=True)
class ChatRequest:
    """A checked /v1/chat/completions body."""

    messages: list[Message]
    tools: dict[str, str]  # function offered to the model -> the parameter its call text fills
    sampling: Sampling


@dataclass(frozen=True, slots=True)
class CompletionRequest:
    """A checked /v1/completions body (one prompt string)."""

    prompt: str
    sampling: Sampling


@dataclass(frozen=True, slots=True)
class Limits:
    """Bounds on one request; the node fills them from `raas.*` and the task."""

    max_tokens: int  # the task's sampling.max_tokens (itself within raas.max_tokens)
    max_chars: int = 200_000  # characters of all messages together (raas.max_prompt_chars)
    max_stop_strings: int = 16  # raas.max_stop_strings
    max_stop_chars: int = 256  # raas.max_stop_chars


def parse_json(raw: bytes) -> dict[str, Any]:
    """The body as a JSON object, or `ApiError`."""
    try:
        body = json.loads(raw)
    except (ValueError, RecursionError) as exc:  # also integers over Python's digit limit
        raise ApiError(f"the request body is not valid JSON: {str(exc)[:200]}") from None
    if not isinstance(body, dict):
        raise ApiError(f"the request body must be a JSON object, got {type(body).__name__}")
    return body


def _str(value: Any, param: str, *, limit: int, allow_none: bool = False) -> str | None:
    if value is None and allow_none:
        return None
    if not isinstance(value, str):
        raise ApiError(f"{param} must be a string, got {type(value).__name__}", param=param)
    if len(value) > limit:
        raise ApiError(f"{param} is {len(value)} characters; at most {limit} are accepted", param=param)
    return value


def _content(value: Any, param: str, limit: int) -> str:
    """Message content: a string, null, or a list of {"type": "text", "text": ...} parts."""
    if value is None:
        return ""
    if isinstance(value, str):
        return _str(value, param, limit=limit) or ""
    if isinstance(value, list):
        parts = []
        for i, part in enumerate(value[:MAX_MESSAGES + 1]):
            if not isinstance(part, dict) or part.get("type") != "text":
                raise ApiError(f"{param}[{i}] must be a text part {{\"type\": \"text\", \"text\": ...}}; "
                               "images and audio are not supported", param=param)
            parts.append(_str(part.get("text"), f"{param}[{i}].text", limit=limit) or "")
        if len(value) > MAX_MESSAGES:
            raise ApiError(f"{param} has more than {MAX_MESSAGES} parts", param=param)
        return "".join(parts)
    raise ApiError(f"{param} must be a string or a list of text parts", param=param)


def _name(value: Any, param: str) -> str:
    name = _str(value, param, limit=MAX_NAME_CHARS) or ""
    if not name or not all(c.isascii() and (c.isalnum() or c in "_-") for c in name):
        raise ApiError(f"{param}={name[:80]!r} must be 1-{MAX_NAME_CHARS} of a-z, A-Z, 0-9, _ and -", param=param)
    return name


def _tool_calls(value: Any, param: str, limit: int) -> tuple[ToolCallSpec, ...]:
    if value is None:
        return ()
    if not isinstance(value, list) or len(value) > MAX_TOOL_CALLS:
        raise ApiError(f"{param} must be a list of at most {MAX_TOOL_CALLS} tool calls", param=param)
    out = []
    for i, call in enumerate(value):
        p = f"{param}[{i}]"
        if not isinstance(call, dict) or not isinstance(call.get("function"), dict):
            raise ApiError(f"{p} must be {{\"id\", \"type\": \"function\", \"function\": {{\"name\", \"arguments\"}}}}",
                           param=p)
        fn = call["function"]
        out.append(ToolCallSpec(_str(call.get("id", ""), f"{p}.id", limit=128) or "", _name(fn.get("name"), f"{p}.function.name"),
                                _str(fn.get("arguments", ""), f"{p}.function.arguments", limit=limit) or ""))
    return tuple(out)


def _messages(value: Any, limits: Limits) -> list[Message]:
    if not isinstance(value, list) or not value:
        raise ApiError("messages must be a non-empty list", param="messages")
    if len(value) > MAX_MESSAGES:
        raise ApiError(f"messages holds {len(value)} messages; at most {MAX_MESSAGES} are accepted", param="messages")
    out, total = [], 0
    for i, m in enumerate(value):
        p = f"messages[{i}]"
        if not isinstance(m, dict):
            raise ApiError(f"{p} must be an object with a role and content", param=p)
        role = m.get("role")
        if role not in ROLES:
            raise ApiError(f"{p}.role={str(role)[:40]!r} must be one of {', '.join(ROLES)}", param=f"{p}.role")
        content = _content(m.get("content"), f"{p}.content", limits.max_chars)
        calls = _tool_calls(m.get("tool_calls"), f"{p}.tool_calls", limits.max_chars) if role == "assistant" else ()
        call_id = _str(m.get("tool_call_id"), f"{p}.tool_call_id", limit=128, allow_none=True) if role == "tool" else None
        total += len(content) + sum(len(c.arguments) for c in calls)
        if total > limits.max_chars:
            raise ApiError(f"messages hold more than {limits.max_chars} characters (raas.max_prompt_chars)",
                           param="messages")
        out.append(Message(role, content, calls, call_id))
    return out


def _tools(value: Any) -> dict[str, str]:
    """name -> the parameter a call's text fills: the function's only declared one, else `input`."""
    if value is None:
        return {}
    if not isinstance(value, list) or len(value) > MAX_TOOLS:
        raise ApiError(f"tools must be a list of at most {MAX_TOOLS} function definitions", param="tools")
    names: dict[str, str] = {}
    for i, t in enumerate(value):
        if not isinstance(t, dict) or t.get("type", "function") != "function" or not isinstance(t.get("function"), dict):
            raise ApiError(f"tools[{i}] must be {{\"type\": \"function\", \"function\": {{\"name\": ...}}}}",
                           param=f"tools[{i}]")
        fn = t["function"]
        params = fn.get("parameters")
        props = params.get("properties") if isinstance(params, dict) else None
        keys = list(props) if isinstance(props, dict) else []
        names[_name(fn.get("name"), f"tools[{i}].function.name")] = (
            keys[0] if len(keys) == 1 and isinstance(keys[0], str) and len(keys[0]) <= MAX_NAME_CHARS else "input")
    return names


def _int(value: Any, param: str) -> int:
    if isinstance(value, bool) or not isinstance(value, int):
        raise ApiError(f"{param} must be an integer, got {str(value)[:40]!r}", param=param)
    return value


def _sampling(body: dict[str, Any], limits: Limits) -> Sampling:
    model = _str(body.get("model"), "model", limit=512, allow_none=True)
    raw = body.get("max_completion_tokens", body.get("max_tokens"))
    max_tokens = None
    if raw is not None:
        max_tokens = _int(raw, "max_tokens")
        if not 1 <= max_tokens <= limits.max_tokens:
            raise ApiError(f"max_tokens={max_tokens} must be between 1 and {limits.max_tokens} "
                           "(the task's sampling.max_tokens)", param="max_tokens")
    for name in ("temperature", "top_p"):  # checked; the task's values are used (see session)
        v = body.get(name)
        if v is not None and (isinstance(v, bool) or not isinstance(v, int | float) or not math.isfinite(v) or v < 0):
            raise ApiError(f"{name}={str(v)[:40]!r} must be a finite number >= 0", param=name)
    n = body.get("n", 1)
    if n != 1:
        raise ApiError(f"n={str(n)[:40]!r}: only n=1 is served (ask again for another sample)", param="n")
    for name in ("logit_bias", "best_of", "echo", "suffix"):
        if body.get(name) not in (None, {}, 1, False, ""):
            raise ApiError(f"{name} is not supported by this endpoint", param=name)
    stop = body.get("stop")
    stops: list[str] = []
    if isinstance(stop, str):
        stops = [stop]
    elif isinstance(stop, list):
        stops = stop
    elif stop is not None:
        raise ApiError("stop must be a string or a list of strings", param="stop")
    if len(stops) > limits.max_stop_strings:
        raise ApiError(f"stop holds {len(stops)} strings; at most {limits.max_stop_strings} (raas.max_stop_strings)",
                       param="stop")
    for s in stops:
        if not isinstance(s, str) or not s or len(s) > limits.max_stop_chars:
            raise ApiError(f"every stop string must be non-empty text of at most {limits.max_stop_chars} characters",
                           param="stop")
    stream = body.get("stream", False)
    if not isinstance(stream, bool):
        raise ApiError("stream must be true or false", param="stream")
    return Sampling(model, max_tokens, list(stops), stream)


NO_ALTERNATIVES = ("the backends return each sampled token's own logprob, not the most likely alternatives; "
                   "ask for 0")


def _chat_logprobs(body: dict[str, Any]) -> bool:
    """Chat: `logprobs` true/false; `top_logprobs` an integer 0-20 that needs `logprobs` (only 0 is served)."""
    wanted = body.get("logprobs")
    if wanted is not None and not isinstance(wanted, bool):
        raise ApiError(f"logprobs={str(wanted)[:40]!r} must be true or false", param="logprobs")
    top = body.get("top_logprobs")
    if top is not None:
        top = _int(top, "top_logprobs")
        if not 0 <= top <= 20:
            raise ApiError(f"top_logprobs={top} must be between 0 and 20", param="top_logprobs")
        if not wanted:
            raise ApiError("top_logprobs needs logprobs=true", param="top_logprobs")
        if top > 0:
            raise ApiError(f"top_logprobs={top} is not served: {NO_ALTERNATIVES}", param="top_logprobs")
    return bool(wanted)


def _completion_logprobs(body: dict[str, Any]) -> bool:
    """Completions: `logprobs` an integer 0-5 (the alternatives per token); only 0 is served."""
    n = body.get("logprobs")
    if n is None:
        return False
    n = _int(n, "logprobs")
    if not 0 <= n <= 5:
        raise ApiError(f"logprobs={n} must be between 0 and 5", param="logprobs")
    if n > 0:
        raise ApiError(f"logprobs={n} is not served: {NO_ALTERNATIVES} (logprobs=0 returns them)", param="logprobs")
    return True


def parse_chat(body: dict[str, Any], limits: Limits) -> ChatRequest:
    """A checked chat request, or `ApiError` naming the first bad field."""
    messages, tools = _messages(body.get("messages"), limits), _tools(body.get("tools"))
    sampling = replace(_sampling(body, limits), logprobs=_chat_logprobs(body))
    return ChatRequest(messages, tools, sampling)


def parse_completion(body: dict[str, Any], limits: Limits) -> CompletionRequest:
    """A checked completions request (one prompt string), or `ApiError`."""
    prompt = body.get("prompt")
    if isinstance(prompt, list) and len(prompt) == 1:
        prompt = prompt[0]
    if not isinstance(prompt, str):
        raise ApiError("prompt must be one string (token-id prompts and batches are not served)", param="prompt")
    sampling = replace(_sampling(body, limits), logprobs=_completion_logprobs(body))
    return CompletionRequest(_str(prompt, "prompt", limit=limits.max_chars) or "", sampling)


__all__ = ["ApiError", "ChatRequest", "CompletionRequest", "Limits", "Message", "Sampling", "ToolCallSpec",
           "parse_chat", "parse_completion", "parse_json"]
