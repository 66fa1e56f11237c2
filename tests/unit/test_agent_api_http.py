"""The per-rollout OpenAI endpoint without a broker: the HTTP protocol: refusals with clear errors,
streaming, an agent in another process, the context bound and logprobs.

The backend is a scripted test double that returns fixed token ids through the real tokenizer
(so a test can make the model "sample" ids that re-tokenising the text would not give); the
endpoint, the sessions, the HTTP server and the agents' HTTP clients are the real code
(`agent_api_fakes`).
"""

from __future__ import annotations

import asyncio
import json
import subprocess
import sys
import textwrap
from pathlib import Path

import aiohttp
import pytest
from agent_api_fakes import char_backend, post_json, rollout_ctx

from astraflow.raas.agent_api import AgentEndpoint


def test_bad_requests_are_refused_with_clear_errors_and_the_endpoint_goes_on(tiny_model_dir: Path) -> None:
    backend = char_backend(tiny_model_dir, ["ok"] * 3)
    endpoint = AgentEndpoint()
    ctx = rollout_ctx(backend, endpoint, max_turns=2)
    ok = {"messages": [{"role": "user", "content": "hi"}]}

    async def agent() -> list[tuple[int, str]]:
        out = []
        async with ctx.openai_endpoint() as access:
            url, key = f"{access.base_url}/chat/completions", access.api_key
            cases = [
                (None, ok, None), ("af-wrong", ok, None), (key, None, b"{not json"), (key, [1, 2], None),
                (key, {"messages": "hi"}, None), (key, {**ok, "max_tokens": 10**9}, None),
                (key, {**ok, "max_tokens": "many"}, None), (key, {**ok, "n": 3}, None),
                (key, {**ok, "temperature": float("nan")}, None),
                (key, {"messages": [{"role": "wizard", "content": "x"}]}, None),
                (key, {**ok, "model": "gpt-4o"}, None), (key, {**ok, "stop": ["x"] * 100}, None),
                (key, {"messages": [{"role": "user", "content": "x" * 300_000}]}, None),
                (key, None, b'{"messages": [' * 100_000), (key, None, b'{"max_tokens": ' + b"9" * 5000 + b"}"),
                (key, None, b"x" * (5 * 1024 * 1024)),
                (key, {**ok, "tools": [{"type": "function", "function": {"name": "bad name!"}}]}, None),
            ]
            for k, body, raw in cases:
                status, data = await post_json(url, k, body, raw)
                out.append((status, data["error"]["message"]))
            good = [await post_json(url, key, ok) for _ in range(3)]  # max_turns=2: the third is refused
            out += [(s, d.get("error", {}).get("message", "ok")) for s, d in good]
            stale = key
        status, data = await post_json(url, stale, ok)  # the rollout is over
        out.append((status, data["error"]["message"]))
        await endpoint.close()
        return out

    results = asyncio.run(agent())
    statuses = [s for s, _ in results]
    assert statuses == [401, 401, 400, 400, 400, 400, 400, 400, 400, 400, 404, 400, 400, 400, 400, 413, 400, 200, 200,
                        429, 401]
    text = "\n".join(m for _, m in results)
    for phrase in ["missing API key", "not valid", "not valid JSON", "must be a JSON object",
                   "messages must be a non-empty list", "max_tokens=1000000000 must be between 1 and 64",
                   "max_tokens must be an integer", "only n=1", "temperature", "role='wizard'",
                   "'gpt-4o' is not a policy", "at most 16", "at most 200000 are accepted", "over 4194304 bytes",
                   "allows 2 model calls", "rollout has ended"]:
        assert phrase in text, phrase
    assert len(ctx.segments) == 4  # only the two calls served were recorded


def test_streaming_answers_server_sent_events(tiny_model_dir: Path) -> None:
    backend = char_backend(tiny_model_dir, ["streamed"])
    endpoint = AgentEndpoint()
    ctx = rollout_ctx(backend, endpoint)

    async def agent() -> str:
        async with ctx.openai_endpoint() as access, aiohttp.ClientSession() as s, s.post(
                f"{access.base_url}/chat/completions", headers={"Authorization": f"Bearer {access.api_key}"},
                json={"messages": [{"role": "user", "content": "hi"}], "stream": True}) as r:
            assert r.headers["Content-Type"].startswith("text/event-stream")
            body = await r.text()
        await endpoint.close()
        return body

    events = [line[6:] for line in asyncio.run(agent()).splitlines() if line.startswith("data: ")]
    assert events[-1] == "[DONE]"
    assert json.loads(events[0])["choices"][0]["delta"]["content"] == "streamed"


AGENT_PROCESS = textwrap.dedent("""
    import json, os, sys, urllib.request
    base, key = os.environ["OPENAI_BASE_URL"], os.environ["OPENAI_API_KEY"]
    def chat(messages):
        req = urllib.request.Request(base + "/chat/completions", json.dumps({"model": os.environ["OPENAI_MODEL"],
            "messages": messages, "tools": [TOOL]}).encode(), {"Authorization": "Bearer " + key,
            "Content-Type": "application/json"})
        return json.load(urllib.request.urlopen(req))["choices"][0]["message"]
    TOOL = {"type": "function", "function": {"name": "sql", "parameters": {"type": "object",
            "properties": {"query": {"type": "string"}}}}}
    messages = [{"role": "user", "content": "How many?"}]
    m = chat(messages)
    messages += [m, {"role": "tool", "tool_call_id": m["tool_calls"][0]["id"], "content": "7"}]
    print(chat(messages)["content"])
""")


def test_an_agent_in_a_separate_process_with_only_the_stdlib(tiny_model_dir: Path) -> None:
    backend = char_backend(tiny_model_dir, ["<sql>SELECT COUNT(*) FROM t</sql>", "Answer: 7"])
    endpoint = AgentEndpoint()
    ctx = rollout_ctx(backend, endpoint)

    async def run() -> str:
        async with ctx.openai_endpoint() as access:
            proc = await asyncio.create_subprocess_exec(sys.executable, "-c", AGENT_PROCESS, env=access.env(),
                                                        stdout=subprocess.PIPE, stderr=subprocess.PIPE)
            out, err = await proc.communicate()
            assert proc.returncode == 0, err.decode()
        await endpoint.close()
        return out.decode().strip()

    assert asyncio.run(run()) == "Answer: 7"
    assert [s.role for s in ctx.segments] == ["prompt", "assistant", "tool", "assistant"]
    assert ctx.segments[1].token_ids.tolist() == backend.sampled[0]
    assert ctx.tool_calls[0].name == "sql" and ctx.tool_calls[0].result == "7"


def test_a_prompt_over_the_context_is_refused_before_anything_is_recorded(tiny_model_dir: Path) -> None:
    backend = char_backend(tiny_model_dir, ["short", "fits"], context_length=60)
    endpoint = AgentEndpoint()
    ctx = rollout_ctx(backend, endpoint)  # the task's max_tokens: 64
    short = [{"role": "user", "content": "hi"}]

    async def agent() -> list[tuple[int, dict]]:
        async with ctx.openai_endpoint() as access:
            chat, comp, key = f"{access.base_url}/chat/completions", f"{access.base_url}/completions", access.api_key
            out = [await post_json(chat, key, {"messages": [{"role": "user", "content": "word " * 300}]}),
                   await post_json(chat, key, {"messages": short, "max_tokens": 64}),  # prompt + 64 > 60
                   await post_json(comp, key, {"prompt": "word " * 300}),
                   await post_json(chat, key, {"messages": short}),  # no max_tokens: cut to what is left
                   await post_json(comp, key, {"prompt": "Q: hi\nA:", "max_tokens": 20})]
        await endpoint.close()
        return out

    results = asyncio.run(agent())
    assert [s for s, _ in results] == [400, 400, 400, 200, 200]
    for _, body in results[:3]:
        assert body["error"]["code"] == "context_length_exceeded" and "context of 60 tokens" in body["error"]["message"]
    assert results[0][1]["error"]["param"] == "messages" and results[2][1]["error"]["param"] == "prompt"
    assert "in the messages, 64 in the completion" in results[1][1]["error"]["message"]
    prompt = len(backend.requests[0].prompt_ids)
    assert backend.requests[0].max_tokens == 60 - prompt and backend.requests[1].max_tokens == 20
    assert [s.role for s in ctx.segments] == ["prompt", "assistant", "prompt", "assistant"]  # the refused left nothing


def test_logprobs_are_the_recorded_ones_and_absurd_values_are_refused(tiny_model_dir: Path) -> None:
    backend = char_backend(tiny_model_dir, ["chat", "text"])
    endpoint = AgentEndpoint()
    ctx = rollout_ctx(backend, endpoint)
    msgs = [{"role": "user", "content": "hi"}]

    async def agent() -> list[tuple[int, dict]]:
        async with ctx.openai_endpoint() as access:
            chat, comp, key = f"{access.base_url}/chat/completions", f"{access.base_url}/completions", access.api_key
            bad = [await post_json(chat, key, {"messages": msgs, **extra}) for extra in (
                {"logprobs": "yes"}, {"logprobs": True, "top_logprobs": 50}, {"logprobs": True, "top_logprobs": 3},
                {"top_logprobs": 0}, {"logprobs": True, "top_logprobs": 1.5})]
            bad += [await post_json(comp, key, {"prompt": "x", "logprobs": n}) for n in (3, -1, 99, True, "0")]
            good = [await post_json(chat, key, {"messages": msgs, "logprobs": True, "top_logprobs": 0}),
                    await post_json(comp, key, {"prompt": "Q: hi\nA:", "logprobs": 0, "max_tokens": 8})]
        await endpoint.close()
        return bad + good

    results = asyncio.run(agent())
    assert [s for s, _ in results] == [400] * 10 + [200, 200]
    text = "\n".join(d["error"]["message"] for _, d in results[:10])
    for phrase in ["logprobs='yes' must be true or false", "top_logprobs=50 must be between 0 and 20",
                   "top_logprobs=3 is not served", "top_logprobs needs logprobs=true", "top_logprobs must be an integer",
                   "logprobs=3 is not served", "logprobs=-1 must be between 0 and 5", "logprobs=99",
                   "logprobs must be an integer, got 'True'"]:
        assert phrase in text, phrase
    chat_lp, comp_lp = results[10][1]["choices"][0]["logprobs"], results[11][1]["choices"][0]["logprobs"]
    assistant = [s for s in ctx.segments if s.role == "assistant"]
    entries = chat_lp["content"]
    assert [e["logprob"] for e in entries] == pytest.approx(assistant[0].logprobs.tolist())
    assert "".join(e["token"] for e in entries) == backend.tok.decode(backend.sampled[0], skip_special_tokens=False)
    assert all(e["bytes"] == list(e["token"].encode()) and e["top_logprobs"] == [] for e in entries)
    assert comp_lp["token_logprobs"] == pytest.approx(assistant[1].logprobs.tolist())
    assert len(comp_lp["tokens"]) == len(backend.sampled[1]) and comp_lp["text_offset"][0] == len("Q: hi\nA:")
