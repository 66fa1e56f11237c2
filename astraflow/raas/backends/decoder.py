"""The slot engine's forward pass for Llama-family decoders, without transformers' module plumbing.

A decoding step of a small model on a CPU is mostly Python: transformers' forward goes through
output-capturing wrappers, kwargs plumbing, per-module hooks and a `repeat_kv` copy before every
attention, for a few microseconds of arithmetic each. `decoder_forward(model)` returns a function
that computes the same thing from the model's own parameters with plain `torch.nn.functional`
calls (GQA through `scaled_dot_product_attention(enable_gqa=...)`), for the architectures whose
layer is exactly: RMSNorm, q/k/v projections (with or without bias), rotary embedding (the
model's own `rotary_emb`, so every RoPE variant it implements is kept), attention over the slot
cache, o projection, residual, RMSNorm, gated MLP, residual; then the final norm and the LM head
on each row's last position. Any other model gets None and runs through transformers' forward.

The weights are read from the model's modules at every call, so weights loaded in place
(`SlotEngine.load_weights`) apply at once. `SlotEngine.self_check` compares the engine's logits
with a plain transformers forward at load, whichever path it takes, and refuses a mismatch.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
import torch.nn.functional as F

# Causal LMs whose decoder layer is the one described above (in transformers 4.4x-5.x).
ARCHITECTURES = frozenset({"LlamaForCausalLM", "MistralForCausalLM", "Qwen2ForCausalLM"})

Forward = Callable[[torch.Tensor, dict[str, torch.Tensor], torch.Tensor, Any, torch.Tensor | None], torch.Tensor]


def decoder_forward(model: Any) -> Forward | None:
    """A forward (ids [B, Q], masks per layer type [B, 1, Q, W], position ids [B, Q], cache, last)
    -> logits [B, vocab] after each row's last position, or with `last` (a packed forward, B = 1)
    [len(last), vocab] at those positions; None if `model` is not of that shape."""
    if type(model).__name__ not in ARCHITECTURES:
        return None
    base = model.model
    layers = list(base.layers)
    types = list(getattr(model.config, "layer_types", None) or ["full_attention"] * len(layers))
    for layer in layers:
        attn, mlp = layer.self_attn, layer.mlp
        if any(hasattr(attn, extra) for extra in ("q_norm", "k_norm", "sinks")) or not hasattr(mlp, "gate_proj"):
            return None
        for norm in (layer.input_layernorm, layer.post_attention_layernorm):
            if not type(norm).__name__.endswith("RMSNorm") or not hasattr(norm, "variance_epsilon"):
                return None
    if getattr(model.config, "final_logit_softcapping", None) or getattr(model.config, "logit_scale", None):
        return None

    def forward(ids: torch.Tensor, masks: dict[str, torch.Tensor], pos: torch.Tensor, cache: Any,
                last: torch.Tensor | None = None) -> torch.Tensor:
        B, Q = ids.shape
        x = F.embedding(ids, base.embed_tokens.weight)
        cos, sin = base.rotary_emb(x, pos)
        cos, sin = cos[:, None], sin[:, None]
        for i, layer in enumerate(layers):
            attn, mlp = layer.self_attn, layer.mlp
            h = _rms(x, layer.input_layernorm)
            q = F.linear(h, attn.q_proj.weight, attn.q_proj.bias).view(B, Q, -1, attn.head_dim).transpose(1, 2)
            k = F.linear(h, attn.k_proj.weight, attn.k_proj.bias).view(B, Q, -1, attn.head_dim).transpose(1, 2)
            v = F.linear(h, attn.v_proj.weight, attn.v_proj.bias).view(B, Q, -1, attn.head_dim).transpose(1, 2)
            q, k = _rope(q, cos, sin), _rope(k, cos, sin)
            k, v = cache.update(k, v, i)
            o = F.scaled_dot_product_attention(q, k, v, attn_mask=masks.get(types[i], masks["full_attention"]), scale=attn.scaling,
                                               enable_gqa=q.shape[1] != k.shape[1])
            x = x + F.linear(o.transpose(1, 2).reshape(B, Q, -1), attn.o_proj.weight, attn.o_proj.bias)
            h = _rms(x, layer.post_attention_layernorm)
            gate = mlp.act_fn(F.linear(h, mlp.gate_proj.weight, mlp.gate_proj.bias))
            up = F.linear(h, mlp.up_proj.weight, mlp.up_proj.bias)
            x = x + F.linear(gate * up, mlp.down_proj.weight, mlp.down_proj.bias)
        h = _rms(x[:, -1] if last is None else x[0, last], base.norm)
        return F.linear(h, model.lm_head.weight, getattr(model.lm_head, "bias", None))

    return forward


def _rms(x: torch.Tensor, norm: Any) -> torch.Tensor:
    xf = x.float()
    return norm.weight * (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + norm.variance_epsilon)).to(x.dtype)


def _rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return x * cos + torch.cat((-x[..., half:], x[..., :half]), dim=-1) * sin
