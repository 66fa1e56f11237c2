"""A running vLLM engine follows the weights topic in place: deltas and snapshots, no restart.

The trainer's publisher (the real `WeightPublisher`, bf16 deltas and a snapshot) writes versions to
Kafka; the node's follower (`BackendWeightFollower`, the path the torch engine uses) hands each
verified version to the vLLM backend. The proof that a token's recorded version is right: its
logprob equals the one the transformers model computes on the weights of that version (and not
on another's).
"""

from __future__ import annotations

import asyncio
import time
from pathlib import Path

import numpy as np
import torch
from safetensors.torch import load_file

from astraflow.config import AstraflowConfig, KafkaSettings
from astraflow.raas.backends.base import GenerateRequest, Generation
from astraflow.raas.weight_follower import BackendWeightFollower
from astraflow.rl.logprobs import sequence_logprobs
from astraflow.weights.encoder import published_state
from astraflow.weights.publish import WeightPublisher

TOL = 1e-3  # as in test_vllm_engine.py; versions differ here by far more (see `_gap`)


def _logprobs_under(model, state: dict, prompt: list[int], gen: Generation, temperature: float) -> np.ndarray:
    model.load_state_dict({k: v.float() for k, v in state.items()}, strict=True)
    ids = torch.tensor([prompt + gen.token_ids.tolist()])
    with torch.no_grad():
        logits = model(ids).logits
    return sequence_logprobs(logits, ids, torch.tensor([temperature]))[0, len(prompt):].numpy()


def _gap(model, states: dict, prompt: list[int], gen: Generation, temperature: float) -> dict[int, float]:
    """Largest |logprob recorded - logprob under version v's weights| for every version v."""
    return {v: float(np.abs(gen.logprobs - _logprobs_under(model, s, prompt, gen, temperature)).max())
            for v, s in states.items()}


def test_versions_arrive_in_place_and_every_token_records_the_one_that_produced_it(
        kafka: KafkaSettings, experiment: str, untied_model_dir: Path, vllm_backend) -> None:
    from astraflow.models.tiny import load_tiny

    hf = load_tiny(untied_model_dir)[0]
    backend = vllm_backend
    cfg = AstraflowConfig(kafka=kafka)
    base = load_file(str(untied_model_dir / "model.safetensors"))
    publisher = WeightPublisher(kafka, experiment, "policy")
    publisher.start()
    follower = BackendWeightFollower(cfg, experiment, "policy", backend).start()
    prompt = backend.encode("Q: What is 2+3?\nA:", add_bos=True)
    states: dict[int, dict] = {}
    gen = torch.Generator().manual_seed(0)
    try:
        state = dict(base)
        for v in range(4):  # 0: the first version (a snapshot); 1, 2: deltas; 3: a snapshot on request
            if v:
                state = {k: t + 0.05 * torch.randn(t.shape, generator=gen) for k, t in state.items()}
            manifest = publisher.publish(state, trainer_step=v, snapshot=(v == 3))
            publisher.producer.flush()
            states[manifest.version] = published_state(state)
            want = (v + 1, manifest.version)
            _wait(lambda want=want: (follower.applied, backend.version) == want, f"version {want[1]} not applied")
            (g,) = asyncio.run(_all(backend, [GenerateRequest(prompt, 16, 1.0)]))
            assert (g.versions == manifest.version).all()
            gaps = _gap(hf, states, prompt, g, 1.0)
            assert gaps[manifest.version] < TOL, gaps
            assert all(gaps[o] > 10 * TOL for o in states if o != manifest.version), gaps
        assert follower.applied == 4 and backend.restarts == 0
        print(f"in-place reloads (s): {[round(s, 3) for s in backend.reload_s]}")

        # A version that arrives while requests run: they finish on the version they started with
        # (3); requests that arrive meanwhile wait and start on the new one (4).
        async def during_a_switch() -> list[Generation]:
            loop = asyncio.get_running_loop()
            first = [asyncio.ensure_future(backend.generate(GenerateRequest(prompt, 120, 1.0))) for _ in range(3)]
            await asyncio.sleep(0.3)
            nxt = {k: t + 0.05 * torch.randn(t.shape, generator=gen) for k, t in state.items()}
            manifest = await loop.run_in_executor(None, lambda: publisher.publish(nxt, trainer_step=4))
            await loop.run_in_executor(None, publisher.producer.flush)
            states[manifest.version] = published_state(nxt)
            meanwhile = [asyncio.ensure_future(backend.generate(GenerateRequest(prompt, 16, 1.0))) for _ in range(2)]
            await loop.run_in_executor(None, backend.wait_version, manifest.version, 120)
            after = [asyncio.ensure_future(backend.generate(GenerateRequest(prompt, 16, 1.0))) for _ in range(2)]
            return list(await asyncio.gather(*first, *meanwhile, *after))

        gens = asyncio.run(during_a_switch())
        for g in gens:
            (v,) = set(g.versions.tolist())  # one version per request: the one it started on
            gaps = _gap(hf, states, prompt, g, 1.0)
            assert gaps[v] < TOL, (v, gaps)
        assert [int(g.versions[0]) for g in gens[:3]] == [3, 3, 3]
        assert [int(g.versions[0]) for g in gens[5:]] == [4, 4]
    finally:
        follower.stop()
        publisher.close()


def _wait(cond, what: str, timeout_s: float = 120.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not cond():
        assert time.monotonic() < deadline, what
        time.sleep(0.05)


async def _all(backend, reqs: list[GenerateRequest]) -> list[Generation]:
    return list(await asyncio.gather(*(backend.generate(r) for r in reqs)))
