"""Checkpoint, then publish: the trainer's versions survive `kill -9` at any point.

The invariant: **a version is published only once the state that produced it is durable.** At
every publication step `DurablePublication` (1) checks that the weights, in the published dtype,
are finite; (2) writes a checkpoint holding the weights, the optimizer, the consumed offsets,
the trained sample-id window and the version number it promises (`pending`); (3) appends the
trained-sample log lines of that version; (4) publishes the version in one Kafka transaction,
with `TrainedSamples` records on the lineage topic (which step trained each sample it carries).
The trainer's thread only copies the state (the weights of (1), the checkpoint's state of (2));
writing (2), (3) and (4) run in that order in a background thread while the next step trains.
The next checkpoint, publication or the end of training first waits for that commit, so
versions commit in order and a checkpoint never promises a version while an earlier one is
unsent (a failed checkpoint or publication is raised there, in the trainer's thread).

On start it reconciles the restored state with the committed versions (after fencing any
earlier publisher, which aborts a version left half-sent):

- a checkpoint promised version v and the topic ends before v: publish v now, from exactly the
  checkpointed weights (killed between checkpoint and commit);
- the newest committed version has exactly the restored weights (state checksum): adopt its
  number, publish nothing (killed after a commit, or a fresh run restarted before training);
- otherwise (a checkpoint between publications, or no checkpoint): publish the restored weights
  as a snapshot under the next free number.

So a number is never reused for other weights, and every published version descends from every
earlier one: weights trained after the last checkpoint are never published, so their samples,
trained again after the restart, enter the followed lineage once. Details: docs/training.md.
"""

from __future__ import annotations

import json
import logging
import os
import re
import socket
import threading
import time
from pathlib import Path
from typing import Any

import lightning as L
from lightning.pytorch.utilities.exceptions import SIGTERMException

from astraflow.errors import ModelError
from astraflow.records import TrainedSamples
from astraflow.weights.bits import StateManifest
from astraflow.weights.publish import NonFiniteWeightsError, WeightPublisher, check_finite, published_state
from trainers.callbacks import SnapshotRequests, prepare_checkpoint, save_checkpoint
from trainers.crash import CrashPoints

log = logging.getLogger(__name__)

_TAIL_BYTES = 8 * 1024 * 1024  # how much of the log's end is searched for a version's lines
_VERSION_IN_LINE = re.compile(rb'"version": (\d+),')


class TrainedSampleLog:
    """JSONL, one line per sample in published weights: which step trained it, which version
    first carries it. Lines of one version are appended (fsynced) before the version is
    published; `write` skips lines already present, so a restart never duplicates them."""

    def __init__(self, path: Path) -> None:
        self.path = Path(path)
        # After this process's last append: (the file's size, the newest version in its tail and
        # in what it appended). While the size is still that, the file ends with a whole line and
        # holds no line of a newer version, so the next version's write skips reading the tail.
        self._known: tuple[int, int] | None = None

    def _repair(self) -> None:
        """Drop a torn last line (a kill mid-write)."""
        if not self.path.exists():
            return
        with open(self.path, "rb+") as f:
            size = f.seek(0, os.SEEK_END)
            if size == 0:
                return
            f.seek(max(0, size - _TAIL_BYTES))
            tail = f.read()
            if tail.endswith(b"\n"):
                return
            cut = tail.rfind(b"\n")
            f.truncate(size - len(tail) + cut + 1 if cut >= 0 else max(0, size - len(tail)))

    def _tail(self) -> bytes:
        with open(self.path, "rb") as f:
            size = f.seek(0, os.SEEK_END)
            f.seek(max(0, size - _TAIL_BYTES))
            return f.read()

    @staticmethod
    def recorded(tail: bytes, version: int) -> set[str]:
        """Sample ids logged under `version` in `tail` (the log's end, `_tail`)."""
        found = set()
        for line in tail.split(b"\n"):
            if f'"version": {version},'.encode() in line:
                found.add(json.loads(line)["sample_id"])
        return found

    def _size(self) -> int | None:
        try:
            return self.path.stat().st_size
        except FileNotFoundError:
            return None

    def write(self, version: int, samples: list[list[Any]]) -> None:
        """Append `samples` ([sample_id, step, partition, offset]) under `version`, durably."""
        if not samples:
            return
        known = self._known
        if known is not None and version > known[1] and self._size() == known[0]:
            done: set[str] = set()  # the file is as this process left it: no torn line, no line of `version`
            newest = version
        else:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            self._repair()
            tail = self._tail() if self.path.exists() else b""  # read once: lines of `version`, the newest version
            done = self.recorded(tail, version)
            newest = max([version, *(int(v) for v in _VERSION_IN_LINE.findall(tail))])
        lines = [
            json.dumps({"sample_id": sid, "step": step, "version": version, "partition": p, "offset": o})
            for sid, step, p, o in samples
            if sid not in done
        ]
        if not lines:
            return
        with open(self.path, "a") as f:
            f.write("\n".join(lines) + "\n")
            f.flush()
            os.fsync(f.fileno())
            self._known = (os.fstat(f.fileno()).st_size, newest)


def trained_records(policy: str, version: int, step: int, samples: list[list[Any]], per_record: int = 2000) -> list[TrainedSamples]:
    """`samples` ([sample_id, step, partition, offset]) that `version` first carries, as lineage
    records (published in the version's transaction), `per_record` samples each."""
    instance = f"{socket.gethostname()}-{os.getpid()}"
    parts = [samples[i:i + per_record] for i in range(0, len(samples), per_record)]
    return [TrainedSamples(policy, version, step, instance, [str(s[0]) for s in part], [int(s[1]) for s in part], i, len(parts))
            for i, part in enumerate(parts)]


class DurablePublication(L.Callback):
    """Checkpoints and publishes in the order of the module docstring, every `publish_every`
    trained batches; also checkpoints every `checkpoint_every` batches between publications, at
    the end and on SIGTERM."""

    def __init__(
        self,
        publisher: WeightPublisher,
        checkpoint_dir: Path,
        *,
        publish_every: int = 1,
        checkpoint_every: int = 10,
        keep: int = 2,
        sample_log: TrainedSampleLog,
        requests: SnapshotRequests | None = None,
        crash: CrashPoints | None = None,
        resuming: bool = False,
    ) -> None:
        self.publisher, self.checkpoint_dir, self.keep = publisher, Path(checkpoint_dir), keep
        # Whether the run restores a checkpoint (`trainer.fit(ckpt_path=...)`); see `on_fit_start`.
        self.resuming = resuming
        self.publish_every, self.checkpoint_every = publish_every, checkpoint_every
        self.sample_log, self.requests = sample_log, requests
        self.crash = crash or CrashPoints("")
        # checkpointed state
        self.version: int | None = None  # version of the weights last published (or promised)
        self.pending = False  # this checkpoint's weights are `version`, maybe not yet published
        self.unpublished: list[list[Any]] = []  # [sample_id, step, partition, offset] since `version`
        self.batches = 0  # batches trained (a batch takes the module's minibatches x ppo_epochs optimizer steps)
        self._started = False
        self._saved_step = -1
        self._published_step = -1
        self.last_checkpoint_s = 0.0  # seconds the last checkpoint took (reported in metrics)
        self.last_publish_s = 0.0  # seconds the trainer's step loop spent publishing (metrics)
        self.last_send_s = 0.0  # seconds the last version took to checkpoint, send and commit, in the background (metrics)
        # The publication under way in the background: (thread, its error if it fails); joined
        # before the next checkpoint, publication or the end (see `publish_durably`).
        self._sending: tuple[threading.Thread, list[BaseException]] | None = None

    # -- Lightning state ------------------------------------------------------------------------

    def state_dict(self) -> dict[str, Any]:
        return {"version": self.version, "pending": self.pending, "unpublished": list(self.unpublished),
                "batches": self.batches}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        if self._started:  # the topic was reconciled with other weights: its decisions would not hold
            raise ModelError("a checkpoint was restored after the trainer reconciled its weights with the weights "
                             "topic; pass resuming=True to DurablePublication when fit() restores a checkpoint")
        self.version = state_dict.get("version")
        self.pending = bool(state_dict.get("pending", False))
        self.unpublished = [list(x) for x in state_dict.get("unpublished", [])]
        self.batches = int(state_dict.get("batches", 0))

    # -- pieces -----------------------------------------------------------------------------------

    def _checkpoint(self, trainer: L.Trainer) -> None:
        self.wait_published()  # a checkpoint never promises a version while the last one is unsent
        t0 = time.perf_counter()
        save_checkpoint(trainer, self.checkpoint_dir, self.keep)
        self.last_checkpoint_s = time.perf_counter() - t0
        self._saved_step = trainer.global_step

    def _weights(self, trainer: L.Trainer) -> dict[str, Any] | None:
        state = trainer.strategy.lightning_module_state_dict()  # full state on rank 0 (FSDP gathers)
        new, problem = None, None
        if trainer.is_global_zero:
            weights = {k.removeprefix("model."): v for k, v in state.items() if k.startswith("model.")}
            new = published_state(weights, self.publisher.settings.dtype)
            try:
                check_finite(new)  # before any checkpoint: a non-finite state is never made durable
            except NonFiniteWeightsError as exc:
                problem = str(exc)
        problem = trainer.strategy.broadcast(problem, src=0)  # every rank stops, none waits
        if problem is not None:
            raise NonFiniteWeightsError(f"{problem} (step {trainer.global_step}; restart resumes from the last checkpoint)")
        return new

    def _send(self, weights: dict[str, Any], version: int, snapshot: bool, step: int, trained_samples: int,
              samples: list[list[Any]]) -> int:
        """Log `samples` under `version`, then publish `weights` as `version` (its lineage: `samples`)."""
        self.sample_log.write(version, samples)
        if self.requests is not None and self.requests.pending():
            snapshot = True
        manifest = self.publisher.publish(
            weights,
            trainer_step=step,
            trained_samples=trained_samples,
            snapshot=snapshot,
            version=version,
            lineage=trained_records(self.publisher.policy, version, step, samples),
            prepared=True,  # `_weights` cast and checked them: the encoder does not again
        )
        return manifest.version

    def _send_now(self, trainer: L.Trainer, weights: dict[str, Any], version: int, snapshot: bool) -> int:
        return self._send(weights, version, snapshot, trainer.global_step,
                          getattr(trainer.datamodule, "trained_samples", 0), self.unpublished)

    def wait_published(self) -> None:
        """Block until the version sent in the background is committed; re-raise its failure."""
        if self._sending is None:
            return
        thread, error = self._sending
        thread.join()
        self._sending = None
        if error:
            raise error[0]
        self.pending = False
        self.crash("after_publish")

    def _set_version(self, trainer: L.Trainer, module: L.LightningModule, version: int | None) -> None:
        version = trainer.strategy.broadcast(version, src=0)
        self.version = int(version)
        module.policy_version = int(version)
        dm = trainer.datamodule
        if hasattr(dm, "newest_version"):  # samples may not claim newer versions than this
            dm.newest_version = int(version)
            if dm.stream is not None:
                dm.stream.newest_version = int(version)
        self._published_step = trainer.global_step

    def publish_durably(self, trainer: L.Trainer, module: L.LightningModule) -> None:
        """Finite check and the state of the checkpoint (promising the version) here; writing that
        checkpoint, the log lines and the publication in the background, in that order, while the
        next step trains. Both the checkpoint and the weights sent are copies taken here, so the
        version is exactly the checkpointed weights; the next checkpoint, publication or the end
        waits for the commit first, so versions commit in order and no checkpoint promises a
        version while an earlier one is unsent."""
        t0 = time.perf_counter()
        self.wait_published()
        weights = self._weights(trainer)
        version = self.publisher.encoder.next_version if trainer.is_global_zero else None
        version = int(trainer.strategy.broadcast(version, src=0))
        self.version, self.pending = version, True
        module.policy_version = version
        write = prepare_checkpoint(trainer, self.checkpoint_dir, self.keep)
        self._saved_step = trainer.global_step
        samples, self.unpublished = self.unpublished, []
        if trainer.is_global_zero:
            assert weights is not None
            step, trained = trainer.global_step, getattr(trainer.datamodule, "trained_samples", 0)
            error: list[BaseException] = []

            def send() -> None:
                try:
                    t = time.perf_counter()
                    write()
                    self.last_checkpoint_s = time.perf_counter() - t
                    self.crash("after_checkpoint")
                    self._send(weights, version, False, step, trained, samples)
                    self.last_send_s = time.perf_counter() - t
                except BaseException as exc:  # re-raised by wait_published in the trainer's thread
                    error.append(exc)

            thread = threading.Thread(target=send, name=f"publish-v{version}", daemon=True)
            thread.start()
            self._sending = (thread, error)
        else:
            write()
            self.crash("after_checkpoint")
            self.pending = False
            self.crash("after_publish")
        # Promised and checkpointed (or being written: a restart without that checkpoint never
        # published it either), so samples may claim it from now on.
        self._set_version(trainer, module, version)
        self.last_publish_s = time.perf_counter() - t0

    def reconcile(self, trainer: L.Trainer, module: L.LightningModule, resumed: bool) -> None:
        """What the restored state means for the weights topic; see the module docstring."""
        version = None
        weights = self._weights(trainer)  # on every rank: FSDP gathers the shards, the finite check is broadcast
        if trainer.is_global_zero:
            last = self.publisher.start()
            assert weights is not None
            committed = self.publisher.committed
            same = committed is not None and committed.version == last and (
                committed.state_checksum == StateManifest.of(weights).checksum().hex()
            )
            if resumed and self.pending and self.version is not None and (last is None or last < self.version):
                version = self._send_now(trainer, weights, self.version, snapshot=True)
                log.info("published version %d promised by the checkpoint of step %d", version, trainer.global_step)
            elif same:
                assert last is not None
                self.sample_log.write(last, self.unpublished)
                version = last
                log.info("restored weights are version %d, already published", last)
            else:
                if self.pending:  # promised a number that is used: its samples are logged under it
                    self.unpublished = []
                version = self._send_now(trainer, weights, self.publisher.encoder.next_version, snapshot=True)
        self.unpublished, self.pending = [], False
        self._set_version(trainer, module, version)
        self._started = True

    # -- hooks ------------------------------------------------------------------------------------

    def on_fit_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        # A fresh run publishes before Lightning waits for the first batch, so followers have a
        # version at once; a resumed run waits for on_train_start, when its whole state is back.
        # Not `trainer.ckpt_path`: a strategy that restores after its setup (FSDP) sets it only
        # after this hook, and reconciling the initial weights here republished them under a new
        # number and kept the checkpoint's unpublished samples for a second version.
        self._started = False
        if not self.resuming and trainer.ckpt_path is None:
            self.reconcile(trainer, pl_module, resumed=False)

    def on_train_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        if not self._started:
            self.reconcile(trainer, pl_module, resumed=True)

    def on_train_batch_end(self, trainer: L.Trainer, pl_module: L.LightningModule, outputs: Any, batch: Any, batch_idx: int) -> None:
        self.crash("step_trained")
        meta = batch.get("meta") if isinstance(batch, dict) else None
        skipped = getattr(pl_module, "skipped_reason", None)
        dm = trainer.datamodule
        if meta is not None:
            if hasattr(dm, "finish_step"):
                dm.finish_step(meta, skipped)
            if skipped is None:
                self.unpublished += [[sid, trainer.global_step, p, o] for p, o, sid in meta["samples"]]
        self.batches += 1
        if self.batches % self.publish_every == 0:
            self.publish_durably(trainer, pl_module)
        elif self.batches % self.checkpoint_every == 0:
            self._checkpoint(trainer)
        if hasattr(pl_module, "last_metrics"):
            pl_module.last_metrics = {**pl_module.last_metrics, "checkpoint_s": self.last_checkpoint_s,
                                      "publish_s": self.last_publish_s, "send_s": self.last_send_s}

    def on_train_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        if trainer.global_step != self._published_step:
            self.publish_durably(trainer, pl_module)
        self.wait_published()
        self.publisher.close()
        if self.requests is not None:
            self.requests.close()

    def on_exception(self, trainer: L.Trainer, pl_module: L.LightningModule, exception: BaseException) -> None:
        # Lightning raises SIGTERMException only between batches, where weights and offsets agree.
        if isinstance(exception, SIGTERMException) and trainer.global_step != self._saved_step and trainer.global_step:
            self._checkpoint(trainer)
