"""Weight following for RaaS nodes: one thread per policy reads `<policy>.weights` and hands every
verified new version to the policy's backend, which switches between two decoding steps.

The follower (astraflow.weights.follow.KafkaWeightFollower) starts at the newest snapshot named
on the compacted `policies` topic, applies sparse deltas, verifies checksums and falls back to a
snapshot on a gap or a failed check; only verified versions reach the backend. It checks every
payload against the backend's model (`weight_layout()`: tensor names, shapes, dtypes) and the
`weights` section of the config (allowed store locations, size bounds); a refused version is
dead-lettered and counted, and the backend keeps serving the last good one.

`prefetch_weights` positions each policy's reader before the node builds its model: the Kafka
client fetches the newest snapshot and the deltas after it in the background meanwhile (over a
WAN, a snapshot takes seconds at the link's cap), and the follower applies them from memory once
the backend is up (`start_weight_followers(..., readers)`).

`wait_caught_up` holds a starting node back until its backends serve the newest version that
was published when it started (rule 3 and the staleness bound: a node does not answer tasks
with the weights it booted with while the trainer is far ahead).
"""

from __future__ import annotations

import logging
import threading
import time

from astraflow.config import AstraflowConfig
from astraflow.errors import KafkaLayerError
from astraflow.kafka.topics import Topics
from astraflow.raas.backends.base import InferenceBackend
from astraflow.weights.chain import ApplyStatus
from astraflow.weights.follow import KafkaWeightFollower, WeightFollower
from astraflow.weights.layout import ModelLayout
from astraflow.weights.verify import FollowLimits
from astraflow.weights.versions import latest_policy_version

log = logging.getLogger("astraflow.raas.weight_follower")


class BackendWeightFollower:
    """Follows one policy's weights topic in a background thread and updates its backend."""

    def __init__(self, cfg: AstraflowConfig, experiment: str, policy: str, backend: InferenceBackend,
                 requester: str = "raas", reader: KafkaWeightFollower | None = None) -> None:
        """`reader`: one `prefetch_weights` started and nothing has polled yet (its fetched records
        wait in the client); it gets the backend's layout here. Else a new one, started by `start`."""
        self.backend = backend
        layout_of = getattr(backend, "weight_layout", None)
        layout: ModelLayout | None = layout_of() if layout_of is not None else None
        if layout is None:
            log.warning("backend %s does not expose its model's layout: weights of %s are checked for size and "
                        "checksums only", backend.name, policy)
        limits = FollowLimits.from_settings(cfg.weights)
        if reader is None:
            self.follower = KafkaWeightFollower(cfg.kafka, experiment, policy, requester=requester, limits=limits,
                                                layout=layout)
        else:  # nothing fed yet: its chain starts empty, now checked against the model
            reader.follower = WeightFollower(policy, limits=limits, layout=layout)
            self.follower = reader
        self._started = reader is not None
        self.applied = 0  # versions handed to the backend
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name=f"weights-{policy}", daemon=True)

    def start(self) -> BackendWeightFollower:
        if not self._started:
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
                # Lent, not copied: the backend keeps them until its engine loads them, and the
                # chain never patches a lent tensor in place (a later delta copies what it changes).
                state = self.follower.follower.lend_state()
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


def prefetch_weights(cfg: AstraflowConfig, experiment: str, policies: list[str],
                     requester: str = "raas") -> dict[str, KafkaWeightFollower]:
    """A reader per policy, positioned at its newest snapshot, so that the Kafka client fetches
    the weights while the model is built; hand them to `start_weight_followers`."""
    readers: dict[str, KafkaWeightFollower] = {}
    for policy in policies:
        readers[policy] = KafkaWeightFollower(cfg.kafka, experiment, policy, requester=requester,
                                              limits=FollowLimits.from_settings(cfg.weights))
        readers[policy].start()
    return readers


def start_weight_followers(cfg: AstraflowConfig, experiment: str, backends: dict[str, InferenceBackend],
                           readers: dict[str, KafkaWeightFollower] | None = None) -> list[BackendWeightFollower]:
    readers = readers or {}
    return [BackendWeightFollower(cfg, experiment, policy, b, reader=readers.get(policy)).start()
            for policy, b in backends.items()]


def wait_caught_up(cfg: AstraflowConfig, experiment: str, backends: dict[str, InferenceBackend], timeout_s: float,
                   poll_s: float = 0.2) -> dict[str, tuple[int, int]]:
    """Waits until every backend serves at least the newest version of its policy named on the
    ``policies`` topic now (the followers apply it meanwhile). Returns the policies still behind
    after `timeout_s` as policy -> (served, newest); empty once caught up (or nothing published)."""
    topics = Topics(experiment)
    newest: dict[str, int] = {}
    for policy in backends:
        try:
            latest = latest_policy_version(cfg.kafka, topics, policy, timeout_s=min(30.0, max(timeout_s, 1.0)))
        except KafkaLayerError as exc:
            log.warning("cannot read the newest version of %s (%s); serving without waiting for it", policy, exc)
            continue
        if latest is not None:
            newest[policy] = int(latest.version)
    deadline = time.monotonic() + timeout_s
    t0 = time.monotonic()
    while True:
        behind = {p: (int(backends[p].version), v) for p, v in newest.items() if backends[p].version < v}
        if not behind:
            if newest:
                log.info("caught up in %.1f s: %s", time.monotonic() - t0,
                         ", ".join(f"{p} at version {backends[p].version}" for p in newest))
            return {}
        if time.monotonic() >= deadline:
            log.warning("still behind after %.0f s (%s); serving anyway, every token tagged with its version "
                        "(raise raas.catch_up_timeout_s to wait longer)", timeout_s,
                        ", ".join(f"{p}: {s} of {v}" for p, (s, v) in behind.items()))
            return behind
        time.sleep(poll_s)
