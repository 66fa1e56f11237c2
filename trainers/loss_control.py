"""The loss chosen through the control topic: `trainer/<policy>.loss`, applied between batches.

An operator writes ``astraflow control set trainer <policy>.loss MODE --param name=value ...``
(the CLI validates the command first). The record's strategy is the loss mode (`LossSettings.mode`:
ppo, decoupled, tis, mis, m2po); its params are other `LossSettings` fields, JSON-decoded
(``tis_cap=3``, ``max_staleness=null``, ``staleness_weight=inverse``). Each record determines the
whole loss: the trainer's configured `trainer.loss` with those fields replaced, so the order of
earlier commands does not matter; a tombstone (``astraflow control unset trainer <policy>.loss``)
goes back to the configured loss. The latest record wins, as compaction keeps it, so a
restarted trainer reads the same choice before its first batch.

Every record is answered. A valid one is applied before the next batch, without a restart: a
log line and the `trainer.loss_applied` metric (value: the control version; label: the mode);
every batch's metrics then carry `loss_control_version`. An invalid one (unknown mode or field,
a value out of range, `kl_coef > 0` when no reference model was loaded at start) is rejected:
the trainer keeps its loss, logs why and sends `trainer.loss_rejected` (value: rejections so
far; labels: the control version and the reason). With several ranks, rank 0 reads the topic and broadcasts what it read, so every rank
switches at the same batch.
"""

from __future__ import annotations

import dataclasses
import logging
import os
import socket
from typing import Any

import lightning as L
from pydantic import TypeAdapter, ValidationError

from astraflow.config import KafkaSettings
from astraflow.control import ControlReader
from astraflow.dataflow.registry import parse_params
from astraflow.errors import AstraflowError, ConfigError
from astraflow.kafka.clients import RecordProducer
from astraflow.kafka.topics import Topics
from astraflow.records import Control, Metric
from astraflow.weights.versions import CONTROL_APP
from trainers.config import LossSettings

log = logging.getLogger(__name__)

_LOSS = TypeAdapter(LossSettings)


def loss_slot(policy: str) -> str:
    """The control slot of a policy's loss (app `trainer`)."""
    return f"{policy}.loss"


def loss_from_control(configured: LossSettings, strategy: str, params: dict[str, str]) -> LossSettings:
    """The loss a control command selects: `configured` with mode = `strategy` and the fields in
    `params` (strings, JSON-decoded) replaced. Raises ConfigError saying what is wrong."""
    values: dict[str, Any] = parse_params(params)
    if "mode" in values:
        raise ConfigError("give the loss mode as the command's strategy, not as a 'mode' param")
    try:
        # The field types (pydantic), then what they cannot say (mis needs tis_cap > 1, ...: LossSettings).
        settings = _LOSS.validate_python({**dataclasses.asdict(configured), **values, "mode": strategy})
    except ValidationError as exc:
        problems = "; ".join(f"{'.'.join(str(p) for p in e['loc']) or 'loss'}: {e['msg']}" for e in exc.errors())
        fields = ", ".join(f.name for f in dataclasses.fields(LossSettings))
        raise ConfigError(f"invalid loss command ({problems}); fields: {fields}") from exc
    return settings


class LossControl(L.Callback):
    """Follows `trainer/<policy>.loss` and switches the module's loss before a batch (module docstring)."""

    def __init__(self, kafka: KafkaSettings, experiment: str, policy: str, configured: LossSettings,
                 producer: RecordProducer) -> None:
        self.kafka, self.experiment, self.policy, self.configured = kafka, experiment, policy, configured
        self.slot = loss_slot(policy)
        self.producer, self.topic = producer, Topics(experiment).metrics
        self.instance = f"{socket.gethostname()}-{os.getpid()}"
        self.reader: ControlReader | None = None
        self.version = 0  # control version of the loss in use (0: the configured loss)
        self.rejected = 0  # commands rejected so far
        self._seen: Control | None = None

    def on_fit_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        if trainer.is_global_zero and self.reader is None:
            self.reader = ControlReader(self.kafka, self.experiment, CONTROL_APP).start()
        self.follow(trainer, pl_module)

    def on_train_batch_start(self, trainer: L.Trainer, pl_module: L.LightningModule, batch: Any, batch_idx: int) -> None:
        self.follow(trainer, pl_module)

    def follow(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        """Applies or rejects a command that changed since the last call (every rank alike)."""
        change = None
        if trainer.is_global_zero and self.reader is not None:
            self.reader.refresh()
            control = self.reader.get(self.slot)
            if control != self._seen:
                self._seen = control
                change = ("unset",) if control is None else ("set", control.strategy, dict(control.params), control.version)
        change = trainer.strategy.broadcast(change, src=0)
        if change is None:
            return
        if change[0] == "unset":
            settings, version = self.configured, 0
        else:
            _, strategy, params, version = change
            try:
                settings = loss_from_control(self.configured, strategy, params)
            except ConfigError as exc:
                self._reject(trainer, version, str(exc))
                return
        try:
            pl_module.set_loss(settings)  # type: ignore[operator]
        except AstraflowError as exc:
            self._reject(trainer, version, f"{type(exc).__name__}: {exc}")
            return
        self.version = version
        pl_module.loss_control_version = version  # type: ignore[assignment]
        log.info("loss -> %s (control version %d): %s", settings.mode, version, dataclasses.asdict(settings))
        self._metric(trainer, "trainer.loss_applied", float(version), {"mode": settings.mode})

    def _reject(self, trainer: L.Trainer, version: int, why: str) -> None:
        self.rejected += 1
        log.error("%s/%s: control version %d rejected, keeping the loss in use (control version %d): %s",
                  CONTROL_APP, self.slot, version, self.version, why)
        self._metric(trainer, "trainer.loss_rejected", float(self.rejected),
                     {"control_version": str(version), "error": why[:1000]})

    def _metric(self, trainer: L.Trainer, name: str, value: float, labels: dict[str, str]) -> None:
        if trainer.is_global_zero:
            self.producer.send(self.topic, Metric(name, value, "trainer", self.instance, {"policy": self.policy, **labels}),
                               key=self.policy)
            self.producer.poll(0)

    def teardown(self, trainer: L.Trainer, pl_module: L.LightningModule, stage: str) -> None:
        if self.reader is not None:
            self.reader.close()
            self.reader = None
