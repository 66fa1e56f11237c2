"""The torch engine in its own process: same results as in-process, weights switched between steps.

The child is a real `python -m astraflow.raas.backends.engine_proc` behind a socketpair; the
reference logprobs come from transformers' forward in the test process.
"""

from __future__ import annotations

import asyncio
import socket
import time
from pathlib import Path

import numpy as np
import pytest
import torch
from transformers import AutoModelForCausalLM, DynamicCache

from astraflow.raas.backends.base import GenerateRequest
from astraflow.raas.backends.engine_loop import recv_frame, send_frame, state_frame, state_of
from astraflow.raas.backends.slots import BackendError
from astraflow.raas.backends.torch_backend import TorchBackend
from astraflow.weights.layout import ModelLayout


@pytest.fixture(scope="module")
def ref(tiny_model_dir: Path) -> torch.nn.Module:
    return AutoModelForCausalLM.from_pretrained(tiny_model_dir).eval()


def _logprobs(model, prompt: list[int], gen: np.ndarray, switch_at: int | None = None, v1=None) -> np.ndarray:
    """Logprobs of `gen` decoded step by step (temperature 1), weights v1 from token `switch_at` on."""
    v0 = {k: v.clone() for k, v in model.state_dict().items()}
    cache, feed, out = DynamicCache(), torch.tensor([prompt]), []
    with torch.no_grad():
        for k, tok in enumerate(gen.tolist()):
            if switch_at is not None and k == switch_at:
                model.load_state_dict(v1)
            logits = model(input_ids=feed, past_key_values=cache, use_cache=True).logits[0, -1].double()
            out.append(float(torch.log_softmax(logits, -1)[tok]))
            feed = torch.tensor([[tok]])
    model.load_state_dict(v0)
    return np.asarray(out)


def test_process_engine_serves_concurrent_requests_like_a_full_forward(tiny_model_dir: Path, ref) -> None:
    backend = TorchBackend("policy", str(tiny_model_dir), seed=0, max_batch=4, threads=1, process=True)
    try:
        assert backend.model is None and backend.hardware().startswith("cpu")
        assert backend.weight_layout() == ModelLayout.of(ref.state_dict())
        prompts = [[1, 40 + i, 7, 9, 11 + i][: 2 + i % 4] for i in range(9)]

        async def main():
            reqs = [backend.generate(GenerateRequest(p, 6, 1.0)) for p in prompts]
            bad = backend.generate(GenerateRequest([], 4))
            return await asyncio.gather(*reqs, bad, return_exceptions=True)

        *gens, bad = asyncio.run(main())
        assert isinstance(bad, BackendError) and "empty prompt" in str(bad)
        for p, g in zip(prompts, gens, strict=True):
            np.testing.assert_allclose(g.logprobs, _logprobs(ref, p, g.token_ids), atol=2e-5)
            assert (g.versions == 0).all() and g.text == backend.decode(g.token_ids)
        assert backend.tokens_generated == sum(len(g.token_ids) for g in gens)
        assert backend.stats()["reused_tokens"] > 0  # prompts 1 and 5 (and others) share a cached prefix
    finally:
        backend.close()


def _until(cond, timeout_s: float = 120.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not cond():
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.02)


def test_a_dead_engine_process_restarts_with_the_newest_weights_then_fails_when_no_restart_is_left(
        tiny_model_dir: Path, ref) -> None:
    backend = TorchBackend("policy", str(tiny_model_dir), seed=0, max_batch=2, threads=1, process=True,
                           engine_restarts=1)
    try:
        gen, model = torch.Generator().manual_seed(3), AutoModelForCausalLM.from_pretrained(tiny_model_dir).eval()
        with torch.no_grad():
            for p in model.parameters():  # parameters, not state-dict entries: tied weights move together
                p.add_(0.05 * torch.randn(p.shape, generator=gen))
        v1 = {k: v.clone() for k, v in model.state_dict().items()}
        backend.update_weights(v1, 1)
        assert backend.wait_version(1, 120)
        first = backend._proc.proc.pid
        running = backend._submit(GenerateRequest([1, 2, 3], 300, 1.0))
        backend._proc.proc.kill()
        with pytest.raises(BackendError, match="exited"):  # what it ran fails: it may be what killed it
            running.result(timeout=60)
        _until(lambda: backend._restarting or backend.restarts == 1)
        g = backend.generate_sync(GenerateRequest([1, 40, 7], 6, 1.0))  # waits for the new engine
        assert backend.restarts == 1 and backend._proc.proc.pid != first and backend.version == 1
        assert (g.versions == 1).all()  # served with version 1's weights, restored before any request
        np.testing.assert_allclose(g.logprobs, _logprobs(ref, [1, 40, 7], g.token_ids, switch_at=0, v1=v1), atol=2e-5)
        # No restart left: a dead engine fails what is pending and what comes later instead of hanging.
        running = backend._submit(GenerateRequest([1, 2, 3], 300, 1.0))
        backend._proc.proc.kill()
        with pytest.raises(BackendError):
            running.result(timeout=60)
        _until(lambda: not backend._proc.alive)
        with pytest.raises(BackendError, match="exited"):
            backend.generate_sync(GenerateRequest([1, 2, 3], 4))
        assert backend.restarts == 1
    finally:
        backend.close()


def test_new_version_lands_between_steps_of_a_running_request_and_closing_ends_the_engine(
        tiny_model_dir: Path, ref) -> None:
    """Also: closing the backend while a request runs ends its engine process cleanly and fails
    that request (checked on this test's backend: an engine process costs seconds to start)."""
    g = torch.Generator().manual_seed(3)
    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir).eval()
    with torch.no_grad():
        for p in model.parameters():
            p.add_(0.05 * torch.randn(p.shape, generator=g))
    v1 = {k: v.clone() for k, v in model.state_dict().items()}
    backend = TorchBackend("policy", str(tiny_model_dir), seed=0, max_batch=2, threads=1, process=True)
    try:
        prompt = [1, 30, 31, 32]
        fut = backend._submit(GenerateRequest(prompt, 120, 1.0))
        while backend.decode_steps < 3:  # the request is decoding: publish version 7
            backend.refresh_stats()
            time.sleep(0.002)
        backend.update_weights(v1, 7)
        gen = fut.result(timeout=120)
        assert backend.wait_version(7, 10) and backend.version == 7
        pending = backend._submit(GenerateRequest([1, 2, 3], 300, 1.0))  # still running at the close
    finally:
        backend.close()
    assert backend._proc is not None and backend._proc.proc.returncode == 0
    with pytest.raises(BackendError):
        pending.result(timeout=10)
    vers = gen.versions
    k = int(np.argmax(vers == 7))
    assert vers[0] == 0 and vers[-1] == 7 and k >= 3, "the request ended before the new weights landed"
    assert set(vers.tolist()) == {0, 7} and np.all(np.diff(vers) >= 0)  # one switch, between two steps
    # Every token's logprob is the one its recorded version's forward gave, on the same cache.
    np.testing.assert_allclose(gen.logprobs, _logprobs(ref, prompt, gen.token_ids, switch_at=k, v1=v1), atol=2e-5)


def test_weights_frames_round_trip_and_broken_frames_are_refused() -> None:
    state = {"a": torch.randn(3, 4), "b": torch.randn(5).to(torch.bfloat16), "c": torch.arange(6).reshape(2, 3),
             "empty": torch.zeros(0)}
    head, blob = state_frame(state, 9)
    back = state_of(head, bytearray(blob))
    assert head["version"] == 9 and all(torch.equal(back[k], state[k]) for k in state)
    head["tensors"][0][4] = len(blob) + 1  # a tensor said to run past the blob
    with pytest.raises(BackendError):
        state_of(head, bytearray(blob))
    a, b = socket.socketpair()
    with a, b:
        send_frame(a, {"kind": "x"}, b"abc")
        assert recv_frame(b) == ({"kind": "x"}, bytearray(b"abc"))
        a.sendall((1 << 30).to_bytes(4, "big") + (0).to_bytes(4, "big"))  # a 1 GiB header
        with pytest.raises(BackendError):
            recv_frame(b)
        a.close()
        assert recv_frame(b) is None
