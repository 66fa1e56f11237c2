"""The vLLM backend on a real vLLM engine (its CPU build in CI): sampling, logprobs, multi-turn, bad input.

One engine per module (`vllm_backend` in tests/conftest.py). Log-probabilities are compared with
what the trainer computes on the same tokens (`astraflow.rl.logprobs.sequence_logprobs` on the
transformers model of the same directory): in float32 on the CPU build the largest difference
measured was below 1e-5 (`LOGPROB_TOL` leaves room for other CPUs' kernels).
"""

from __future__ import annotations

import asyncio
import math
from pathlib import Path

import numpy as np
import pytest
import torch

from astraflow.raas.backends.base import GenerateRequest, Generation
from astraflow.raas.backends.vllm_backend import VllmBackend, VllmBackendError
from astraflow.rl.logprobs import sequence_logprobs

LOGPROB_TOL = 1e-3  # |vLLM processed logprob - trainer's recomputation|, float32 (measured: < 1e-5)


@pytest.fixture(scope="module")
def hf_model(untied_model_dir: Path):
    from astraflow.models.tiny import load_tiny

    return load_tiny(untied_model_dir)[0]


def _gather(b: VllmBackend, reqs: list[GenerateRequest]) -> list[Generation]:
    async def go() -> list[Generation]:
        return list(await asyncio.gather(*(b.generate(r) for r in reqs)))

    return asyncio.run(go())


def _trainer_logprobs(model, prompt: list[int], gen: Generation, temperature: float, top_p: float = 1.0) -> np.ndarray:
    """The trainer's logprobs of `gen`'s tokens at `temperature`, renormalised over the top-p
    nucleus as the node records them (sampling.py); also checks each token lies in its nucleus."""
    ids = torch.tensor([prompt + gen.token_ids.tolist()])
    with torch.no_grad():
        logits = model(ids).logits.float()
    lp = sequence_logprobs(logits, ids, torch.tensor([temperature]))[0, len(prompt):]
    if top_p < 1.0:
        probs = torch.softmax(logits[0, len(prompt) - 1:-1] / temperature, -1)
        sorted_p, order = probs.sort(-1, descending=True)
        keep = (sorted_p.cumsum(-1) - sorted_p) < top_p
        kept = (sorted_p * keep).sum(-1)
        rank = (order == torch.tensor(gen.token_ids, dtype=torch.long)[:, None]).float().argmax(-1)
        assert bool(keep.gather(-1, rank[:, None]).all()), "vLLM sampled a token outside the top-p nucleus"
        lp = lp - kept.log()
    return lp.numpy()


def test_n_samples_per_prompt_temperature_and_logprobs_match_the_trainer(vllm_backend, hf_model) -> None:
    prompt = vllm_backend.encode("Q: What is 12+7?\nA:", add_bos=True)
    worst = 0.0
    for temperature, top_p in ((1.0, 1.0), (0.7, 1.0), (1.3, 0.9)):
        gens = _gather(vllm_backend, [GenerateRequest(prompt, 24, temperature, top_p) for _ in range(4)])
        assert len({tuple(g.token_ids.tolist()) for g in gens}) > 1, "four samples at T>0 were all equal"
        for g in gens:
            assert len(g.token_ids) == len(g.logprobs) == len(g.versions) > 0
            assert (g.versions == vllm_backend.version).all() and g.finish_reason in ("stop", "length")
            diff = np.abs(g.logprobs - _trainer_logprobs(hf_model, prompt, g, temperature, top_p)).max()
            worst = max(worst, float(diff))
    print(f"largest |vLLM processed logprob - trainer recomputation|: {worst:.2e}")
    assert worst < LOGPROB_TOL


def test_stop_strings_end_the_completion_and_are_kept(vllm_backend) -> None:
    prompt = vllm_backend.encode("Q: What is 3*4?\nA:", add_bos=True)
    (free,) = _gather(vllm_backend, [GenerateRequest(prompt, 40, 0.0)])
    text = free.text
    assert len(text) > 6, text
    stop = text[len(text) // 2:len(text) // 2 + 3]
    if not stop.strip():
        stop = text.strip()[-3:]
    (stopped,) = _gather(vllm_backend, [GenerateRequest(prompt, 40, 0.0, 1.0, [stop])])
    ids = stopped.token_ids.tolist()
    assert stopped.finish_reason == "stop" and ids == free.token_ids.tolist()[:len(ids)]
    # the last token completes the stop string (it may carry a few characters past it)
    assert stop in stopped.text and stop not in vllm_backend.decode(ids[:-1])


def test_multi_turn_tool_use_passes_generated_tokens_back_as_ids(vllm_backend, hf_model) -> None:
    """Two turns around a real calculator call: the second prompt is the first turn's ids, the
    tool's reply encoded, nothing re-tokenised; the trainer's recomputation over the whole
    sequence agrees with the behaviour logprobs of both turns."""
    from astraflow.dataflow.sequences import policy_sequences
    from astraflow.raas.tools import ToolBox, default_tools
    from astraflow.raas.workflows import RolloutContext
    from astraflow.records import NodeInfo, SamplingParams
    from astraflow.testing import make_task

    task = make_task(1)
    task.sampling = SamplingParams(max_tokens=16, max_turns=2, temperature=0.8)
    seen: list[list[int]] = []

    class Recording:  # the real backend; records the prompts it was asked to continue
        def __init__(self, inner: VllmBackend) -> None:
            self.inner, self.name, self.policy, self.version = inner, inner.name, inner.policy, inner.version

        def encode(self, text, *, add_bos=False):
            return self.inner.encode(text, add_bos=add_bos)

        def decode(self, ids):
            return self.inner.decode(ids)

        async def generate(self, request):
            seen.append(list(request.prompt_ids))
            return await self.inner.generate(request)

    async def two_turns() -> object:
        ctx = RolloutContext(task, 0, {"policy": Recording(vllm_backend)}, ToolBox(default_tools(), 5.0),
                             NodeInfo("n", "cpu", "local", "vllm"))
        first_prompt = ctx.add_context("policy", "prompt", task.prompt, add_bos=True)
        g1 = await ctx.generate("policy")
        call = await ctx.call_tool("calc", "37*12+5", 0)
        reply = ctx.add_context("policy", "tool", f"<result>{call.result}</result>")
        await ctx.generate("policy")
        assert seen[1] == first_prompt + g1.token_ids.tolist() + reply
        return ctx.finish(None)

    traj = asyncio.run(two_turns())
    (seq,) = policy_sequences(traj, "policy")
    ids = [int(t) for s in seq for t in s.token_ids]
    lps = np.concatenate([s.logprobs if s.loss_mask.any() else np.zeros(len(s.token_ids), np.float32) for s in seq])
    mask = np.concatenate([s.loss_mask for s in seq]).astype(bool)
    with torch.no_grad():
        logits = hf_model(torch.tensor([ids])).logits
    ours = sequence_logprobs(logits, torch.tensor([ids]), torch.tensor([0.8]))[0].numpy()
    assert mask.sum() == sum(len(s.token_ids) for s in seq if s.loss_mask.any()) > 0
    assert np.abs(ours[mask] - lps[mask]).max() < LOGPROB_TOL


@pytest.mark.parametrize("request_, why", [
    (GenerateRequest([5] * 600, 8), "does not fit"),
    (GenerateRequest([5, 6], 0), "max_tokens"),
    (GenerateRequest([5, 6], 8, math.nan), "temperature"),
    (GenerateRequest([5, 6], 8, -1.0), "temperature"),
    (GenerateRequest([5, 6], 8, 1.0, 0.0), "top_p"),
    (GenerateRequest([5, 6], 8, 1.0, 1.5), "top_p"),
    (GenerateRequest([5, 6], 8, 1.0, 1.0, [""]), "stop"),
])
def test_bad_requests_are_errors_and_the_engine_keeps_serving(vllm_backend, request_, why) -> None:
    with pytest.raises(VllmBackendError, match=why):
        _gather(vllm_backend, [request_])
    (ok,) = _gather(vllm_backend, [GenerateRequest([1, 5, 6], 4)])
    assert len(ok.token_ids) > 0


def test_greedy_unknown_stop_and_overlong_max_tokens_are_served(vllm_backend) -> None:
    """T=0 decodes greedily; a stop string that never occurs is harmless; max_tokens past the
    context is clamped to what fits (counted) and ends with finish reason "length"."""
    prompt = [1] + [5] * 500
    before = vllm_backend.clamped
    a, b, c = _gather(vllm_backend, [GenerateRequest(prompt[:10], 12, 0.0), GenerateRequest(prompt[:10], 12, 0.0, 1.0, ["\u2603never"]),
                                     GenerateRequest(prompt, 100, 1.0)])
    assert a.token_ids.tolist() == b.token_ids.tolist()
    assert vllm_backend.clamped == before + 1 and c.finish_reason == "length" and len(c.token_ids) == 512 - len(prompt)


def test_an_engine_that_dies_is_started_again_and_the_requests_it_held_are_served(vllm_backend) -> None:
    """kill -9 of the engine core process while three requests run: the backend starts a new
    engine (same weights version) and serves each of them once; none fails."""
    import os
    import signal

    (pid,) = vllm_backend.engine_pids()
    before = vllm_backend.restarts

    async def go() -> list[Generation]:
        futs = [asyncio.ensure_future(vllm_backend.generate(GenerateRequest([1, 5, 6], 400, 1.0))) for _ in range(3)]
        while vllm_backend._running < 3:  # all three inside the engine
            await asyncio.sleep(0.01)
        os.kill(pid, signal.SIGKILL)
        return list(await asyncio.gather(*futs))

    gens = asyncio.run(go())
    assert vllm_backend.restarts == before + 1 and pid not in vllm_backend.engine_pids()
    assert all(len(g.token_ids) > 0 and (g.versions == vllm_backend.version).all() for g in gens)
