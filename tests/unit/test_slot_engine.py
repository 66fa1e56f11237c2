"""The continuous-batching engine: every recorded logprob equals a plain full forward pass.

Requests of different lengths, temperatures and top-p arrive while others decode; groups share
their prompt's prefill; a next turn continues from its cached conversation; weights change
between steps and each token records the version whose forward produced it. The reference is
always transformers' own forward over the whole sequence (or, across a version switch, the same
cache computed step by step with the same switch).
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch
from transformers import AutoModelForCausalLM, DynamicCache

from astraflow.raas.backends.base import GenerateRequest
from astraflow.raas.backends.slots import BackendError, SlotEngine, load_engine


@pytest.fixture(scope="module")
def ref(tiny_model_dir: Path) -> torch.nn.Module:
    return AutoModelForCausalLM.from_pretrained(tiny_model_dir).eval()


def _engine(tiny_model_dir: Path, **kw) -> SlotEngine:
    opts = {"max_batch": 4, "cache_slots": None, "device": "cpu", "version": 0, "seed": 1, "threads": 1,
            "max_cache_lag": 0, **kw}
    return load_engine(str(tiny_model_dir), **opts)[0]


def _run(engine: SlotEngine, arrivals: dict[int, list[tuple[int, GenerateRequest]]], max_steps: int = 500) -> dict:
    """Steps until idle, submitting arrivals[k] before step k; checks max_batch at every step."""
    out, step = {}, 0
    while (arrivals and step <= max(arrivals)) or engine.has_work():
        for rid, req in arrivals.get(step, []):
            engine.submit(rid, req)
        for f in engine.step():
            out[f.rid] = f.generation
        assert len(engine.active) <= engine.max_batch
        step += 1
        assert step < max_steps
    return out


def _reference(model, prompt: list[int], gen: np.ndarray, temperature: float, top_p: float = 1.0) -> np.ndarray:
    """Behaviour logprobs of `gen` after `prompt` from one full forward (same formula, written out)."""
    with torch.no_grad():
        logits = model(torch.tensor([prompt + gen.tolist()])).logits[0, len(prompt) - 1 : -1].double()
    if temperature <= 0:
        logp = torch.log_softmax(logits, -1)
    else:
        logp = torch.log_softmax(logits / temperature, -1)
        if top_p < 1.0:
            p = logp.exp()
            sp, _ = p.sort(-1, descending=True)
            kept = (sp * ((sp.cumsum(-1) - sp) < top_p)).sum(-1)
            logp = logp - kept.log()[:, None]
    return logp.gather(-1, torch.tensor(gen, dtype=torch.long)[:, None]).squeeze(-1).numpy()


def _prompt(i: int, n: int) -> list[int]:
    return [1] + [int(x) for x in np.random.RandomState(i).randint(3, 400, size=n)]


def test_staggered_requests_with_own_sampling_match_a_full_forward(tiny_model_dir: Path, ref) -> None:
    engine = _engine(tiny_model_dir)
    params = [(1.0, 1.0), (0.7, 1.0), (0.0, 1.0), (1.3, 0.8), (1.0, 0.5)]
    reqs = {i: GenerateRequest(_prompt(i, 3 + 5 * (i % 4)), 6 + 3 * (i % 3), *params[i % len(params)])
            for i in range(10)}
    # Four arrive at once, the others while those decode: more requests than rows.
    arrivals = {0: [(i, reqs[i]) for i in range(4)], 2: [(4, reqs[4]), (5, reqs[5])], 5: [(i, reqs[i]) for i in range(6, 10)]}
    out = _run(engine, arrivals)
    assert set(out) == set(reqs)
    for i, r in reqs.items():
        g = out[i]
        assert 1 <= len(g.token_ids) <= r.max_tokens and (g.versions == 0).all()
        assert g.finish_reason == ("length" if len(g.token_ids) == r.max_tokens and g.token_ids[-1] != engine.eos_id
                                   else "stop")
        np.testing.assert_allclose(g.logprobs, _reference(ref, r.prompt_ids, g.token_ids, r.temperature, r.top_p), atol=2e-5)
        if r.temperature == 0:  # greedy rows take the argmax of the full forward
            with torch.no_grad():
                logits = ref(torch.tensor([r.prompt_ids + g.token_ids.tolist()])).logits[0, len(r.prompt_ids) - 1 : -1]
            assert logits.argmax(-1).tolist() == g.token_ids.tolist()


def test_short_prompts_joining_decoding_rows_are_packed_and_match_a_full_forward(tiny_model_dir: Path, ref) -> None:
    """A prompt admitted next to decoding rows goes in a packed forward (one row of every fed
    token, each seeing only its own slot), in both forwards the engine has; every logprob still
    equals transformers' full forward."""
    for llama_forward in (True, False):
        engine = _engine(tiny_model_dir)
        if not llama_forward:
            engine.fast_forward = None
        packed = []
        plain_packed = engine._packed
        engine._packed = lambda *a, packed=packed, plain=plain_packed: packed.append(1) or plain(*a)  # type: ignore[method-assign]
        reqs = {i: GenerateRequest(_prompt(i, 4 + 3 * (i % 3)), 16 - i, 1.0) for i in range(7)}
        arrivals = {0: [(i, reqs[i]) for i in range(3)], 3: [(3, reqs[3])], 6: [(4, reqs[4])], 7: [(5, reqs[5])],
                    9: [(6, reqs[6])]}
        out = _run(engine, arrivals)
        assert len(packed) >= 3 and set(out) == set(reqs)
        for i, r in reqs.items():
            np.testing.assert_allclose(out[i].logprobs, _reference(ref, r.prompt_ids, out[i].token_ids, 1.0), atol=2e-5)


def test_group_prefills_its_prompt_once_and_forks_the_cache(tiny_model_dir: Path, ref) -> None:
    engine = _engine(tiny_model_dir, max_batch=8)
    prompt = _prompt(42, 20)
    out = _run(engine, {0: [(i, GenerateRequest(list(prompt), 8, 1.0)) for i in range(8)]})
    assert engine.prefill_tokens == len(prompt)  # one prefill for the group
    assert engine.reused_tokens == 7 * len(prompt)
    assert len({tuple(g.token_ids) for g in out.values()}) > 1  # samples drawn independently
    for g in out.values():
        np.testing.assert_allclose(g.logprobs, _reference(ref, prompt, g.token_ids, 1.0), atol=2e-5)


def test_next_turn_continues_from_the_cached_conversation(tiny_model_dir: Path, ref) -> None:
    engine = _engine(tiny_model_dir)
    prompt = _prompt(7, 12)
    first = _run(engine, {0: [(0, GenerateRequest(list(prompt), 10, 1.0))]})[0]
    turn2 = prompt + first.token_ids.tolist() + [5, 6, 7, 8]  # + a tool reply
    before = engine.reused_tokens
    second = _run(engine, {0: [(1, GenerateRequest(list(turn2), 10, 1.0))]})[1]
    # Everything with keys/values cached (all but the last sampled token) is reused.
    assert engine.reused_tokens - before == len(prompt) + len(first.token_ids) - 1
    np.testing.assert_allclose(second.logprobs, _reference(ref, turn2, second.token_ids, 1.0), atol=2e-5)


def test_prefix_shared_with_a_running_row_and_lru_eviction(tiny_model_dir: Path, ref) -> None:
    engine = _engine(tiny_model_dir, max_batch=2, cache_slots=2)
    shared = _prompt(3, 16)
    reqs = {0: GenerateRequest([*shared, 9], 12, 1.0), 1: GenerateRequest([*shared, 11, 12], 5, 1.0),
            2: GenerateRequest(_prompt(5, 9), 5, 1.0), 3: GenerateRequest([*shared, 13], 4, 1.0)}
    out = _run(engine, {0: [(0, reqs[0])], 3: [(1, reqs[1])], 4: [(2, reqs[2]), (3, reqs[3])]})
    assert engine.reused_tokens >= len(shared)  # request 1 copied the shared prefix from running request 0
    for i, r in reqs.items():
        np.testing.assert_allclose(out[i].logprobs, _reference(ref, r.prompt_ids, out[i].token_ids, 1.0), atol=2e-5)


def test_stop_strings_max_tokens_and_context_end(tiny_model_dir: Path) -> None:
    engine = _engine(tiny_model_dir)
    g = _run(engine, {0: [(0, GenerateRequest(_prompt(1, 5), 3, 1.0))]})[0]
    assert len(g.token_ids) <= 3
    # A stop string: whatever text greedy decoding produces, stopping on its first character ends there.
    free = _run(engine, {0: [(1, GenerateRequest(_prompt(2, 5), 12, 0.0))]})[1]
    text = engine.tokenizer.decode(free.token_ids[:4].tolist(), skip_special_tokens=False)
    stop = text.strip()[-1:] or text[-1:]
    assert stop, f"greedy decoding gave no text to stop on: {text!r}"
    g = _run(engine, {0: [(2, GenerateRequest(_prompt(2, 5), 12, 0.0, stop=[stop]))]})[2]
    assert g.finish_reason == "stop" and engine.tokenizer.decode(g.token_ids.tolist()).endswith(stop)
    assert g.token_ids.tolist() == free.token_ids[: len(g.token_ids)].tolist()
    near_end = [1] + [7] * (engine.max_len - 4)
    g = _run(engine, {0: [(3, GenerateRequest(near_end, 50, 1.0))]})[3]
    assert g.finish_reason in ("length", "stop") and len(near_end) + len(g.token_ids) <= engine.max_len


def test_bad_requests_are_refused_and_the_engine_serves_on(tiny_model_dir: Path, ref) -> None:
    engine = _engine(tiny_model_dir)
    bad = [GenerateRequest([], 4), GenerateRequest([1, engine.vocab], 4), GenerateRequest([1, -3], 4),
           GenerateRequest([1] * engine.max_len, 4), GenerateRequest([1, 2], 0),
           GenerateRequest([1, 2], 4, temperature=float("nan")), GenerateRequest([1, 2], 4, top_p=0.0),
           GenerateRequest([1, 2], 4, top_p=1.5)]
    for i, req in enumerate(bad):
        with pytest.raises(BackendError):
            engine.submit(i, req)
    assert not engine.has_work()
    prompt = _prompt(9, 6)
    g = _run(engine, {0: [(99, GenerateRequest(list(prompt), 5, 1.0))]})[99]
    np.testing.assert_allclose(g.logprobs, _reference(ref, prompt, g.token_ids, 1.0), atol=2e-5)


def test_cancel_frees_the_row(tiny_model_dir: Path) -> None:
    engine = _engine(tiny_model_dir, max_batch=1)
    engine.submit(0, GenerateRequest(_prompt(1, 4), 400, 1.0))
    engine.submit(1, GenerateRequest(_prompt(2, 4), 3, 1.0))
    engine.step()
    assert [r.rid for r in engine.active] == [0]
    engine.cancel(0)
    done = []
    while engine.has_work():
        done += engine.step()
    assert [f.rid for f in done] == [1]


def _perturbed(model: torch.nn.Module, seed: int) -> dict[str, torch.Tensor]:
    """Other weights, as a trainer would publish them (tied tensors stay tied); `model` is left as it was."""
    g = torch.Generator().manual_seed(seed)
    before = {k: v.clone() for k, v in model.state_dict().items()}
    with torch.no_grad():
        for p in model.parameters():
            p.add_(0.05 * torch.randn(p.shape, generator=g))
    after = {k: v.clone() for k, v in model.state_dict().items()}
    model.load_state_dict(before)
    return after


def test_version_switch_between_steps_every_token_records_the_weights_that_produced_it(tiny_model_dir: Path) -> None:
    engine = _engine(tiny_model_dir, max_batch=2)
    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir).eval()
    v1 = _perturbed(model, 0)
    prompts = [_prompt(11, 8), _prompt(12, 5)]
    for i, p in enumerate(prompts):
        engine.submit(i, GenerateRequest(list(p), 10, 1.0))
    out = {}
    for _ in range(3):
        out.update({f.rid: f.generation for f in engine.step()})
    assert engine.load_weights(v1, 1) is None  # between step 3 and step 4 of an ongoing batch
    while engine.has_work():
        out.update({f.rid: f.generation for f in engine.step()})
    v0 = {k: v.clone() for k, v in model.state_dict().items()}
    for i, p in enumerate(prompts):
        g = out[i]
        assert g.versions.tolist() == [0, 0, 0] + [1] * (len(g.token_ids) - 3)
        # Replay: steps 1-3 under version 0, then version 1 continues on the same cache.
        model.load_state_dict(v0)
        cache = DynamicCache()
        expected, feed = [], torch.tensor([p])
        with torch.no_grad():
            for k, tok in enumerate(g.token_ids.tolist()):
                if k == 3:
                    model.load_state_dict(v1)
                logits = model(input_ids=feed, past_key_values=cache, use_cache=True).logits[0, -1].double()
                expected.append(float(torch.log_softmax(logits, -1)[tok]))
                feed = torch.tensor([[tok]])
        np.testing.assert_allclose(g.logprobs, expected, atol=2e-5)


def test_cached_prefix_of_older_weights_is_recomputed_unless_allowed(tiny_model_dir: Path) -> None:
    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir).eval()
    v1 = _perturbed(model, 1)
    prompt = _prompt(4, 14)
    for lag, reused in ((0, 0), (1, len(prompt) - 1)):
        engine = _engine(tiny_model_dir, max_cache_lag=lag)
        _run(engine, {0: [(0, GenerateRequest(list(prompt), 4, 1.0))]})
        engine.load_weights(v1, 1)
        before = engine.reused_tokens
        g = _run(engine, {0: [(1, GenerateRequest(list(prompt), 4, 1.0))]})[1]
        assert engine.reused_tokens - before == reused and (g.versions == 1).all()
        if lag == 0:  # a fresh prefill under version 1: exactly version 1's distribution
            model.load_state_dict(v1)
            np.testing.assert_allclose(g.logprobs, _reference(model, prompt, g.token_ids, 1.0), atol=2e-5)


def test_the_llama_family_forward_matches_transformers_forward(tiny_model_dir: Path) -> None:
    """The tiny model (Qwen2) takes decoder.py's forward (so every test above checks it against
    transformers); greedy decoding through transformers' own forward gives the same tokens and
    logprobs; a model of another layout gets no fast forward."""
    from transformers import GPT2Config, GPT2LMHeadModel

    from astraflow.raas.backends.decoder import decoder_forward

    fast, plain = _engine(tiny_model_dir), _engine(tiny_model_dir)
    assert fast.fast_forward is not None
    plain.fast_forward = None
    arrivals = {0: [(i, GenerateRequest(_prompt(i, 5 + 3 * i), 12, temperature=0.0)) for i in range(3)],
                4: [(9, GenerateRequest(_prompt(9, 20), 12, temperature=0.0))]}
    a, b = _run(fast, arrivals), _run(plain, arrivals)
    assert sorted(a) == sorted(b) == [0, 1, 2, 9]
    for rid in a:
        np.testing.assert_array_equal(a[rid].token_ids, b[rid].token_ids)
        np.testing.assert_allclose(a[rid].logprobs, b[rid].logprobs, atol=1e-4)
    assert decoder_forward(GPT2LMHeadModel(GPT2Config(n_layer=1, n_embd=32, n_head=2, vocab_size=64))) is None
