"""RL math for the trainer: token logprobs and entropies, policy losses (PPO, GRPO, decoupled PPO, TIS, MIS, M2PO).

The loss settings (`PolicyLossConfig`, `astraflow.rl.loss_config`) load without torch, so
configuration code can use them; the torch functions load on first use of their name.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

from astraflow.rl.loss_config import MODES, Aggregation, KLEstimator, Mode, PolicyLossConfig

if TYPE_CHECKING:
    from astraflow.rl.logprobs import (
        entropy_from_logits,
        masked_mean,
        scale_logits,
        sequence_logprobs,
        token_logprobs,
        token_logprobs_and_entropy,
    )
    from astraflow.rl.losses import (
        PolicyLossOutput,
        aggregate,
        aggregation_count,
        broadcast_advantages,
        data_parallel_normaliser,
        grpo_loss,
        kl_penalty,
        policy_loss,
        ppo_clip_token_loss,
        truncated_is_weights,
    )

_TORCH = {
    "astraflow.rl.logprobs": ("entropy_from_logits", "masked_mean", "scale_logits", "sequence_logprobs",
                              "token_logprobs", "token_logprobs_and_entropy"),
    "astraflow.rl.losses": ("PolicyLossOutput", "aggregate", "aggregation_count", "broadcast_advantages",
                            "data_parallel_normaliser", "grpo_loss", "kl_penalty",
                            "policy_loss", "ppo_clip_token_loss", "truncated_is_weights"),
}
_WHERE = {name: module for module, names in _TORCH.items() for name in names}


def __getattr__(name: str) -> Any:
    module = _WHERE.get(name)
    if module is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    return getattr(importlib.import_module(module), name)


__all__ = [
    "MODES",
    "Aggregation",
    "KLEstimator",
    "Mode",
    "PolicyLossConfig",
    "PolicyLossOutput",
    "aggregate",
    "aggregation_count",
    "broadcast_advantages",
    "data_parallel_normaliser",
    "entropy_from_logits",
    "grpo_loss",
    "kl_penalty",
    "masked_mean",
    "policy_loss",
    "ppo_clip_token_loss",
    "scale_logits",
    "sequence_logprobs",
    "token_logprobs",
    "token_logprobs_and_entropy",
    "truncated_is_weights",
]
