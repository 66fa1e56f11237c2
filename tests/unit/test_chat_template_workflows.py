"""Workflows render prompts through the model's chat template (system prompt from the task, tools
in the model's format, sampled ids never re-tokenised); models without a template keep the
plain-text protocol. The chat model is the tiny model with a Qwen2.5-style template
(`chat_model_dir` in conftest): nothing is downloaded."""

from __future__ import annotations

import asyncio
from pathlib import Path

import numpy as np
from helpers import ScriptedBackend

from astraflow.raas.tools import ToolBox, calculator
from astraflow.raas.workflows import WORKFLOWS, RolloutContext
from astraflow.records import NodeInfo, SamplingParams
from astraflow.testing import make_task

SYSTEM = "Reason step by step and put the final answer in \\boxed{}."


def context(backend: object, workflow: str, prompt: str, system: str | None, tools: ToolBox | None = None) -> RolloutContext:
    task = make_task(1)
    task.workflow, task.prompt = workflow, prompt
    task.sampling = SamplingParams(max_tokens=32, max_turns=3)
    task.metadata = {"system_prompt": system} if system else {}
    return RolloutContext(task, 0, {task.policies[0]: backend}, tools or ToolBox({}), NodeInfo("n", "cpu", "local", "t"))


def test_chat_template_rlvr_prompt_is_the_template_rendering_with_the_system_prompt(chat_model_dir: Path) -> None:
    from astraflow.raas.backends.torch_backend import TorchBackend

    backend = TorchBackend("policy", str(chat_model_dir), seed=0, max_batch=2, threads=1)
    try:
        ctx = context(backend, "rlvr", "What is 2+3?", SYSTEM)
        ctx.backends = {ctx.task.policies[0]: backend}
        traj = asyncio.run(WORKFLOWS["rlvr"](ctx))
    finally:
        backend.close()
    tok = backend.tokenizer
    expected = tok.apply_chat_template([{"role": "system", "content": SYSTEM}, {"role": "user", "content": "What is 2+3?"}],
                                       tokenize=False, add_generation_prompt=True)
    prompt, answer = traj.segments
    assert prompt.role == "prompt" and prompt.token_ids.tolist() == tok.encode(expected, add_special_tokens=False)
    assert tok.decode(prompt.token_ids, skip_special_tokens=False) == expected
    assert expected.startswith(f"<|im_start|>system\n{SYSTEM}<|im_end|>") and expected.endswith("<|im_start|>assistant\n")
    assert answer.role == "assistant" and len(answer.token_ids) > 0 and answer.loss_mask.all()


def test_chat_template_tool_calls_in_the_model_format_and_sampled_ids_kept(chat_model_dir: Path) -> None:
    call = '<tool_call>\n{"name": "calc", "arguments": {"expression": "2+3"}}\n</tool_call>'
    backend = ScriptedBackend("policy", chat_model_dir, [call, "So the answer is \\boxed{5}."], per_char=True, eos=True)
    ctx = context(backend, "tool_use", "What is 2+3?", SYSTEM, ToolBox({"calc": calculator}))
    ctx.backends = {ctx.task.policies[0]: backend}
    traj = asyncio.run(WORKFLOWS["tool_use"](ctx))
    tok = backend.tok
    assert [(c.name, c.arguments, c.result, c.error) for c in traj.tool_calls] == [("calc", "2+3", "5", None)]
    assert [s.role for s in traj.segments] == ["prompt", "assistant", "tool", "assistant"]
    first, second = backend.requests
    assert first.stop[:1] == ["</tool_call>"]  # the model's call format ends its turn
    prompt_text = tok.decode(first.prompt_ids, skip_special_tokens=False)
    assert '"name": "calc"' in prompt_text and "<tools>" in prompt_text and SYSTEM in prompt_text
    # the second prompt: the first, the ids the model sampled (one per character: no tokenizer gives
    # those), then the template's tool turn; nothing re-tokenised
    segs = traj.segments
    assert segs[1].token_ids.tolist() == backend.sampled[0] != tok.encode(call, add_special_tokens=False)
    assert np.concatenate([s.token_ids for s in segs[:3]]).tolist() == second.prompt_ids
    conv = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": "What is 2+3?"},
            {"role": "assistant", "content": call}, {"role": "tool", "content": "5"}]
    from astraflow.raas.workflows.chat import tool_spec

    assert tok.decode(second.prompt_ids, skip_special_tokens=False) == tok.apply_chat_template(
        conv, tools=[tool_spec("calc")], tokenize=False, add_generation_prompt=True)
    assert tok.decode(segs[2].token_ids, skip_special_tokens=False).startswith("\n<|im_start|>user\n<tool_response>\n5\n")
    assert not segs[2].loss_mask.any() and segs[3].loss_mask.all()
    assert traj.final_answer is not None and "\\boxed{5}" in traj.final_answer


def test_chat_template_absent_keeps_the_plain_text_protocol(tiny_model_dir: Path) -> None:
    for system, text in [(None, "What is 2+3?"), ("Be brief.", "Be brief.\nWhat is 2+3?")]:
        backend = ScriptedBackend("policy", tiny_model_dir, ["<calc>2+3</calc>", "Answer: 5"])
        ctx = context(backend, "tool_use", "What is 2+3?", system, ToolBox({"calc": calculator}))
        ctx.backends = {ctx.task.policies[0]: backend}
        traj = asyncio.run(WORKFLOWS["tool_use"](ctx))
        assert backend.requests[0].prompt_ids == backend.encode(text, add_bos=True)
        assert backend.requests[0].stop[:1] == ["</calc>"]
        assert traj.segments[2].text == "<result>5</result>" and traj.final_answer == "5"
