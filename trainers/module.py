"""The LightningModule that trains a causal LM with PPO-clip / GRPO on TrainSample batches.

The loss math lives in `astraflow.rl` (pure, tested); this module only runs the model, wires
the batch into `policy_loss` and reports metrics. Batches come from `trainers.batching.collate`:
per-token behaviour logprobs recorded at rollout (for PPO's ratio or decoupled PPO's truncated
importance weights), one advantage per sequence (GRPO), and the sample's `min_version` for the
staleness histogram (trainer version - min_version). The optional reference policy for the KL
term is a frozen copy kept out of the checkpoint.

Optimization is manual: a batch takes `ppo_epochs` passes of `minibatches` optimizer steps
each (one step by default). With more than one, decoupled PPO's proximal policy is real: the
logprobs of the weights before the batch's first step, computed once without gradients, so
from the second step on the clip acts on ``pi / pi_prox``. The loss can be replaced between
batches (`set_loss`, used by the control topic's `trainer/<policy>.loss` command).

A step whose loss or gradients are not finite is skipped: the gradients are dropped before the
optimizer sees them (AdamW leaves a parameter without a gradient untouched: no update, no
weight decay, no moment change), `skipped_reason` says why, the `step_skipped` / `steps_skipped`
metrics report it, the batch's remaining steps are not taken (its earlier steps stay applied)
and the publishing callback dead-letters the batch's samples.
"""

from __future__ import annotations

import collections
import dataclasses
import functools
import inspect
import logging
import time
from pathlib import Path
from typing import Any, Literal

import lightning as L
import torch

from astraflow.errors import ModelError, RLError
from astraflow.rl import (
    PolicyLossConfig,
    aggregation_count,
    data_parallel_normaliser,
    policy_loss,
    scale_logits,
    token_logprobs,
    token_logprobs_and_entropy,
)
from trainers.batching import length_chunks, minibatch_rows
from trainers.config import LossSettings

log = logging.getLogger(__name__)

# Staleness buckets (versions behind the trainer): 0, 1, 2, 3, 4-7, 8+.
STALENESS_BUCKETS = ((0, 0, "0"), (1, 1, "1"), (2, 2, "2"), (3, 3, "3"), (4, 7, "4-7"), (8, None, "8+"))


def load_causal_lm(model_dir: str | Path) -> torch.nn.Module:
    """A transformers causal LM from a local directory, fp32 (the master weights), train mode."""
    from transformers import AutoModelForCausalLM

    path = Path(model_dir)
    if not (path / "config.json").is_file():
        raise ModelError(
            f"no model in {path}: pass --model DIR with a transformers model "
            "(e.g. one built by astraflow.models.init_tiny)"
        )
    try:
        model = AutoModelForCausalLM.from_pretrained(path, local_files_only=True, dtype=torch.float32)
    except (OSError, ValueError) as exc:
        raise ModelError(f"cannot load the model in {path}: {exc}") from exc
    model.train()
    return model


def staleness_histogram(trainer_version: int, min_versions: torch.Tensor) -> dict[str, int]:
    """Counts of samples per staleness bucket (trainer version - sample min_version, >= 0)."""
    counts = collections.Counter()
    for v in min_versions.tolist():
        lag = max(0, trainer_version - int(v))
        for lo, hi, name in STALENESS_BUCKETS:
            if lag >= lo and (hi is None or lag <= hi):
                counts[name] += 1
                break
    return {name: counts.get(name, 0) for _, _, name in STALENESS_BUCKETS}


class PolicyTrainer(L.LightningModule):
    """PPO-clip / GRPO (token- or sequence-level), decoupled PPO with TIS, KL to a reference, entropy."""

    def __init__(
        self,
        model_dir: str | Path,
        loss: LossSettings = LossSettings(),
        *,
        lr: float = 1e-5,
        weight_decay: float = 0.0,
        betas: tuple[float, float] = (0.9, 0.999),
        warmup_steps: int = 0,
        ref_model_dir: str | Path | None = None,
        model: torch.nn.Module | None = None,
        max_seq_len: int | None = None,
        grad_clip: float | None = 1.0,
        minibatches: int = 1,
        ppo_epochs: int = 1,
    ) -> None:
        super().__init__()
        if minibatches < 1 or ppo_epochs < 1:
            raise ModelError(f"minibatches and ppo_epochs must be >= 1, got {minibatches} and {ppo_epochs}")
        if grad_clip is not None and not grad_clip > 0:
            raise ModelError(f"grad_clip must be > 0 or None, got {grad_clip}")
        self.automatic_optimization = False  # several optimizer steps per batch (module docstring)
        self.model = model if model is not None else load_causal_lm(model_dir)
        self.max_seq_len = max_seq_len
        self.loss_settings, self.loss_config = loss, self.loss_config_of(loss)
        self.lr, self.weight_decay, self.betas, self.warmup_steps = lr, weight_decay, tuple(betas), warmup_steps
        self.grad_clip, self.minibatches, self.ppo_epochs = grad_clip, minibatches, ppo_epochs
        # A plain list keeps the frozen reference out of state_dict, the optimizer and checkpoints.
        self._ref: list[torch.nn.Module] = []
        if loss.kl_coef > 0:
            ref = load_causal_lm(ref_model_dir or model_dir)
            ref.eval().requires_grad_(False)
            self._ref.append(ref)
        self.policy_version = 0  # last published version (set by the publishing callback)
        self.loss_control_version = 0  # control version of the loss in use (0: configured; trainers.loss_control)
        self.skipped_reason: str | None = None  # why the current step was skipped (None: it was not)
        self.steps_skipped = 0  # steps skipped for non-finite loss or gradients, across restarts
        self._loss_finite = True
        self.last_metrics: dict[str, float] = {}  # metrics of the last step, for the Kafka metrics callback
        self.last_staleness: dict[str, int] = {}
        self._last_step_at: float | None = None
        self._times: collections.Counter[str] = collections.Counter()  # seconds per part of this step (metrics)
        self.warm_up_s: float | None = None  # the warm-up's duration, reported with the next step (`warm_up`)

    def on_fit_start(self) -> None:
        for ref in self._ref:
            ref.to(self.device)

    def warm_up(self, batch: dict[str, Any]) -> None:
        """One forward and backward pass on `batch` whose gradients are dropped: weights, optimizer,
        versions and counters stay as they are. The stream calls it once with the first batch's
        samples while the rest are still arriving (`trainers.data`), so the process's one-time
        costs (first kernels and allocations, autograd's set-up) are paid during that wait instead
        of in the first optimizer step. Skipped in a distributed run, whose backward would wait
        for the other ranks."""
        if torch.distributed.is_available() and torch.distributed.is_initialized():
            return
        t = time.perf_counter()
        batch = {k: v.to(self.device) if torch.is_tensor(v) else v for k, v in batch.items()}
        loss, _ = self.compute_loss(batch)
        loss.backward()
        for p in self.model.parameters():
            p.grad = None
        self.warm_up_s = time.perf_counter() - t

    def forward(self, input_ids: torch.Tensor, attention_mask: torch.Tensor) -> torch.Tensor:
        return self.model(input_ids=input_ids, attention_mask=attention_mask, use_cache=False).logits

    def scored_logprobs(self, batch: dict[str, Any], model: torch.nn.Module | None = None,
                        entropy: Literal["grad", "metric"] | None = None) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Logprob [B, T] of each trained token (``loss_mask``) under `model` (default: the policy),
        in the distribution its sample was drawn from (logits divided by its sampling temperature:
        the rollout node recorded ``log_softmax(logits / T)``), 0 at every other position; with
        `entropy`, that distribution's entropy at the same positions ("grad": with gradients, for an
        entropy bonus; "metric": without).

        No loss or metric reads an untrained position, so none is computed: the rows go through the
        model in chunks of similar length (`trainers.batching.length_chunks`), each padded to its
        own longest row only, and the LM head and softmax run only on the positions whose next token
        is trained (`logits_to_keep`, where the model takes it). The values are those of one forward
        pass over the whole padded batch (right padding: no real token attends to a pad)."""
        model = self.model if model is None else model
        ids, attn, mask = batch["input_ids"], batch["attention_mask"], batch["loss_mask"].bool()
        temps = batch.get("temperatures")
        logprobs = torch.zeros(ids.shape, dtype=torch.float32, device=ids.device)
        ent = torch.zeros_like(logprobs) if entropy is not None else None
        lengths = attn.sum(dim=1).tolist()
        keeps_logits = _takes_logits_to_keep(type(model))
        for chunk in length_chunks(lengths):
            rows = torch.tensor(chunk, device=ids.device)
            width = max(int(max(lengths[i] for i in chunk)), 2)
            sub_ids, sub_attn, sub_mask = ids[rows, :width], attn[rows, :width], mask[rows, :width]
            cols = torch.nonzero(sub_mask[:, 1:].any(dim=0)).squeeze(1)  # logits at t score token t + 1
            if cols.numel() == 0:
                continue
            if keeps_logits:
                logits = model(input_ids=sub_ids, attention_mask=sub_attn, use_cache=False, logits_to_keep=cols).logits
            else:
                logits = model(input_ids=sub_ids, attention_mask=sub_attn, use_cache=False).logits[:, cols]
            if temps is not None:
                logits = scale_logits(logits, temps[rows])
            targets, trained = sub_ids[:, cols + 1], sub_mask[:, cols + 1]
            if entropy is None:
                lp = token_logprobs(logits, targets)
            else:
                lp, h = token_logprobs_and_entropy(logits, targets, entropy_grad=entropy == "grad")
                ent[rows[:, None], cols[None, :] + 1] = torch.where(trained, h, torch.zeros_like(h))
            logprobs[rows[:, None], cols[None, :] + 1] = torch.where(trained, lp, torch.zeros_like(lp))
        return logprobs, ent

    def loss_config_of(self, loss: LossSettings) -> PolicyLossConfig:
        """The `PolicyLossConfig` of `loss` for this model (raises RLError when it is not valid)."""
        settings = dataclasses.asdict(loss)
        if loss.aggregation == "seq_mean_token_sum_norm" and loss.max_tokens is None:
            # Dr. GRPO divides by a constant: the longest sample the trainer accepts, never the padded length.
            cfg = getattr(self.model, "config", None)
            settings["max_tokens"] = self.max_seq_len or int(getattr(cfg, "max_position_embeddings", 0) or 32768)
        return PolicyLossConfig(**settings)

    def set_loss(self, loss: LossSettings) -> None:
        """Use `loss` from the next batch on; raises RLError (keeping the current loss) when it is
        invalid or needs what this trainer did not load (a reference model for kl_coef > 0)."""
        config = self.loss_config_of(loss)
        if config.kl_coef > 0 and not self._ref:
            raise RLError("kl_coef > 0 needs the reference model, loaded only at start: restart the trainer "
                          "with trainer.loss.kl_coef > 0")
        self.loss_settings, self.loss_config = loss, config

    @property
    def steps_per_batch(self) -> int:
        return self.minibatches * self.ppo_epochs

    def compute_loss(self, batch: dict[str, Any], proximal_logprobs: torch.Tensor | None = None) -> tuple[torch.Tensor, dict[str, float]]:
        """Policy loss and metrics of one batch (no logging, no side effects); `proximal_logprobs`
        [B, T]: decoupled PPO's proximal policy (None: the current weights, detached)."""
        ids, attn, mask = batch["input_ids"], batch["attention_mask"], batch["loss_mask"]
        # The entropy of the distribution each trained token was drawn from: a metric, or a bonus in the loss.
        logprobs, ent = self.scored_logprobs(batch, entropy="grad" if self.loss_config.entropy_coef > 0 else "metric")
        ref_logprobs = None
        if self._ref:
            with torch.no_grad():
                ref_logprobs, _ = self.scored_logprobs(batch, self._ref[0])
        lags = self.token_lags(batch)
        out = policy_loss(
            logprobs,
            batch["behaviour_logprobs"],
            batch["advantages"],
            mask,
            self.loss_config,
            proximal_logprobs=proximal_logprobs,
            ref_logprobs=ref_logprobs,
            entropy=ent,
            token_lags=lags,
            normaliser=self.data_parallel_normaliser(mask),
        )
        metrics = dict(out.metrics)
        metrics["reward"] = batch["rewards"].float().mean().item()
        metrics["advantage_abs"] = batch["advantages"].abs().mean().item()
        metrics["samples"] = float(ids.shape[0])
        metrics["seq_len"] = float(attn.sum(dim=1).float().mean().item())
        if lags is not None and bool(mask.any()):  # per token: a sample's tokens may span versions
            token_lags = lags[mask.bool()].float()
            metrics["token_staleness_mean"] = token_lags.mean().item()
            metrics["token_staleness_max"] = token_lags.max().item()
        return out.loss, metrics

    @property
    def world_size(self) -> int:
        return int(self.trainer.world_size) if self._trainer is not None else 1

    @property
    def sharded(self) -> bool:
        """Whether the policy model is sharded (FSDP, `trainers.distributed`)."""
        return hasattr(self.model, "clip_grad_norm_")

    def data_parallel_normaliser(self, mask: torch.Tensor) -> torch.Tensor | None:
        """With several ranks, what this step's loss divides by: the count of the whole step over
        every rank (one all-reduce), so the averaged gradients are one rank's on the same samples
        (`astraflow.rl.data_parallel_normaliser`); None on one rank (the batch's own count)."""
        world = self.world_size
        if world < 2:
            return None
        count = aggregation_count(mask, self.loss_config.aggregation).to(self.device)
        total = self.trainer.strategy.reduce(count, reduce_op="sum")
        return data_parallel_normaliser(total, world)

    def token_lags(self, batch: dict[str, Any]) -> torch.Tensor | None:
        """Versions behind the trainer of each trained token, at this step (0 where not trained)."""
        versions = batch.get("versions")
        if versions is None:
            return None
        return torch.where(batch["loss_mask"].bool(), self.policy_version - versions, torch.zeros_like(versions))

    def training_step(self, batch: dict[str, Any], batch_idx: int) -> torch.Tensor:
        now = time.perf_counter()
        self.skipped_reason = None
        self._times.clear()
        first_step = self.trainer.global_step if self._trainer is not None else 0  # before this batch's optimizer steps
        n = int(batch["input_ids"].shape[0])
        proximal = None
        if self.steps_per_batch > 1 and self.loss_config.mode == "decoupled":
            with torch.no_grad():  # the proximal policy: the weights before this batch's first step
                proximal, _ = self.scored_logprobs(batch)
        meta = batch.get("meta")
        dm = getattr(self.trainer, "datamodule", None) if self._trainer is not None else None
        if meta is not None and hasattr(dm, "mark_trained"):
            # Before the first optimizer step and any checkpoint of this batch: these offsets are now trained.
            t = time.perf_counter()
            dm.mark_trained(meta)
            self._times["commit_s"] += time.perf_counter() - t
        parts = [torch.tensor(p, dtype=torch.long) for p in split_rows(n, self.minibatches, meta)]
        seen: list[dict[str, float]] = []
        loss = torch.zeros(())
        for _ in range(self.ppo_epochs):
            for part in parts:
                sub = batch if len(parts) == 1 else rows(batch, part)
                t = time.perf_counter()
                loss, metrics = self.compute_loss(sub, None if proximal is None else proximal[part])
                self._times["forward_s"] += time.perf_counter() - t
                seen.append(metrics)
                self._optimizer_step(loss)
                if self.skipped_reason is not None:
                    break
            if self.skipped_reason is not None:
                break
        metrics = mean_metrics(seen)
        if self.world_size > 1:  # each rank's loss terms are its share of the whole batch's: summed
            names = [k for k in ("loss", "pg_loss", "kl_ref", "entropy") if k in metrics]
            shares = torch.tensor([metrics[k] for k in names], dtype=torch.float64, device=self.device)
            totals = self.trainer.strategy.reduce(shares, reduce_op="sum") / self.world_size
            metrics.update(zip(names, (float(v) for v in totals.tolist()), strict=True))
        attn, mask = batch["attention_mask"], batch["loss_mask"]
        metrics.update(samples=float(n), optimizer_steps=float(len(seen)), tokens=float(mask.sum().item()),
                       reward=batch["rewards"].float().mean().item(), advantage_abs=batch["advantages"].abs().mean().item(),
                       seq_len=attn.sum(dim=1).float().mean().item())
        if self.skipped_reason is not None and self.steps_per_batch > 1:
            self.skipped_reason += f" (optimizer step {len(seen)} of {self.steps_per_batch} of this batch; the earlier ones stay applied)"
        metrics["step_skipped"] = 1.0 if self.skipped_reason is not None else 0.0
        metrics["steps_skipped"] = float(self.steps_skipped)
        if self._last_step_at is not None:
            metrics["tokens_per_s"] = metrics["tokens"] / max(now - self._last_step_at, 1e-9)
            metrics["cycle_s"] = now - self._last_step_at  # from the previous step's start to this one's
        self._last_step_at = now
        hist = staleness_histogram(self.policy_version, batch["min_versions"])
        lags = [max(0, self.policy_version - int(v)) for v in batch["min_versions"].tolist()]
        metrics["staleness_mean"] = sum(lags) / max(len(lags), 1)
        metrics["staleness_max"] = float(max(lags, default=0))
        metrics["policy_version"] = float(self.policy_version)
        metrics["loss_control_version"] = float(self.loss_control_version)
        metrics.update(self._times)  # commit_s, forward_s (loss included), backward_s, optimizer_s
        if self.warm_up_s is not None:  # done while this batch was filling
            metrics["warm_up_s"], self.warm_up_s = self.warm_up_s, None
        if meta is not None:  # the stream's share: waiting for and decoding records, collating them
            metrics.update(fetch_s=float(meta.get("fetch_s", 0.0)), collate_s=float(meta.get("collate_s", 0.0)))
        metrics["step_s"] = time.perf_counter() - now  # forward, backward and optimizer steps of this batch
        self.last_metrics, self.last_staleness = metrics, hist
        self.log_to_loggers({**{f"train/{k}": float(v) for k, v in metrics.items()},
                             **{f"staleness/{k}": float(v) for k, v in hist.items()}}, first_step)
        return loss.detach()

    def log_to_loggers(self, values: dict[str, float], step: int) -> None:
        """Hand one step's scalars to the trainer's loggers (TensorBoard, CSV) at `step` (the
        trainer's optimizer steps before this batch), and flush them, as Lightning does.

        Not `self.log_dict`: Lightning keeps every logged key in a result collection of tensors,
        reduced and converted back at the end of the step, which cost more than the optimizer
        step itself (0.02-0.09 s a step for ~45 scalars on the demo model); these are plain floats
        of one step, never accumulated or synced across ranks (the loggers write on rank 0)."""
        if self._trainer is None:
            return
        for logger in self.trainer.loggers:
            logger.log_metrics(values, step=step)
            logger.save()

    def _optimizer_step(self, loss: torch.Tensor) -> None:
        """Backward, clip, step (the hook below drops non-finite gradients), scheduler."""
        opt = self.optimizers()
        self._loss_finite = bool(torch.isfinite(loss.detach()))
        opt.zero_grad(set_to_none=True)
        t = time.perf_counter()
        self.manual_backward(loss)
        t1 = time.perf_counter()
        self._times["backward_s"] += t1 - t
        if self.grad_clip is not None:
            if self.sharded:  # FSDP (trainers.distributed): the norm over every shard
                self.model.clip_grad_norm_(self.grad_clip)
            else:
                self.clip_gradients(opt, gradient_clip_val=self.grad_clip, gradient_clip_algorithm="norm")
        opt.step()
        sched = self.lr_schedulers()
        if sched is not None:
            sched.step()
        self._times["optimizer_s"] += time.perf_counter() - t1

    def on_before_optimizer_step(self, optimizer: torch.optim.Optimizer) -> None:
        """Skip the step (drop every gradient) when the loss or a gradient is not finite."""
        grads = [p.grad for p in self.model.parameters() if p.grad is not None]
        finite = self._loss_finite and (not grads or bool(torch.isfinite(torch.nn.utils.get_total_norm(grads))))
        if self._trainer is not None:  # FSDP shards gradients: skip on every rank or on none
            finite = self.trainer.strategy.reduce_boolean_decision(finite, all=True)
        if finite:
            return
        for p in self.model.parameters():
            p.grad = None
        self.skipped_reason = "loss is not finite" if not self._loss_finite else "gradients are not finite"
        self.steps_skipped += 1
        step = self.trainer.global_step + 1 if self._trainer is not None else -1
        log.warning("step %d skipped: %s (%d skipped so far); its batch's samples go to the DLQ", step, self.skipped_reason,
                    self.steps_skipped)

    def configure_optimizers(self) -> Any:
        opt = torch.optim.AdamW(self.model.parameters(), lr=self.lr, betas=self.betas, weight_decay=self.weight_decay)
        if self.warmup_steps <= 0:
            return opt
        warm = self.warmup_steps
        sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda step: min(1.0, (step + 1) / warm))
        return {"optimizer": opt, "lr_scheduler": {"scheduler": sched, "interval": "step"}}

    def on_save_checkpoint(self, checkpoint: dict[str, Any]) -> None:
        checkpoint["astraflow"] = {"policy_version": self.policy_version, "steps_skipped": self.steps_skipped,
                                   "world_size": self.world_size, "sharded_model": self.sharded}

    def on_load_checkpoint(self, checkpoint: dict[str, Any]) -> None:
        saved = checkpoint.get("astraflow", {})
        if bool(saved.get("sharded_model", False)) != self.sharded:
            was, now = ("fsdp", "ddp or one rank") if saved.get("sharded_model") else ("ddp or one rank", "fsdp")
            raise ModelError(
                f"the newest checkpoint was written with {was}, and this run uses {now}: resuming across the two "
                f"is not supported. Run with the strategy the checkpoint was written with (any --devices), or "
                f"start from the model with another trainer.checkpoint_dir (or trainer.resume=false)")
        saved_world = int(saved.get("world_size", 1))
        if saved_world != self.world_size:  # full (unsharded) state: every rank loads all of it
            log.info("resuming a checkpoint of %d rank(s) on %d: its weights and optimizer state are whole, "
                     "so they are re-sharded on load", saved_world, self.world_size)
        self.policy_version = int(saved.get("policy_version", 0))
        self.steps_skipped = int(saved.get("steps_skipped", 0))


@functools.cache
def _takes_logits_to_keep(model_type: type) -> bool:
    """Whether the forward of models of `model_type` computes logits at chosen positions only
    (transformers' causal LMs); asked once per class, not at every step."""
    forward = getattr(model_type, "forward", None)
    try:
        return forward is not None and "logits_to_keep" in inspect.signature(forward).parameters
    except (TypeError, ValueError):
        return False


def split_rows(n: int, minibatches: int, meta: dict[str, Any] | None = None) -> list[list[int]]:
    """Row indices of a batch of `n` rows per optimizer step: the stream's `meta["parts"]` (this
    rank's rows of each step, `trainers.batching.rank_rows`) when given, else `minibatch_rows`."""
    sizes = None if meta is None else meta.get("parts")
    if sizes is None:
        return minibatch_rows(n, minibatches)
    out, start = [], 0
    for size in sizes:
        out.append(list(range(start, start + int(size))))
        start += int(size)
    if start != n:
        raise ModelError(f"the batch has {n} rows but its plan covers {start}")
    return [p for p in out if p]


def rows(batch: dict[str, Any], index: torch.Tensor) -> dict[str, Any]:
    """The samples `index` of a collated batch (every per-sample tensor; `meta` is left out)."""
    n = int(batch["input_ids"].shape[0])
    return {k: v[index] for k, v in batch.items() if isinstance(v, torch.Tensor) and v.dim() >= 1 and v.shape[0] == n}


def mean_metrics(seen: list[dict[str, float]]) -> dict[str, float]:
    """Each metric's mean over the optimizer steps of a batch (`*_max` metrics: their max)."""
    out: dict[str, float] = {}
    for key in dict.fromkeys(k for m in seen for k in m):
        values = [m[key] for m in seen if key in m]
        out[key] = max(values) if key.endswith("_max") else sum(values) / len(values)
    return out
