"""A Llama-family decoder's forward pass without transformers' module plumbing: the slot
engine's decoding steps and the trainer's scoring passes.

A forward of a small model on a CPU is mostly Python: transformers' forward goes through
output-capturing wrappers, kwargs plumbing, mask builders, per-module hooks and a `repeat_kv`
copy before every attention, for a few microseconds of arithmetic each. The functions here
compute the same thing from the model's own parameters with plain `torch.nn.functional` calls
(GQA through `scaled_dot_product_attention(enable_gqa=...)`), for the architectures whose layer
is exactly: RMSNorm, q/k/v projections (with or without bias), rotary embedding (the model's own
`rotary_emb`, so every RoPE variant it implements is kept), attention, o projection, residual,
RMSNorm, gated MLP, residual; then the final norm and the LM head at the positions asked for.
Any other model gets None and runs through transformers' forward.

* `decoder_forward(model)`: the slot engine's step (`astraflow.raas.backends.slots`): attention
  over the slot cache, logits after each row's last position.
* `decoder_logits(model)`: the trainer's pass (`trainers.module.PolicyTrainer.scored_logprobs`):
  right-padded rows, no cache, logits at chosen positions, with gradients. Refused (None) also
  where attention dropout is on or gradient checkpointing is enabled, and for a model whose
  layers are wrapped (FSDP): those need transformers' own forward.

The weights are read from the model's modules at every call, so weights loaded in place
(`SlotEngine.load_weights`) or stepped by an optimizer apply at once. `SlotEngine.self_check`
compares the engine's logits with a plain transformers forward at load, and
`tests/unit/test_decoder_forward.py` the trainer's logits and gradients.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
import torch.nn.functional as F

# Causal LMs whose decoder layer is the one described above (in transformers 4.4x-5.x).
ARCHITECTURES = frozenset({"LlamaForCausalLM", "MistralForCausalLM", "Qwen2ForCausalLM"})

Forward = Callable[[torch.Tensor, dict[str, torch.Tensor], torch.Tensor, Any, torch.Tensor | None], torch.Tensor]


def _shape(model: Any) -> tuple[Any, list[Any], list[str]] | None:
    """(the base model, its layers, their attention types) if `model` has the layer described in
    the module docstring, else None."""
    if type(model).__name__ not in ARCHITECTURES:
        return None
    base = model.model
    layers = list(base.layers)
    types = list(getattr(model.config, "layer_types", None) or ["full_attention"] * len(layers))
    for layer in layers:
        if not type(layer).__name__.endswith("DecoderLayer"):  # wrapped (FSDP) or replaced
            return None
        attn, mlp = layer.self_attn, layer.mlp
        if any(hasattr(attn, extra) for extra in ("q_norm", "k_norm", "sinks")) or not hasattr(mlp, "gate_proj"):
            return None
        for norm in (layer.input_layernorm, layer.post_attention_layernorm):
            if not type(norm).__name__.endswith("RMSNorm") or not hasattr(norm, "variance_epsilon"):
                return None
    if getattr(model.config, "final_logit_softcapping", None) or getattr(model.config, "logit_scale", None):
        return None
    return base, layers, types


def _hidden(base: Any, layers: list[Any], types: list[str], ids: torch.Tensor, masks: dict[str, torch.Tensor],
            pos: torch.Tensor, cache: Any | None) -> torch.Tensor:
    """The last layer's output [B, Q, hidden] (before the final norm); `cache` None: attention over
    the fed tokens only."""
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
        if cache is not None:
            k, v = cache.update(k, v, i)
        o = F.scaled_dot_product_attention(q, k, v, attn_mask=masks.get(types[i], masks["full_attention"]),
                                           scale=attn.scaling, enable_gqa=q.shape[1] != k.shape[1])
        x = x + F.linear(o.transpose(1, 2).reshape(B, Q, -1), attn.o_proj.weight, attn.o_proj.bias)
        h = _rms(x, layer.post_attention_layernorm)
        gate = mlp.act_fn(F.linear(h, mlp.gate_proj.weight, mlp.gate_proj.bias))
        up = F.linear(h, mlp.up_proj.weight, mlp.up_proj.bias)
        x = x + F.linear(gate * up, mlp.down_proj.weight, mlp.down_proj.bias)
    return x


def _head(model: Any, base: Any, x: torch.Tensor) -> torch.Tensor:
    return F.linear(_rms(x, base.norm), model.lm_head.weight, getattr(model.lm_head, "bias", None))


def decoder_forward(model: Any) -> Forward | None:
    """A forward (ids [B, Q], masks per layer type [B, 1, Q, W], position ids [B, Q], cache, last)
    -> logits [B, vocab] after each row's last position, or with `last` (a packed forward, B = 1)
    [len(last), vocab] at those positions; None if `model` is not of that shape."""
    shape = _shape(model)
    if shape is None:
        return None
    base, layers, types = shape

    def forward(ids: torch.Tensor, masks: dict[str, torch.Tensor], pos: torch.Tensor, cache: Any,
                last: torch.Tensor | None = None) -> torch.Tensor:
        x = _hidden(base, layers, types, ids, masks, pos, cache)
        return _head(model, base, x[:, -1] if last is None else x[0, last])

    return forward


Logits = Callable[[torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor]


def decoder_logits(model: Any) -> Logits | None:
    """A forward (ids [B, Q], attention mask [B, Q] of right-padded rows, positions [P]) -> logits
    [B, P, vocab] at those positions: what ``model(input_ids=ids, attention_mask=mask,
    use_cache=False, logits_to_keep=positions).logits`` gives, with gradients; None if `model` is
    not of the shape in the module docstring, has attention dropout, or checkpoints gradients."""
    shape = _shape(model)
    if shape is None or float(getattr(model.config, "attention_dropout", 0.0) or 0.0) > 0.0:
        return None
    if getattr(model, "is_gradient_checkpointing", False):
        return None
    base, layers, types = shape
    window = getattr(model.config, "sliding_window", None)

    def logits(ids: torch.Tensor, attention_mask: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        B, Q = ids.shape
        dev = ids.device
        pos = torch.arange(Q, device=dev)
        causal = pos[None, :] <= pos[:, None]  # [query, key]
        full = causal[None] & attention_mask.bool()[:, None, :]  # a pad key is seen by no query
        full[..., 0] |= ~full.any(-1)  # a query that sees nothing (a row of padding) looks at column 0: no NaN
        masks = {"full_attention": full[:, None]}
        if "sliding_attention" in types and window:
            masks["sliding_attention"] = (full & (pos[None, :] > pos[:, None] - window))[:, None]
        x = _hidden(base, layers, types, ids, masks, pos[None].expand(B, Q), None)
        return _head(model, base, x[:, positions])

    return logits


def _rms(x: torch.Tensor, norm: Any) -> torch.Tensor:
    xf = x.float()
    return norm.weight * (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + norm.variance_epsilon)).to(x.dtype)


def _rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return x * cos + torch.cat((-x[..., half:], x[..., :half]), dim=-1) * sin
