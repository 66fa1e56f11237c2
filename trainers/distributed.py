"""Several trainer ranks: the Lightning strategy of `trainer.strategy`, and the error a rank
that lost its peers ends with.

`astraflow train --devices N --strategy ddp|fsdp` starts N ranks on this machine (Lightning's
launcher re-runs the command for ranks 1..N-1). The backend is the accelerator's default:
NCCL on GPUs, gloo on CPUs; nothing else in the trainer depends on which. How samples reach
the ranks is in `trainers.data`, the loss across ranks in `astraflow.rl.losses`
(`data_parallel_normaliser`), publishing from a sharded model in `trainers.publishing`.
"""

from __future__ import annotations

import datetime
from typing import Any

import torch

from astraflow.errors import AstraflowError


class RankLostError(AstraflowError):
    """Raised when a collective fails or times out: another rank died or stopped answering."""


def strategy(name: str, model: torch.nn.Module, timeout_s: float) -> Any:
    """Lightning's strategy: DDP or FSDP (`_fsdp_strategy`) with `timeout_s` on every collective;
    "auto" otherwise."""
    timeout = datetime.timedelta(seconds=timeout_s)
    if name == "fsdp":
        layers = {type(m) for m in model.modules() if type(m).__name__ in set(getattr(model, "_no_split_modules", None) or [])}
        return _fsdp_strategy()(auto_wrap_policy=layers or None, state_dict_type="full", timeout=timeout)
    if name == "ddp":
        from lightning.pytorch.strategies import DDPStrategy

        return DDPStrategy(find_unused_parameters=False, timeout=timeout)
    return "auto"


def _fsdp_strategy() -> type:
    """Lightning's FSDPStrategy, wrapping the policy model (`PolicyTrainer.model`) rather than the
    whole LightningModule: each decoder layer is sharded (`_no_split_modules`) and the model is
    the FSDP root. The module optimizes manually (several backward passes per batch), and a
    backward inside the root's forward, which wrapping the LightningModule would make of
    `training_step`, breaks FSDP's state machine. Checkpoints stay whole (`state_dict_type="full"`),
    so they resume at any world size. The same class on GPUs (NCCL) and CPUs (gloo: Lightning
    refuses the class FSDPStrategy itself with accelerator="cpu", and torch's FSDP needs
    `device_id=cpu` said explicitly there)."""
    from lightning.pytorch.strategies import FSDPStrategy
    from torch.distributed.fsdp import FullyShardedDataParallel

    class PolicyFSDPStrategy(FSDPStrategy):
        def _setup_model(self, model: torch.nn.Module) -> torch.nn.Module:
            inner = getattr(model, "model", None)
            if not isinstance(inner, torch.nn.Module) or isinstance(inner, FullyShardedDataParallel):
                return super()._setup_model(model)
            device = self.root_device if self.root_device.type != "cpu" else torch.device("cpu")
            model.model = FullyShardedDataParallel(
                module=inner, cpu_offload=self.cpu_offload, mixed_precision=self.mixed_precision_config,
                sharding_strategy=self.sharding_strategy, device_id=device, **self.kwargs,
            )
            return model

        def optimizer_state(self, optimizer: Any) -> dict[str, Any]:
            # torch gathers each optimizer state (AdamW's exp_avg, then exp_avg_sq) into one reused
            # buffer and, with offload_to_cpu, keeps `.cpu()` of its views: on a CPU device that is
            # the buffer itself, so every state came out as the last one gathered (exp_avg saved as
            # exp_avg_sq: a resume at any world size trained with wrong moments). Without offload
            # torch copies each state; on CPU there is nothing to offload anyway.
            if self.root_device.type != "cpu" or self.world_size < 2:
                return super().optimizer_state(optimizer)
            from lightning.pytorch.core.optimizer import LightningOptimizer
            from torch.distributed.fsdp import FullStateDictConfig, OptimStateKeyType, StateDictType
            from torch.distributed.fsdp.api import FullOptimStateDictConfig

            if isinstance(optimizer, LightningOptimizer):
                optimizer = optimizer._optimizer
            with FullyShardedDataParallel.state_dict_type(
                self.model, StateDictType.FULL_STATE_DICT, FullStateDictConfig(offload_to_cpu=True, rank0_only=True),
                FullOptimStateDictConfig(offload_to_cpu=False, rank0_only=True),
            ):
                state = FullyShardedDataParallel.optim_state_dict(self.model, optimizer)
                if self.global_rank == 0:  # the standard format (parameter ids), as Lightning saves it
                    state = FullyShardedDataParallel.rekey_optim_state_dict(state, OptimStateKeyType.PARAM_ID, self.model)
                return state

        def load_checkpoint(self, checkpoint_path: Any, weights_only: bool | None = None) -> dict[str, Any]:
            # Lightning loads a whole checkpoint into the module it wrapped, in FSDP's full-state
            # context only when that module is the FSDP root; here the root is inside it.
            from lightning.fabric.strategies.fsdp import _get_full_state_dict_context

            with _get_full_state_dict_context(self.model, world_size=self.world_size, rank0_only=False):
                return super().load_checkpoint(checkpoint_path, weights_only)

    return PolicyFSDPStrategy


def is_collective_failure(exc: BaseException) -> bool:
    """Whether `exc` is torch.distributed saying a peer is gone or a collective timed out."""
    dist_error = getattr(torch.distributed, "DistError", ())
    text = str(exc)
    return isinstance(exc, dist_error) or (
        isinstance(exc, RuntimeError)
        and any(s in text for s in ("Connection closed by peer", "Connection reset by peer", "Timed out", "timed out",
                                    "gloo", "NCCL", "Broken pipe"))
    )


def rank_lost(exc: BaseException, rank: int, world: int, timeout_s: float) -> RankLostError:
    """The error this rank ends the job with when a collective failed (`is_collective_failure`)."""
    return RankLostError(
        f"rank {rank} of {world} lost the other ranks ({type(exc).__name__}: {str(exc).splitlines()[0][:300]}): "
        f"a rank died or did not answer within trainer.collective_timeout_s={timeout_s:g}. The job stops; run the "
        "same command again to resume from the last checkpoint and its offsets (nothing trained after it is published)."
    )
