"""The per-rollout OpenAI endpoint without a broker: what it records, exactly the sampled token ids,
and how a conversation becomes training sequences.

The backend is a scripted test double that returns fixed token ids through the real tokenizer
(so a test can make the model "sample" ids that re-tokenising the text would not give); the
endpoint, the sessions, the HTTP server and the agents' HTTP clients are the real code
(`agent_api_fakes`).
"""

from __future__ import annotations

import asyncio
import json
from pathlib import Path

import numpy as np
from agent_api_fakes import SQL_TOOL, char_backend, post_json, rollout_ctx

from astraflow.dataflow.sequences import policy_sequences, sequence_sample_id
from astraflow.raas.agent_api import AgentEndpoint


def test_chat_with_a_tool_records_exactly_the_sampled_ids(tiny_model_dir: Path) -> None:
    backend = char_backend(tiny_model_dir, ["<sql>SELECT 1</sql>", "Answer: hello"])
    endpoint = AgentEndpoint()
    ctx = rollout_ctx(backend, endpoint)

    async def agent() -> tuple[dict, dict]:
        async with ctx.openai_endpoint() as access:
            assert access.base_url.startswith("http://127.0.0.1:")
            url = f"{access.base_url}/chat/completions"
            messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "What is 1?"}]
            status, first = await post_json(url, access.api_key, {"model": "policy", "messages": messages, "tools": [SQL_TOOL]})
            assert status == 200, first
            message = first["choices"][0]["message"]
            messages += [message, {"role": "tool", "tool_call_id": message["tool_calls"][0]["id"], "content": "1"}]
            status, second = await post_json(url, access.api_key, {"messages": messages, "tools": [SQL_TOOL]})
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
    backend = char_backend(tiny_model_dir, ["first", "second", "third"])
    endpoint = AgentEndpoint()
    ctx = rollout_ctx(backend, endpoint)

    async def agent() -> None:
        async with ctx.openai_endpoint() as access:
            url = f"{access.base_url}/chat/completions"
            msgs = [{"role": "user", "content": "Start."}]
            _, r1 = await post_json(url, access.api_key, {"messages": msgs})
            msgs += [r1["choices"][0]["message"], {"role": "user", "content": "Go on."}]
            await post_json(url, access.api_key, {"messages": msgs})  # extends: same sequence
            summary = [{"role": "user", "content": "Summary: first. Go on."}]  # history rewritten
            await post_json(url, access.api_key, {"messages": summary})
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
    backend = char_backend(tiny_model_dir, ["hello", "world"])
    endpoint = AgentEndpoint()
    ctx = rollout_ctx(backend, endpoint)

    async def agent() -> None:
        async with ctx.openai_endpoint() as access:
            url = f"{access.base_url}/completions"
            status, r1 = await post_json(url, access.api_key, {"prompt": "Q: hi\nA:", "max_tokens": 8})
            assert status == 200 and r1["choices"][0]["text"] == "hello"
            await post_json(url, access.api_key, {"prompt": "Q: hi\nA:" + "hello" + " more", "max_tokens": 8})
        await endpoint.close()

    asyncio.run(agent())
    assert [s.role for s in ctx.segments] == ["prompt", "assistant", "user", "assistant"]
    assert ctx.segments[1].token_ids.tolist() == backend.sampled[0]
    assert backend.requests[1].prompt_ids[: len(backend.requests[0].prompt_ids) + len(backend.sampled[0])] == (
        backend.requests[0].prompt_ids + backend.sampled[0])
