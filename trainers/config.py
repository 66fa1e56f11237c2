"""Configuration of the trainer process: a frozen pydantic model under the `trainer` section.

`TrainRunConfig` is the root config of `astraflow train`: every shared section of
`AstraflowConfig` (kafka, topics, run_dir, ...) plus `trainer`. It loads like every other
config (file, ASTRAFLOW__* environment, --set overrides) and is written as JSON into the run
directory. Kept free of torch / Lightning imports so `astraflow train --help` stays instant.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import ClassVar, Literal

from pydantic import ConfigDict, Field, model_validator

from astraflow.config import AstraflowConfig, FrozenSettings
from astraflow.errors import RLError
from astraflow.rl.loss_config import Mode, PolicyLossConfig


@dataclass(frozen=True, slots=True)
class LossSettings(PolicyLossConfig):
    """The trainer's policy loss: `astraflow.rl.PolicyLossConfig` (its fields, their meaning and
    checks) with the trainer's defaults, decoupled PPO with clip-higher (eps_high 0.28), which
    suit asynchronous training on stale samples; the plain `PolicyLossConfig` keeps PPO's.
    `max_tokens` may stay None with `seq_mean_token_sum_norm`: the trainer then uses its longest
    sample (`trainer.max_seq_len`, else the model's context), never the padded batch length.
    Validated like a section of the config: pydantic checks the field types, then the checks of
    `PolicyLossConfig` run, their RLError turned into a ValueError so pydantic reports it with the
    field's path (`trainer.loss`) like any other invalid setting."""

    mode: Mode = "decoupled"
    eps_high: float = 0.28
    max_tokens_given_later: ClassVar[bool] = True
    __pydantic_config__ = ConfigDict(extra="forbid")  # a typo in a field name is an error, as in every section

    def __post_init__(self) -> None:
        try:
            PolicyLossConfig.__post_init__(self)
        except RLError as exc:
            raise ValueError(str(exc)) from exc


class TrainerSettings(FrozenSettings):
    """One policy's trainer."""

    policy: str = "policy"
    """Policy name: reads af.<experiment>.<policy>.train, publishes af.<experiment>.<policy>.weights."""
    model_dir: Path | None = None
    """Local directory of the causal LM to train (transformers format); required."""
    ref_model_dir: Path | None = None
    """Reference policy for the KL term; defaults to `model_dir` (the initial policy)."""
    seed: int = 0
    """Seed of torch's RNGs."""

    # optimisation
    lr: float = 1e-5
    """AdamW learning rate."""
    weight_decay: float = 0.0
    """AdamW weight decay."""
    betas: tuple[float, float] = (0.9, 0.999)
    """AdamW betas."""
    warmup_steps: int = 0
    """Linear learning-rate warmup over this many optimizer steps."""
    grad_clip: float | None = 1.0
    """Gradient norm clipping; None disables it."""
    minibatches: int = 1
    """Optimizer steps per pass over a batch: the batch is split into this many minibatches."""
    ppo_epochs: int = 1
    """Passes over each batch. With minibatches x ppo_epochs > 1, decoupled PPO's proximal policy
    is the weights before the batch's first step (recomputed once per batch), so its clip acts."""
    loss: LossSettings = Field(default_factory=LossSettings)
    """The configured loss; the control topic's `trainer/<policy>.loss` command replaces it while
    the trainer runs (docs/training.md, "Switching the loss")."""

    # batches (one batch = minibatches x ppo_epochs optimizer steps)
    batch_size: int = 32
    """Most samples in one batch."""
    token_budget: int | None = None
    """Most padded tokens (samples x longest sample) in one batch; None: no token limit."""
    max_wait_s: float = 2.0
    """Train on a partial batch once nothing new arrived for this long (never wait for rollouts)."""
    start_offsets: Literal["earliest", "latest"] = "earliest"
    """Where to start reading the train topic when no checkpoint exists."""
    stop_when_idle_s: float | None = None
    """End training when the train topic stays empty this long; None: wait for data forever."""

    # what a sample may be (anything else goes to the DLQ with the field and the limit)
    max_seq_len: int | None = None
    """Most tokens in one sample; None: the model's `max_position_embeddings` (else 32768)."""
    max_abs_advantage: float = 100.0
    """Samples whose |advantage| exceeds this are refused."""
    min_behaviour_logprob: float = -1000.0
    """Behaviour logprobs of trained tokens must lie in [this, 0]."""
    max_staleness: int | None = 8
    """A sample whose oldest trained token is more than this many versions behind the newest
    published version when the trainer reads it is refused (DLQ, `stale`): queueing in Kafka
    must not exceed the curate filter's bound. None: no limit."""
    dedup_window: int = 100_000
    """Sample ids remembered as trained (kept in every checkpoint); a sample id seen again within
    this many trained samples is dropped (DLQ, `DuplicateSample`) instead of trained twice."""

    # publication
    publish_every_steps: int = 1
    """K: publish a policy version every K trained batches (K optimizer steps when a batch takes
    one), each right after a checkpoint of the state that produced it (checkpoint, then publish:
    docs/training.md)."""
    snapshot_every_versions: int = 20
    """N: a full snapshot every N versions (deltas in between)."""
    publish_dtype: Literal["bfloat16", "float16", "float32"] = "bfloat16"
    """dtype of the published weights (the trainer keeps fp32 master weights)."""
    chunk_bytes: int = 1024 * 1024 - 64 * 1024
    """Size of in-band WeightChunks; must stay below the weights topic's max.message.bytes."""
    inband_max_bytes: int = 64 * 1024 * 1024
    """Payloads larger than this go to `weight_store` (claim-check)."""
    weight_store: str | None = None
    """Directory or fsspec URI for large payloads; None: everything in-band."""

    # run control
    max_steps: int = -1
    """Stop after the batch during which this many optimizer steps in total were reached (-1: no limit)."""
    max_time_s: float | None = None
    """Stop after this much wall time in this process."""
    checkpoint_dir: Path | None = None
    """Checkpoints (weights, optimizer, consumed offsets); default <run_dir>/<experiment>/<policy>/checkpoints."""
    checkpoint_every_steps: int = 10
    """Also checkpoint every this many trained batches (every publication checkpoints anyway)."""
    keep_checkpoints: int = 2
    """Newest checkpoints to keep."""
    resume: bool = True
    """Resume from the newest checkpoint in `checkpoint_dir` when there is one."""
    trained_log: Path | None = None
    """JSONL log of every sample in published weights (sample_id, step, version, partition,
    offset), always written; default <run_dir>/<experiment>/<policy>/trained-samples.jsonl."""
    logger: Literal["tensorboard+csv", "tensorboard", "csv", "none"] = "tensorboard+csv"
    """Where the training curves go, under <run_dir>/<experiment>/<policy>: TensorBoard scalars
    (tensorboard/, trainers.tblog; no TensorBoard package needed) and/or Lightning's CSV
    (lightning/version_N/metrics.csv)."""
    metrics_every_steps: int = 1
    """Send metrics to the metrics topic every this many trained batches."""
    progress_bar: bool = True
    """Lightning's progress bar."""

    # hardware
    accelerator: Literal["cpu", "gpu", "auto"] = "cpu"
    """Lightning accelerator."""
    devices: int | Literal["auto"] = 1
    """Devices per node."""
    strategy: Literal["auto", "ddp", "fsdp"] = "auto"
    """Lightning strategy; ddp / fsdp for several GPUs."""
    precision: Literal["32-true", "bf16-mixed", "16-mixed", "bf16-true"] = "32-true"
    """Lightning precision; the master weights stay fp32 except with bf16-true."""
    collective_timeout_s: float = 600.0
    """With several ranks: how long a rank waits in a collective (gradient all-reduce, the batch
    plan, a checkpoint barrier) before the job ends with an error; a rank that died ends the job
    within this long (at once on CPU/gloo, whose peers see the closed connection). Rank 0
    broadcasts a heartbeat every few seconds while it waits for samples, so an idle topic never
    trips it; a Kafka outage longer than this while rank 0 publishes or dead-letters does (the
    job then resumes from its checkpoint when restarted)."""

    @model_validator(mode="after")
    def _check(self) -> TrainerSettings:
        if self.batch_size < 1:
            raise ValueError("trainer.batch_size must be >= 1")
        if self.minibatches < 1 or self.ppo_epochs < 1:
            raise ValueError("trainer.minibatches and trainer.ppo_epochs must be >= 1")
        if self.minibatches > self.batch_size:
            raise ValueError(f"trainer.minibatches ({self.minibatches}) cannot exceed trainer.batch_size ({self.batch_size})")
        if self.grad_clip is not None and not self.grad_clip > 0:
            raise ValueError("trainer.grad_clip must be > 0, or null to switch clipping off")
        if self.token_budget is not None and self.token_budget < 1:
            raise ValueError("trainer.token_budget must be >= 1 or unset")
        if self.publish_every_steps < 1 or self.snapshot_every_versions < 1:
            raise ValueError("trainer.publish_every_steps and trainer.snapshot_every_versions must be >= 1")
        if self.checkpoint_every_steps < 1 or self.keep_checkpoints < 1:
            raise ValueError("trainer.checkpoint_every_steps and trainer.keep_checkpoints must be >= 1")
        if self.max_seq_len is not None and self.max_seq_len < 2:
            raise ValueError("trainer.max_seq_len must be >= 2 or unset")
        if self.max_abs_advantage <= 0 or self.min_behaviour_logprob >= 0:
            raise ValueError("trainer.max_abs_advantage must be > 0 and trainer.min_behaviour_logprob < 0")
        if self.dedup_window < 1:
            raise ValueError("trainer.dedup_window must be >= 1")
        if not self.collective_timeout_s >= 10:
            raise ValueError("trainer.collective_timeout_s must be >= 10 (seconds)")
        if self.chunk_bytes < 1024:
            raise ValueError("trainer.chunk_bytes must be at least 1024")
        return self


class TrainRunConfig(AstraflowConfig):
    """Root config of `astraflow train`."""

    trainer: TrainerSettings = Field(default_factory=TrainerSettings)

    def checkpoint_dir(self) -> Path:
        t = self.trainer
        return t.checkpoint_dir or self.run_dir / self.experiment / t.policy / "checkpoints"

    def log_dir(self) -> Path:
        return self.run_dir / self.experiment / self.trainer.policy

    def trained_log(self) -> Path:
        return self.trainer.trained_log or self.log_dir() / "trained-samples.jsonl"
