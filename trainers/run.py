"""The trainer process: wires config, Kafka data, the module, publishing and checkpoints.

`run_training(config)` is what `astraflow train` calls. It trains whenever a batch is
available (never waiting for rollout nodes), resumes from the newest checkpoint in the
checkpoint directory (weights, optimizer, consumed offsets and trained sample ids together),
publishes a policy version every K batches, each only after a checkpoint of the state that
produced it (`trainers.publishing`), follows the loss chosen on the control topic
(`trainers.loss_control`), and stops on max_steps / max_time / idleness / Ctrl-C
(graceful: a final checkpoint and version) or SIGTERM (checkpoint between batches).
"""

from __future__ import annotations

import logging
import random
import signal
import time
import warnings
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import lightning as L
import numpy as np
import torch
from lightning.pytorch.utilities.exceptions import SIGTERMException

from astraflow.config import write_resolved
from astraflow.errors import ConfigError, ModelError
from astraflow.kafka.acl import role_topics
from astraflow.kafka.clients import RecordProducer
from astraflow.kafka.topics import TopicAdmin, Topics, create_command
from astraflow.metrics_export import serve_role
from astraflow.rl.samples import SampleLimits
from astraflow.weights.publish import PublishSettings, WeightPublisher
from astraflow.weights.store import WeightStore
from trainers.batching import BatchLimits
from trainers.callbacks import AtomicCheckpointIO, KafkaMetrics, SnapshotRequests, newest_checkpoint
from trainers.config import TrainRunConfig
from trainers.crash import CrashPoints
from trainers.data import TRAINER_PRODUCER
from trainers.datamodule import KafkaTrainData
from trainers.distributed import is_collective_failure, rank_lost, strategy
from trainers.loss_control import LossControl
from trainers.module import PolicyTrainer
from trainers.publishing import DurablePublication, TrainedSampleLog
from trainers.tblog import TensorBoardScalars

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class TrainSummary:
    """What one `run_training` call did."""

    steps: int  # optimizer steps in total (restored steps included)
    trained_samples: int  # samples in total (restored included)
    offsets: dict[int, int]  # next offset per partition after the last trained batch
    version: int | None  # version of the final weights (published by this run or adopted)
    resumed_from: Path | None  # checkpoint the run started from
    seconds: float  # wall time of this call
    stopped_by: str  # "max_steps", "idle", "time", "interrupt" or "sigterm"
    global_rank: int = 0  # this process's rank (only rank 0 publishes and reports)


def _pad_id(model_dir: Path) -> int:
    from transformers import AutoConfig, AutoTokenizer

    try:
        tok = AutoTokenizer.from_pretrained(model_dir, local_files_only=True)
        if tok.pad_token_id is not None:
            return int(tok.pad_token_id)
    except (OSError, ValueError):
        pass
    cfg = AutoConfig.from_pretrained(model_dir, local_files_only=True)
    return int(getattr(cfg, "pad_token_id", None) or 0)


def sample_limits(config: TrainRunConfig, model: torch.nn.Module) -> SampleLimits:
    """What this trainer accepts: the model's vocabulary (embedding rows) and context length."""
    tc = config.trainer
    vocab = int(model.get_input_embeddings().num_embeddings)
    max_len = tc.max_seq_len or int(getattr(getattr(model, "config", None), "max_position_embeddings", 0) or 32768)
    return SampleLimits(tc.policy, vocab, max_len, tc.max_abs_advantage, tc.min_behaviour_logprob,
                        max_staleness=tc.max_staleness)


def _logger(kind: str, log_dir: Path) -> Any:
    """The Lightning loggers of `trainer.logger` (tensorboard+csv, tensorboard, csv or none)."""
    loggers: list[Any] = []
    if kind in ("tensorboard+csv", "tensorboard"):
        loggers.append(TensorBoardScalars(log_dir))
    if kind in ("tensorboard+csv", "csv"):
        from lightning.pytorch.loggers import CSVLogger

        loggers.append(CSVLogger(log_dir, name="lightning"))
    return loggers or False


def run_training(config: TrainRunConfig) -> TrainSummary:
    """Train one policy from its train topic until a stop condition; see the module docstring."""
    t0 = time.monotonic()
    tc = config.trainer
    if tc.model_dir is None:
        raise ConfigError("no model: pass --model DIR (or set trainer.model_dir)")
    if not (Path(tc.model_dir) / "config.json").is_file():
        raise ModelError(f"no transformers model in {tc.model_dir}: --model must name a local model directory")
    topics = Topics(config.experiment)
    # The operator creates the topics (`astraflow topics create`), as for every role.
    TopicAdmin(config.kafka).require(role_topics("trainer", config.experiment, [tc.policy]),
                                     create_command(config.experiment, [tc.policy]))
    log_dir = config.log_dir()
    write_resolved(config, log_dir, "trainer-config.json")
    ckpt_dir = config.checkpoint_dir()
    resume = newest_checkpoint(ckpt_dir) if tc.resume else None
    # Not L.seed_everything: it exports PL_GLOBAL_SEED into the environment of the whole process.
    random.seed(tc.seed)
    np.random.seed(tc.seed)
    torch.manual_seed(tc.seed)
    warnings.filterwarnings("ignore", message=r".*does not have many workers.*")
    warnings.filterwarnings("ignore", message=r".*IterableDataset.*__len__.*")

    module = PolicyTrainer(
        tc.model_dir,
        tc.loss,
        lr=tc.lr,
        weight_decay=tc.weight_decay,
        betas=tc.betas,
        warmup_steps=tc.warmup_steps,
        ref_model_dir=tc.ref_model_dir,
        max_seq_len=tc.max_seq_len,
        grad_clip=tc.grad_clip,
        minibatches=tc.minibatches,
        ppo_epochs=tc.ppo_epochs,
    )
    deadline = None if tc.max_time_s is None else time.monotonic() + tc.max_time_s
    data = KafkaTrainData(
        {
            "kafka": config.kafka,
            "topic": topics.train(tc.policy),
            "policy": sample_limits(config, module.model),
            "limits": BatchLimits(tc.batch_size, tc.token_budget),
            "pad_id": _pad_id(Path(tc.model_dir)),
            "max_wait_s": tc.max_wait_s,
            "start": tc.start_offsets,
            "stop_when_idle_s": tc.stop_when_idle_s,
            "deadline": deadline,
            "group_id": topics.trainer_group(tc.policy),
            "minibatches": tc.minibatches,
            "heartbeat_s": min(5.0, tc.collective_timeout_s / 4),
        },
        dlq_topic=topics.dlq,
        dedup_window=tc.dedup_window,
    )
    store = WeightStore(tc.weight_store) if tc.weight_store else None
    settings = PublishSettings(tc.publish_dtype, tc.snapshot_every_versions, tc.chunk_bytes, tc.inband_max_bytes)
    crash = CrashPoints()
    # One transactional id per policy: a restarted trainer fences its predecessor and aborts
    # the version it may have left half-sent.
    publisher = WeightPublisher(
        config.kafka, config.experiment, tc.policy, settings, store=store,
        transactional_id=topics.publisher_id(tc.policy), on_progress=crash,
    )
    durable = DurablePublication(
        publisher, ckpt_dir, publish_every=tc.publish_every_steps, checkpoint_every=tc.checkpoint_every_steps,
        keep=tc.keep_checkpoints, sample_log=TrainedSampleLog(config.trained_log()),
        requests=SnapshotRequests(config.kafka, topics, tc.policy), crash=crash, resuming=resume is not None,
    )
    metrics_producer = RecordProducer(config.kafka, **TRAINER_PRODUCER)
    metrics = KafkaMetrics(metrics_producer, topics, tc.policy, tc.metrics_every_steps)
    endpoint = serve_role(config.experiment, "trainer", metrics.instance)  # opt-in: ASTRAFLOW_METRICS_PORT
    if endpoint is not None:
        metrics.observers.append(endpoint.observe)
    callbacks: list[L.Callback] = [
        LossControl(config.kafka, config.experiment, tc.policy, tc.loss, metrics_producer),
        durable,
        metrics,
    ]
    trainer = L.Trainer(
        accelerator=tc.accelerator,
        devices=tc.devices,
        strategy=strategy(tc.strategy, module.model, tc.collective_timeout_s),
        precision=tc.precision,
        max_steps=tc.max_steps,
        max_epochs=1,  # one pass over an endless stream; it ends on idle / time / stop
        logger=_logger(tc.logger, log_dir),
        callbacks=callbacks,
        enable_checkpointing=False,  # DurablePublication does it, with the offsets, atomically
        plugins=[AtomicCheckpointIO()],
        log_every_n_steps=1,
        enable_progress_bar=tc.progress_bar,
        enable_model_summary=False,
        num_sanity_val_steps=0,
        default_root_dir=log_dir,
    )

    stopped_by = {"value": ""}

    def _on_sigint(signum: int, frame: Any) -> None:
        if stopped_by["value"] == "interrupt":
            raise KeyboardInterrupt
        stopped_by["value"] = "interrupt"
        log.warning("stopping after this batch (Ctrl-C again to abort without a final checkpoint)")
        if data.stream is not None:
            data.stream.request_stop()

    previous = signal.signal(signal.SIGINT, _on_sigint)
    try:
        trainer.fit(module, datamodule=data, ckpt_path=str(resume) if resume else None)
    except SIGTERMException:
        stopped_by["value"] = "sigterm"
    except Exception as exc:
        if trainer.world_size > 1 and is_collective_failure(exc):
            raise rank_lost(exc, trainer.global_rank, trainer.world_size, tc.collective_timeout_s) from exc
        raise
    finally:
        signal.signal(signal.SIGINT, previous)
        if endpoint is not None:
            endpoint.close()
    if not stopped_by["value"] and trainer.received_sigterm:  # SIGTERM while waiting for samples: the stream ended
        stopped_by["value"] = "sigterm"
    if not stopped_by["value"]:
        if tc.max_steps >= 0 and trainer.global_step >= tc.max_steps:
            stopped_by["value"] = "max_steps"
        elif deadline is not None and time.monotonic() >= deadline:
            stopped_by["value"] = "time"
        else:
            stopped_by["value"] = "idle"
    return TrainSummary(
        steps=trainer.global_step,
        trained_samples=data.trained_samples,
        offsets=dict(data.trained),
        version=durable.version,
        resumed_from=resume,
        seconds=time.monotonic() - t0,
        stopped_by=stopped_by["value"],
        global_rank=trainer.global_rank,
    )
