"""The per-rollout OpenAI endpoint without a broker: chat templates render the messages and keep the
sampled ids; a template that fails is a clear 400.

The backend is a scripted test double that returns fixed token ids through the real tokenizer
(so a test can make the model "sample" ids that re-tokenising the text would not give); the
endpoint, the sessions, the HTTP server and the agents' HTTP clients are the real code
(`agent_api_fakes`).
"""

from __future__ import annotations

import asyncio
from pathlib import Path

import numpy as np
from agent_api_fakes import SQL_TOOL, char_backend, post_json, rollout_ctx

from astraflow.raas.agent_api import AgentEndpoint

CHATML = ("{% for m in messages %}<|im_start|>{{ m.role }}\n{{ m.content }}{{ eos_token }}\n{% endfor %}"
          "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")


def test_chat_template_renders_messages_and_keeps_the_sampled_ids(tiny_model_dir: Path, tmp_path: Path) -> None:
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(tiny_model_dir)
    assert not getattr(tok, "chat_template", None)  # the project's own format is the other case (tests above)
    tok.chat_template = CHATML
    tok.save_pretrained(tmp_path)  # a model directory whose tokenizer has a template (nothing downloaded)
    backend = char_backend(tmp_path, ["<sql>SELECT 1</sql>", "Answer: 1"])
    endpoint = AgentEndpoint()
    ctx = rollout_ctx(backend, endpoint)

    async def agent() -> list[dict]:
        async with ctx.openai_endpoint() as access:
            url = f"{access.base_url}/chat/completions"
            messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "What is 1?"}]
            _, first = await post_json(url, access.api_key, {"messages": messages, "tools": [SQL_TOOL]})
            message = first["choices"][0]["message"]
            messages += [message, {"role": "tool", "tool_call_id": message["tool_calls"][0]["id"], "content": "1"}]
            status, second = await post_json(url, access.api_key, {"messages": messages, "tools": [SQL_TOOL]})
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
    backend = char_backend(tmp_path, ["ok"])
    endpoint = AgentEndpoint()
    ctx = rollout_ctx(backend, endpoint)

    async def agent() -> list[tuple[int, dict]]:
        async with ctx.openai_endpoint() as access:
            url = f"{access.base_url}/chat/completions"
            out = [await post_json(url, access.api_key, {"messages": [{"role": "system", "content": "s"}]}),
                   await post_json(url, access.api_key, {"messages": [{"role": "user", "content": "u"}]})]
        await endpoint.close()
        return out

    (s1, b1), (s2, _) = asyncio.run(agent())
    assert (s1, s2) == (400, 200)
    assert "chat template cannot render these messages" in b1["error"]["message"] and "no system role" in b1["error"]["message"]
