"""Which records `astraflow status` and the dashboard believe: those signed by their owner.

A `Metric` says which component and instance wrote it, and anyone who reaches the broker can
write one claiming to be any node (on the default cluster, which has no ACLs). Each role
therefore signs its metrics with its key (`astraflow.kafka.signing.MetricSigner`: the RaaS
nodes' `raas` key, the stream apps' and processors' `apps` key, the trainer's key), and status
counts a series only when its newest record carries a valid signature of the role its
component names; the others are shown apart, as unverified, and feed no figure (nodes, apps,
trainers, autoscaling). `PolicyVersion` records on `policies` count only when the trainer
signed them, as for every other reader of that topic.

What a role key proves is the role, not the instance: any RaaS node could still claim to be
another RaaS node (docs/security.md, "What remains open").
"""

from __future__ import annotations

from typing import Any

from astraflow.kafka.signing import METRICS, KeyStore, SignatureError, Verifier, metric_role
from astraflow.records import Metric


class Provenance:
    """Checks metrics and policy versions against one experiment's trust file on this host (a
    host without one believes nothing)."""

    def __init__(self, experiment: str) -> None:
        self.experiment, self.store = experiment, KeyStore(experiment)
        self.verifier: Verifier | None = None

    def _check(self, stream: str, key: bytes | None, value: bytes | None, headers: list[Any], role: str | None) -> bool:
        if self.verifier is None and self.store.exists():  # looked for again until it is there
            self.verifier = Verifier(self.experiment, self.store)
        if self.verifier is None or role is None:
            return False
        try:
            self.verifier.check(stream, key, value, headers, role=role)
        except SignatureError:
            return False
        return True

    def metric(self, m: Metric, key: bytes | None, value: bytes | None, headers: list[Any]) -> bool:
        """Whether the role that `m.component` names signed this metric."""
        return self._check(METRICS, key, value, headers, metric_role(m.component))

    def policy_version(self, key: bytes | None, value: bytes | None, headers: list[Any]) -> bool:
        """Whether a trainer of the experiment signed this `policies` record."""
        return self._check("policies", key, value, headers, "trainer")
