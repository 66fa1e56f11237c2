"""The settings of `astraflow.rl.policy_loss` (`PolicyLossConfig`), free of torch so configuration
code (`trainers.config`, the CLI) can use them without loading it. What each mode and aggregation
computes: `astraflow.rl.losses`.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar, Literal

from astraflow.errors import RLError

Aggregation = Literal["token_mean", "seq_mean_token_mean", "seq_mean_token_sum_norm"]
KLEstimator = Literal["k1", "k2", "k3"]
Mode = Literal["ppo", "decoupled", "tis", "mis", "m2po"]
MODES = ("ppo", "decoupled", "tis", "mis", "m2po")


@dataclass(frozen=True, slots=True)
class PolicyLossConfig:
    """Settings of `policy_loss`; validated on construction (RLError says what is wrong).

    The one definition of the loss settings: the trainer's `trainers.config.LossSettings` (the
    `trainer.loss` config section and the control topic's loss commands) derives from it with the
    trainer's defaults (decoupled PPO with clip-higher).
    """

    mode: Mode = "ppo"
    """The off-policy correction (`astraflow.rl.losses`, docs/training.md): `ppo` (ratio against the
    behaviour logprobs), `decoupled` (decoupled PPO: clip against the proximal policy, truncated IS
    weight against behaviour), `tis` / `mis` (truncated / masked importance sampling), `m2po`
    (second-moment masking)."""
    eps_low: float = 0.2
    """Ratio clipped below at 1 - eps_low."""
    eps_high: float = 0.2
    """Ratio clipped above at 1 + eps_high (0.28 for DAPO's clip-higher)."""
    dual_clip: float | None = 3.0
    """`ppo`/`decoupled`: a negative-advantage token's loss is capped at -dual_clip x A; None: off."""
    aggregation: Aggregation = "token_mean"
    """How token losses become one number: token-level (`token_mean`) or sequence-level;
    `seq_mean_token_sum_norm` is Dr. GRPO."""
    max_tokens: int | None = None
    """Dr. GRPO's normalising constant: required by `seq_mean_token_sum_norm` (never the padded
    batch length)."""
    tis_cap: float | None = 2.0
    """`decoupled`/`tis`: truncation of the importance weight (None: none); `mis`: tokens whose
    ratio is outside [1/tis_cap, tis_cap] are masked."""
    m2_threshold: float = 0.04
    """`m2po`: bound on the mean squared log-ratio of the kept tokens."""
    staleness_weight: Literal["none", "inverse"] = "none"
    """`inverse`: each token weighted 1 / max(1, versions behind the trainer)."""
    max_staleness: int | None = None
    """Tokens more versions behind than this get weight 0 (None: no limit)."""
    kl_coef: float = 0.0
    """Weight of the KL penalty to the reference policy (needs ref_logprobs)."""
    kl_estimator: KLEstimator = "k3"
    """KL estimator per token. k1: log-ratio, k2: half squared, k3: unbiased, non-negative."""
    entropy_coef: float = 0.0
    """Weight of the entropy bonus (needs entropy)."""

    # Whether `seq_mean_token_sum_norm` needs `max_tokens` here; False where the user of the
    # settings fills it in (the trainer: its longest sample).
    max_tokens_given_later: ClassVar[bool] = False

    def __post_init__(self) -> None:
        if not 0.0 <= self.eps_low < 1.0 or self.eps_high < 0.0:
            raise RLError(f"need 0 <= eps_low < 1 and eps_high >= 0, got {self.eps_low}, {self.eps_high}")
        if self.mode not in MODES:
            raise RLError(f"unknown mode {self.mode!r}: use one of {', '.join(MODES)}")
        if self.tis_cap is not None and self.tis_cap <= 0.0:
            raise RLError(f"tis_cap must be positive or None, got {self.tis_cap}")
        if self.mode == "mis" and (self.tis_cap is None or self.tis_cap <= 1.0):
            raise RLError(f"mode 'mis' masks ratios outside [1/tis_cap, tis_cap]: set tis_cap > 1, got {self.tis_cap}")
        if self.dual_clip is not None and self.dual_clip <= 1.0:
            raise RLError(f"dual_clip must be > 1 or None, got {self.dual_clip}")
        if self.m2_threshold < 0.0:
            raise RLError(f"m2_threshold must be >= 0, got {self.m2_threshold}")
        if self.max_staleness is not None and self.max_staleness < 0:
            raise RLError(f"max_staleness must be >= 0 or None, got {self.max_staleness}")
        if self.staleness_weight not in ("none", "inverse"):
            raise RLError(f"unknown staleness_weight {self.staleness_weight!r}: use 'none' or 'inverse'")
        if self.max_tokens is not None and self.max_tokens < 1:
            raise RLError(f"max_tokens must be >= 1 or None, got {self.max_tokens}")
        if self.aggregation not in ("token_mean", "seq_mean_token_mean", "seq_mean_token_sum_norm"):
            raise RLError(f"unknown aggregation {self.aggregation!r}")
        if self.aggregation == "seq_mean_token_sum_norm" and self.max_tokens is None and not self.max_tokens_given_later:
            raise RLError(
                "seq_mean_token_sum_norm (Dr. GRPO) divides by a constant: set max_tokens "
                "(the trainer uses trainer.max_seq_len), never the padded batch length"
            )
