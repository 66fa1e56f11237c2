"""RL math for the trainer: token logprobs and entropies, policy losses (PPO, GRPO, decoupled PPO, TIS, MIS, M2PO)."""

from astraflow.rl.logprobs import (
    entropy_from_logits,
    masked_mean,
    scale_logits,
    sequence_logprobs,
    token_logprobs,
)
from astraflow.rl.losses import (
    MODES,
    Aggregation,
    Mode,
    PolicyLossConfig,
    PolicyLossOutput,
    aggregate,
    broadcast_advantages,
    grpo_loss,
    kl_penalty,
    policy_loss,
    ppo_clip_token_loss,
    truncated_is_weights,
)

__all__ = [
    "MODES",
    "Aggregation",
    "Mode",
    "PolicyLossConfig",
    "PolicyLossOutput",
    "aggregate",
    "broadcast_advantages",
    "entropy_from_logits",
    "grpo_loss",
    "kl_penalty",
    "masked_mean",
    "policy_loss",
    "ppo_clip_token_loss",
    "scale_logits",
    "sequence_logprobs",
    "token_logprobs",
    "truncated_is_weights",
]
