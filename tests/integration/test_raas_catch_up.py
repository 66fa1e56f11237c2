"""A starting node waits for the newest published weights before it serves (`wait_caught_up`).

A trainer's publisher (the real `WeightPublisher`) puts versions 0..3 on the topics before the
node starts; the node's follower must bring its backend to version 3 before `wait_caught_up`
returns. A version that the `policies` topic names but that never arrives cannot be waited for
forever: past the timeout the node is told how far behind it still is (and serves, tagged).
"""

from __future__ import annotations

import dataclasses
from pathlib import Path

from astraflow.config import AstraflowConfig, KafkaSettings
from astraflow.kafka.clients import RecordProducer
from astraflow.kafka.signing import Signer
from astraflow.kafka.topics import Topics
from astraflow.raas.backends.torch_backend import TorchBackend
from astraflow.raas.weight_follower import BackendWeightFollower, prefetch_weights, wait_caught_up
from astraflow.weights.publish import WeightPublisher


def test_a_starting_node_serves_only_once_it_applied_the_newest_version(
        kafka: KafkaSettings, experiment: str, tiny_model_dir: Path) -> None:
    cfg = AstraflowConfig(kafka=kafka)
    backend = TorchBackend("policy", str(tiny_model_dir), seed=0, max_batch=2, threads=1)
    follower = None
    try:
        layout = backend.weight_layout()
        sd = backend.state_dict()
        state = {g[0]: sd[g[0]].clone().contiguous() for g in layout.groups}
        booted = {k: t.clone() for k, t in state.items()}
        publisher = WeightPublisher(kafka, experiment, "policy")
        publisher.start()
        for v in range(4):  # the trainer ran ahead before this node (re)started
            state = {k: t + 0.01 if t.is_floating_point() else t for k, t in state.items()}
            publisher.publish(state, trainer_step=v)
        publisher.producer.flush()
        assert backend.version == 0

        follower = BackendWeightFollower(cfg, experiment, "policy", backend).start()
        assert wait_caught_up(cfg, experiment, {"policy": backend}, timeout_s=300) == {}
        assert backend.version == 3
        served = backend.state_dict()
        floats = [k for k, t in state.items() if t.is_floating_point()]
        # The published weights (as encoded, e.g. in bf16), not the ones it booted with.
        assert all((served[k] - state[k]).abs().max() < (served[k] - booted[k]).abs().max() for k in floats)

        # The policies topic names version 9, which never comes: a bounded wait that says so.
        manifest = publisher.latest
        assert manifest is not None
        producer = RecordProducer(kafka)  # the trainer's key: a version it announced and never sent
        value = producer.serde.dumps(dataclasses.replace(manifest, version=9))
        producer.send_raw(Topics(experiment).policies, value, "policy",
                          Signer(experiment, "trainer").headers("policies", "policy", value))
        producer.flush()
        behind = wait_caught_up(cfg, experiment, {"policy": backend}, timeout_s=1.0)
        assert behind == {"policy": (3, 9)}
    finally:
        if follower is not None:
            follower.stop()
        backend.close()


def test_weights_prefetched_while_the_model_is_built_are_applied_checked_against_it(
        kafka: KafkaSettings, experiment: str, tiny_model_dir: Path) -> None:
    """`prefetch_weights` positions the reader before the backend exists (the node's start-up:
    the Kafka client fetches the snapshot while the model is built); once the backend is up, the
    follower takes that reader, checks its versions against the model's layout and applies them."""
    cfg = AstraflowConfig(kafka=kafka)
    probe = TorchBackend("policy", str(tiny_model_dir), seed=0, max_batch=2, threads=1)
    try:  # a trainer published versions 0..2 before the node starts
        layout = probe.weight_layout()
        sd = probe.state_dict()
        state = {g[0]: sd[g[0]].clone().contiguous() for g in layout.groups}
    finally:
        probe.close()
    publisher = WeightPublisher(kafka, experiment, "policy")
    publisher.start()
    for v in range(3):
        state = {k: t + 0.01 if t.is_floating_point() else t for k, t in state.items()}
        publisher.publish(state, trainer_step=v)
    publisher.producer.flush()

    readers = prefetch_weights(cfg, experiment, ["policy"])  # before the model
    backend = TorchBackend("policy", str(tiny_model_dir), seed=0, max_batch=2, threads=1)
    follower = None
    try:
        follower = BackendWeightFollower(cfg, experiment, "policy", backend, reader=readers["policy"]).start()
        assert follower.follower is readers["policy"]
        assert follower.follower.follower.chain.layout is not None  # checked against the built model
        assert wait_caught_up(cfg, experiment, {"policy": backend}, timeout_s=300) == {}
        assert backend.version == 2
    finally:
        if follower is not None:
            follower.stop()
        else:
            readers["policy"].close()
        backend.close()
