"""Weight following for RaaS nodes: one thread per policy reads `<policy>.weights` and hands every
verified new version to the policy's backend, which switches between two decoding steps.

The follower (astraflow.weights.follow.KafkaWeightFollower) starts at the newest snapshot named
on the compacted `policies` topic, applies sparse deltas, verifies checksums and falls back to a
snapshot on a gap or a failed check; only verified versions reach the backend.
"""

from __future__ import annotations

import logging
import threading

from astraflow.config import AstraflowConfig
from astraflow.raas.backends.base import InferenceBackend
from astraflow.weights.chain import ApplyStatus
from astraflow.weights.follow import KafkaWeightFollower

log = logging.getLogger("astraflow.raas.weights")


class BackendWeightFollower:
    """Follows one policy's weights topic in a background thread and updates its backend."""

    def __init__(self, cfg: AstraflowConfig, experiment: str, policy: str, backend: InferenceBackend,
                 requester: str = "raas") -> None:
        self.backend = backend
        self.follower = KafkaWeightFollower(cfg.kafka, experiment, policy, requester=requester)
        self.applied = 0  # versions handed to the backend
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name=f"weights-{policy}", daemon=True)

    def start(self) -> BackendWeightFollower:
        self.follower.start()
        self._thread.start()
        return self

    def _run(self) -> None:
        while not self._stop.is_set():
            try:
                events = self.follower.poll(timeout_s=0.5)
            except Exception:  # keep serving the current version; log and retry
                log.exception("weight follower for %s failed to poll", self.follower.policy)
                self._stop.wait(1.0)
                continue
            applied = [e for e in events if e.result.status == ApplyStatus.APPLIED]
            for e in events:
                if e.result.status == ApplyStatus.SNAPSHOT_NEEDED:
                    log.warning("version %d of %s not applied (%s); waiting for a snapshot",
                                e.version, self.follower.policy, e.result.reason)
            if applied:
                version = self.follower.follower.version
                # Copy: the chain patches its tensors in place with later deltas.
                state = {k: v.clone() if hasattr(v, "clone") else v.copy() for k, v in self.follower.follower.state.items()}
                self.backend.update_weights(state, int(version))
                self.applied += 1
                log.info("policy %s now at version %d", self.follower.policy, version)

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(timeout=5)
        self.follower.close()


def start_weight_followers(cfg: AstraflowConfig, experiment: str, backends: dict[str, InferenceBackend]) -> list[BackendWeightFollower]:
    return [BackendWeightFollower(cfg, experiment, policy, b).start() for policy, b in backends.items()]
