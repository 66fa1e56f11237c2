"""astraflow.models.decoder: the trainer's plain-functional scoring pass gives transformers' logits
and gradients, and is refused where it would not."""

from __future__ import annotations

import pytest
import torch

# At collection, not inside a test: importing transformers sets an environment variable, and the
# leak guard would blame the test.
from transformers import (
    GPT2Config,
    GPT2LMHeadModel,
    LlamaConfig,
    LlamaForCausalLM,
    Qwen2Config,
    Qwen2ForCausalLM,
)

from astraflow.models.decoder import decoder_logits

pytestmark = pytest.mark.unit


def _model(kind: str, **extra):
    torch.manual_seed(0)
    common = dict(vocab_size=97, hidden_size=32, intermediate_size=48, num_hidden_layers=2, num_attention_heads=4,
                  num_key_value_heads=2, max_position_embeddings=64, **extra)
    if kind == "qwen2":
        return Qwen2ForCausalLM(Qwen2Config(**common)).train()
    return LlamaForCausalLM(LlamaConfig(attention_bias=True, **common)).train()


def _batch(lengths: list[int], width: int, vocab: int = 97) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(1, vocab, (len(lengths), width), generator=g)
    attn = (torch.arange(width)[None, :] < torch.tensor(lengths)[:, None]).long()
    return ids * attn, attn  # right padding, pad id 0


@pytest.mark.parametrize("kind", ["qwen2", "llama"])
def test_logits_and_gradients_match_transformers(kind: str) -> None:
    model = _model(kind)
    ids, attn = _batch([9, 5, 12, 1], 12)
    cols = torch.tensor([0, 3, 4, 8, 10])
    fast = decoder_logits(model)
    assert fast is not None

    ref = model(input_ids=ids, attention_mask=attn, use_cache=False, logits_to_keep=cols).logits
    got = fast(ids, attn, cols)
    assert got.shape == ref.shape == (4, 5, 97)
    real = attn[:, cols].bool()  # at a pad position the two may differ: no loss reads there
    torch.testing.assert_close(got[real], ref[real], atol=1e-5, rtol=1e-4)
    grads_ref = torch.autograd.grad(ref[real].square().sum(), list(model.parameters()))
    grads = torch.autograd.grad(got[real].square().sum(), list(model.parameters()))
    for g, r in zip(grads, grads_ref, strict=True):
        torch.testing.assert_close(g, r, atol=1e-5, rtol=1e-4)


def test_weights_stepped_in_place_apply_at_the_next_call() -> None:
    model = _model("qwen2")
    fast = decoder_logits(model)
    ids, attn = _batch([6, 6], 6)
    cols = torch.arange(5)
    before = fast(ids, attn, cols).detach()
    with torch.no_grad():
        model.lm_head.weight.mul_(2.0)
    after = fast(ids, attn, cols).detach()
    torch.testing.assert_close(after, model(input_ids=ids, attention_mask=attn, logits_to_keep=cols).logits.detach(),
                               atol=1e-5, rtol=1e-4)
    assert not torch.allclose(before, after)


def test_refused_where_transformers_forward_is_needed() -> None:
    assert decoder_logits(GPT2LMHeadModel(GPT2Config(n_layer=1, n_embd=32, n_head=2, vocab_size=64))) is None
    assert decoder_logits(_model("qwen2", attention_dropout=0.1)) is None
    checkpointed = _model("qwen2")
    checkpointed.gradient_checkpointing_enable()
    assert decoder_logits(checkpointed) is None
    assert decoder_logits(_model("qwen2")) is not None  # the checks above can fail
