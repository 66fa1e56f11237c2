"""Weight following for RaaS nodes: one thread per policy reads `<policy>.weights` and hands every
verified new version to the policy's backend, which switches between two decoding steps.

The follower (astraflow.weights.follow.KafkaWeightFollower) starts at the newest snapshot named
on the compacted `policies` topic, applies sparse deltas, verifies checksums and falls back to a
snapshot on a gap or a failed check; only verified versions reach the backend. It checks every
payload against the backend's model (`weight_layout()`: tensor names, shapes, dtypes) and the
`weights` section of the config (allowed store locations, size bounds); a refused version is
dead-lettered and counted, and the backend keeps serving the last good one.
"""

from __future__ import annotations

import logging
import threading

from astraflow.config import AstraflowConfig
from astraflow.raas.backends.base import InferenceBackend
from astraflow.weights.chain import ApplyStatus
from astraflow.weights.follow import KafkaWeightFollower
from astraflow.weights.layout import ModelLayout
from astraflow.weights.verify import FollowLimits

log = logging.getLogger("astraflow.raas.weights")


class BackendWeightFollower:
    """Follows one policy's weights topic in a background thread and updates its backend."""

    def __init__(self, cfg: AstraflowConfig, experiment: str, policy: str, backend: InferenceBackend,
                 requester: str = "raas") -> None:
        self.backend = backend
        layout_of = getattr(backend, "weight_layout", None)
        layout: ModelLayout | None = layout_of() if layout_of is not None else None
        if layout is None:
            log.warning("backend %s does not expose its model's layout: weights of %s are checked for size and "
                        "checksums only", backend.name, policy)
        self.follower = KafkaWeightFollower(cfg.kafka, experiment, policy, requester=requester,
                                            limits=FollowLimits.from_settings(cfg.weights), layout=layout)
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
                state = self.follower.follower.state_copy()
                try:
                    self.backend.update_weights(state, int(version))
                except Exception:  # the backend keeps its weights; the next version may apply
                    log.exception("backend of %s refused version %d", self.follower.policy, version)
                    continue
                self.applied += 1
                log.info("policy %s now at version %d", self.follower.policy, version)

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(timeout=5)
        self.follower.close()


def start_weight_followers(cfg: AstraflowConfig, experiment: str, backends: dict[str, InferenceBackend]) -> list[BackendWeightFollower]:
    return [BackendWeightFollower(cfg, experiment, policy, b).start() for policy, b in backends.items()]
