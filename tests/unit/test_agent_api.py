"""The per-rollout OpenAI endpoint without a broker: agents over plain HTTP, exact tokens, refusals.

The backend is a scripted test double that returns fixed token ids through the real tokenizer
(so a test can make the model "sample" ids that re-tokenising the text would not give); the
endpoint, the sessions, the HTTP server and the agents' HTTP clients are the real code.
"""

from __future__ import annotations

import asyncio
import json
import subprocess
import sys
import textwrap
from pathlib import Path

import aiohttp
import numpy as np
import pytest

from astraflow.dataflow.sequences import policy_sequences, sequence_sample_id
from astraflow.raas.agent_api import AgentEndpoint
from astraflow.raas.backends.base import GenerateRequest, Generation
from astraflow.raas.tools import ToolBox
from astraflow.raas.workflows import RolloutContext
from astraflow.records import NodeInfo, SamplingParams
from astraflow.testing import make_task


class CharBackend:
    """Returns each scripted text as one token id per character (not how the tokenizer would
    split it), logprobs -0.25, -0.26, ... and the current version."""

    name = "scripted"

    def __init__(self, policy: str, model_dir: Path, script: list[str], version: int = 5,
                 context_length: int | None = None) -> None:
        from transformers import AutoTokenizer

        self.policy, self.version, self.script = policy, version, list(script)
        self.tokenizer = self.tok = AutoTokenizer.from_pretrained(model_dir)
        self.context_length = context_length
        self.requests: list[GenerateRequest] = []
        self.sampled: list[list[int]] = []

    def encode(self, text: str, *, add_bos: bool = False) -> list[int]:
        return self.tok.encode(text, add_special_tokens=add_bos)

    def decode(self, ids) -> str:
        return self.tok.decode([int(i) for i in ids], skip_special_tokens=True)

    async def generate(self, request: GenerateRequest) -> Generation:
        self.requests.append(request)
        text = self.script.pop(0)
        ids = [t for ch in text for t in self.encode(ch)] + [self.tok.eos_token_id]
        self.sampled.append(ids)
        n = len(ids)
        logprobs = -0.25 - 0.01 * np.arange(n, dtype=np.float32)
        return Generation(np.asarray(ids, np.int32), logprobs, np.full(n, self.version, np.int32), text, "stop")

    def hardware(self) -> str:
        return "test"

    def update_weights(self, state_dict, version: int) -> None:
        self.version = version

    def close(self) -> None:
        pass


def _ctx(backend: CharBackend, endpoint: AgentEndpoint, max_turns: int = 8) -> RolloutContext:
    task = make_task(1)
    task.sampling = SamplingParams(max_tokens=64, max_turns=max_turns)
    return RolloutContext(task, 0, {"policy": backend}, ToolBox({}), NodeInfo("n", "cpu", "local", "scripted"),
                          agent_api=endpoint)


async def _post(url: str, key: str | None, body: object, raw: bytes | None = None) -> tuple[int, dict]:
    headers = {"Authorization": f"Bearer {key}"} if key else {}
    async with aiohttp.ClientSession() as s, s.post(url, data=raw if raw is not None else json.dumps(body),
                                                    headers={**headers, "Content-Type": "application/json"}) as r:
        return r.status, await r.json(content_type=None)


SQL_TOOL = {"type": "function", "function": {"name": "sql", "parameters": {
    "type": "object", "properties": {"query": {"type": "string"}}}}}


def test_chat_with_a_tool_records_exactly_the_sampled_ids(tiny_model_dir: Path) -> None:
    backend = CharBackend("policy", tiny_model_dir, ["<sql>SELECT 1</sql>", "Answer: hello"])
    endpoint = AgentEndpoint()
    ctx = _ctx(backend, endpoint)

    async def agent() -> tuple[dict, dict]:
        async with ctx.openai_endpoint() as access:
            assert access.base_url.startswith("http://127.0.0.1:")
            url = f"{access.base_url}/chat/completions"
            messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "What is 1?"}]
            status, first = await _post(url, access.api_key, {"model": "policy", "messages": messages, "tools": [SQL_TOOL]})
            assert status == 200, first
            message = first["choices"][0]["message"]
            messages += [message, {"role": "tool", "tool_call_id": message["tool_calls"][0]["id"], "content": "1"}]
            status, second = await _post(url, access.api_key, {"messages": messages, "tools": [SQL_TOOL]})
            assert status == 200, second
        await endpoint.close()
        return first, second

    first, second = asyncio.run(agent())
    call = first["choices"][0]["message"]["tool_calls"][0]
    assert first["choices"][0]["finish_reason"] == "tool_calls"
    assert call["function"]["name"] == "sql" and json.loads(call["function"]["arguments"]) == {"query": "SELECT 1"}
    assert second["choices"][0]["message"]["content"] == "Answer: hello"

    segs = ctx.segments
    assert [s.role for s in segs] == ["prompt", "assistant", "tool", "assistant"]
    # the ids the model sampled, not what re-tokenising their text gives
    for seg, sampled in zip([segs[1], segs[3]], backend.sampled, strict=True):
        assert seg.token_ids.tolist() == sampled
        assert seg.loss_mask.all() and (seg.versions == 5).all()
        assert np.allclose(seg.logprobs, -0.25 - 0.01 * np.arange(len(sampled)))
        assert backend.encode(seg.text) != sampled[:-1]
    for seg in (segs[0], segs[2]):
        assert seg.loss_mask.sum() == 0 and (seg.versions == -1).all() and (seg.logprobs == 0).all()
    # the second call's prompt is exactly the recorded sequence so far
    assert backend.requests[1].prompt_ids == np.concatenate([s.token_ids for s in segs[:3]]).tolist()
    assert segs[2].text == "<result>1</result>"
    (tc,) = ctx.tool_calls
    assert (tc.name, tc.arguments, tc.result, tc.error) == ("sql", json.dumps({"query": "SELECT 1"}), "1", None)
    assert [sequence_sample_id("t/0", "policy", i) for i, _ in enumerate(policy_sequences(ctx.finish("x"), "policy"))] == ["t/0#policy"]


def test_rewritten_history_starts_a_new_sequence_with_its_own_sample_id(tiny_model_dir: Path) -> None:
    backend = CharBackend("policy", tiny_model_dir, ["first", "second", "third"])
    endpoint = AgentEndpoint()
    ctx = _ctx(backend, endpoint)

    async def agent() -> None:
        async with ctx.openai_endpoint() as access:
            url = f"{access.base_url}/chat/completions"
            msgs = [{"role": "user", "content": "Start."}]
            _, r1 = await _post(url, access.api_key, {"messages": msgs})
            msgs += [r1["choices"][0]["message"], {"role": "user", "content": "Go on."}]
            await _post(url, access.api_key, {"messages": msgs})  # extends: same sequence
            summary = [{"role": "user", "content": "Summary: first. Go on."}]  # history rewritten
            await _post(url, access.api_key, {"messages": summary})
        await endpoint.close()

    asyncio.run(agent())
    traj = ctx.finish("done")
    seqs = policy_sequences(traj, "policy")
    assert [[s.role for s in q] for q in seqs] == [["prompt", "assistant", "user", "assistant"], ["prompt", "assistant"]]
    ids = [sequence_sample_id(traj.trajectory_id, "policy", i) for i in range(len(seqs))]
    assert len(set(ids)) == 2 and ids[0] == f"{traj.trajectory_id}#policy"
    # each sequence is exactly what the model was given, then what it sampled
    for q, req in zip([seqs[0][:3], seqs[1][:1]], [backend.requests[1], backend.requests[2]], strict=True):
        assert np.concatenate([s.token_ids for s in q]).tolist() == req.prompt_ids


def test_completions_extend_by_text_without_retokenising(tiny_model_dir: Path) -> None:
    backend = CharBackend("policy", tiny_model_dir, ["hello", "world"])
    endpoint = AgentEndpoint()
    ctx = _ctx(backend, endpoint)

    async def agent() -> None:
        async with ctx.openai_endpoint() as access:
            url = f"{access.base_url}/completions"
            status, r1 = await _post(url, access.api_key, {"prompt": "Q: hi\nA:", "max_tokens": 8})
            assert status == 200 and r1["choices"][0]["text"] == "hello"
            await _post(url, access.api_key, {"prompt": "Q: hi\nA:" + "hello" + " more", "max_tokens": 8})
        await endpoint.close()

    asyncio.run(agent())
    assert [s.role for s in ctx.segments] == ["prompt", "assistant", "user", "assistant"]
    assert ctx.segments[1].token_ids.tolist() == backend.sampled[0]
    assert backend.requests[1].prompt_ids[: len(backend.requests[0].prompt_ids) + len(backend.sampled[0])] == (
        backend.requests[0].prompt_ids + backend.sampled[0])


def test_bad_requests_are_refused_with_clear_errors_and_the_endpoint_goes_on(tiny_model_dir: Path) -> None:
    backend = CharBackend("policy", tiny_model_dir, ["ok"] * 3)
    endpoint = AgentEndpoint()
    ctx = _ctx(backend, endpoint, max_turns=2)
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
                status, data = await _post(url, k, body, raw)
                out.append((status, data["error"]["message"]))
            good = [await _post(url, key, ok) for _ in range(3)]  # max_turns=2: the third is refused
            out += [(s, d.get("error", {}).get("message", "ok")) for s, d in good]
            stale = key
        status, data = await _post(url, stale, ok)  # the rollout is over
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
    backend = CharBackend("policy", tiny_model_dir, ["streamed"])
    endpoint = AgentEndpoint()
    ctx = _ctx(backend, endpoint)

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
    backend = CharBackend("policy", tiny_model_dir, ["<sql>SELECT COUNT(*) FROM t</sql>", "Answer: 7"])
    endpoint = AgentEndpoint()
    ctx = _ctx(backend, endpoint)

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
    backend = CharBackend("policy", tiny_model_dir, ["short", "fits"], context_length=60)
    endpoint = AgentEndpoint()
    ctx = _ctx(backend, endpoint)  # the task's max_tokens: 64
    short = [{"role": "user", "content": "hi"}]

    async def agent() -> list[tuple[int, dict]]:
        async with ctx.openai_endpoint() as access:
            chat, comp, key = f"{access.base_url}/chat/completions", f"{access.base_url}/completions", access.api_key
            out = [await _post(chat, key, {"messages": [{"role": "user", "content": "word " * 300}]}),
                   await _post(chat, key, {"messages": short, "max_tokens": 64}),  # prompt + 64 > 60
                   await _post(comp, key, {"prompt": "word " * 300}),
                   await _post(chat, key, {"messages": short}),  # no max_tokens: cut to what is left
                   await _post(comp, key, {"prompt": "Q: hi\nA:", "max_tokens": 20})]
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
    backend = CharBackend("policy", tiny_model_dir, ["chat", "text"])
    endpoint = AgentEndpoint()
    ctx = _ctx(backend, endpoint)
    msgs = [{"role": "user", "content": "hi"}]

    async def agent() -> list[tuple[int, dict]]:
        async with ctx.openai_endpoint() as access:
            chat, comp, key = f"{access.base_url}/chat/completions", f"{access.base_url}/completions", access.api_key
            bad = [await _post(chat, key, {"messages": msgs, **extra}) for extra in (
                {"logprobs": "yes"}, {"logprobs": True, "top_logprobs": 50}, {"logprobs": True, "top_logprobs": 3},
                {"top_logprobs": 0}, {"logprobs": True, "top_logprobs": 1.5})]
            bad += [await _post(comp, key, {"prompt": "x", "logprobs": n}) for n in (3, -1, 99, True, "0")]
            good = [await _post(chat, key, {"messages": msgs, "logprobs": True, "top_logprobs": 0}),
                    await _post(comp, key, {"prompt": "Q: hi\nA:", "logprobs": 0, "max_tokens": 8})]
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


CHATML = ("{% for m in messages %}<|im_start|>{{ m.role }}\n{{ m.content }}{{ eos_token }}\n{% endfor %}"
          "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")


def test_chat_template_renders_messages_and_keeps_the_sampled_ids(tiny_model_dir: Path, tmp_path: Path) -> None:
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(tiny_model_dir)
    assert not getattr(tok, "chat_template", None)  # the project's own format is the other case (tests above)
    tok.chat_template = CHATML
    tok.save_pretrained(tmp_path)  # a model directory whose tokenizer has a template (nothing downloaded)
    backend = CharBackend("policy", tmp_path, ["<sql>SELECT 1</sql>", "Answer: 1"])
    endpoint = AgentEndpoint()
    ctx = _ctx(backend, endpoint)

    async def agent() -> list[dict]:
        async with ctx.openai_endpoint() as access:
            url = f"{access.base_url}/chat/completions"
            messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "What is 1?"}]
            _, first = await _post(url, access.api_key, {"messages": messages, "tools": [SQL_TOOL]})
            message = first["choices"][0]["message"]
            messages += [message, {"role": "tool", "tool_call_id": message["tool_calls"][0]["id"], "content": "1"}]
            status, second = await _post(url, access.api_key, {"messages": messages, "tools": [SQL_TOOL]})
            assert status == 200, second
        await endpoint.close()
        return messages

    messages = asyncio.run(agent())
    first_prompt = tok.apply_chat_template(messages[:2], tokenize=False, add_generation_prompt=True)
    assert backend.requests[0].prompt_ids == tok.encode(first_prompt, add_special_tokens=False)
    # the second prompt is the template's text of the whole conversation, with the sampled ids in it
    conv = [*messages[:2], {"role": "assistant", "content": "<sql>SELECT 1</sql>"}, {"role": "tool", "content": "1"}]
    second_ids = backend.requests[1].prompt_ids
    assert tok.decode(second_ids, skip_special_tokens=False) == tok.apply_chat_template(
        conv, tokenize=False, add_generation_prompt=True)
    assert second_ids != tok.encode(tok.decode(second_ids, skip_special_tokens=False), add_special_tokens=False)
    segs = ctx.segments
    assert [s.role for s in segs] == ["prompt", "assistant", "tool", "assistant"]  # one sequence
    assert segs[1].token_ids.tolist() == backend.sampled[0] and segs[3].token_ids.tolist() == backend.sampled[1]
    assert np.concatenate([s.token_ids for s in segs[:3]]).tolist() == second_ids


def test_a_chat_template_that_fails_is_a_clear_400(tiny_model_dir: Path, tmp_path: Path) -> None:
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(tiny_model_dir)
    tok.chat_template = "{% for m in messages %}{% if m.role == 'system' %}{{ raise_exception('no system role') }}" \
                        "{% endif %}{{ m.content }}{% endfor %}"
    tok.save_pretrained(tmp_path)
    backend = CharBackend("policy", tmp_path, ["ok"])
    endpoint = AgentEndpoint()
    ctx = _ctx(backend, endpoint)

    async def agent() -> list[tuple[int, dict]]:
        async with ctx.openai_endpoint() as access:
            url = f"{access.base_url}/chat/completions"
            out = [await _post(url, access.api_key, {"messages": [{"role": "system", "content": "s"}]}),
                   await _post(url, access.api_key, {"messages": [{"role": "user", "content": "u"}]})]
        await endpoint.close()
        return out

    (s1, b1), (s2, _) = asyncio.run(agent())
    assert (s1, s2) == (400, 200)
    assert "chat template cannot render these messages" in b1["error"]["message"] and "no system role" in b1["error"]["message"]
