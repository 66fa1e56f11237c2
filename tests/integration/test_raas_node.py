"""RaaS node against a real Kafka: tasks in, trajectories out, DLQ for malformed tasks, versions."""

from __future__ import annotations

import asyncio
import time
from pathlib import Path

import numpy as np
import torch
from helpers import collect

from astraflow.config import AstraflowConfig, KafkaSettings
from astraflow.kafka.clients import RecordProducer
from astraflow.kafka.topics import Topics
from astraflow.raas.backends.torch_backend import TorchBackend
from astraflow.raas.node import NodeSettings, RaasNode
from astraflow.records import DeadLetter, SamplingParams, Trajectory
from astraflow.testing import make_task


async def _run_until(node: RaasNode, done, timeout_s: float = 120.0) -> None:
    task = asyncio.create_task(node.run())
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout_s
    while not done() and loop.time() < deadline:
        await asyncio.sleep(0.2)
    node.stop()
    await task


def test_sixteen_tasks_four_samples(kafka: KafkaSettings, experiment: str, tiny_model_dir: Path) -> None:
    topics = Topics(experiment)
    producer = RecordProducer(kafka)
    for i in range(16):
        t = make_task(i, n_samples=4)
        t.sampling = SamplingParams(temperature=1.0, max_tokens=12)
        producer.send(topics.tasks, t, key=t.group_id)
    bad = make_task(99)
    bad.workflow = "no_such_workflow"
    producer.send(topics.tasks, bad, key=bad.group_id)
    producer.flush()

    backend = TorchBackend("policy", str(tiny_model_dir), seed=0, max_batch=16)
    cfg = AstraflowConfig(kafka=kafka)
    node = RaasNode(cfg, NodeSettings(experiment, max_inflight=16, metrics_interval_s=1.0), {"policy": backend})
    asyncio.run(_run_until(node, lambda: node.tasks_done >= 16))

    trajs: list[Trajectory] = collect(kafka, topics.rollouts, Trajectory, lambda got: len(got) >= 64)
    assert len(trajs) == 64
    assert {t.trajectory_id for t in trajs} == {f"task-{i}/{s}" for i in range(16) for s in range(4)}
    model = backend.model
    for t in trajs[:8]:
        prompt, gen = t.segments[0], t.segments[1]
        assert prompt.loss_mask.sum() == 0 and (prompt.versions == -1).all()
        assert gen.loss_mask.all() and (gen.versions == 0).all() and len(gen) > 0
        ids = torch.tensor([np.concatenate([prompt.token_ids, gen.token_ids]).tolist()])
        with torch.no_grad():
            logp = torch.log_softmax(model(ids).logits[0].float(), -1)
        recomputed = logp[len(prompt) - 1 : -1].gather(-1, torch.tensor(gen.token_ids, dtype=torch.long)[:, None])
        np.testing.assert_allclose(recomputed.squeeze(-1).numpy(), gen.logprobs, atol=1e-3)
        assert t.node.backend == "torch" and t.node.hardware.startswith("cpu")

    letters: list[DeadLetter] = collect(kafka, topics.dlq, DeadLetter, lambda got: len(got) >= 1)
    assert len(letters) == 1 and letters[0].error_class == "InvalidTaskError"
    assert "no_such_workflow" in letters[0].error and letters[0].component == "raas"
    backend.close()


def test_new_version_mid_run_shows_in_later_tokens(kafka: KafkaSettings, experiment: str, tiny_model_dir: Path) -> None:
    topics = Topics(experiment)
    backend = TorchBackend("policy", str(tiny_model_dir), seed=0, max_batch=4)
    producer = RecordProducer(kafka)
    task = make_task(0, n_samples=1)
    task.sampling = SamplingParams(temperature=1.0, max_tokens=64)
    producer.send(topics.tasks, task, key=task.group_id)
    producer.flush()
    cfg = AstraflowConfig(kafka=kafka)
    node = RaasNode(cfg, NodeSettings(experiment, max_inflight=4), {"policy": backend})

    # Publish "version 7" (same weights, new number) while the rollout decodes.
    async def bump() -> None:
        while backend.decode_steps < 3:
            await asyncio.sleep(0.001)
        backend.update_weights(backend.state_dict(), 7)

    async def main() -> None:
        b = asyncio.create_task(bump())
        await _run_until(node, lambda: node.tasks_done >= 1)
        await b

    asyncio.run(main())
    (traj,) = collect(kafka, topics.rollouts, Trajectory, lambda got: len(got) >= 1)
    versions = traj.segments[1].versions
    assert len(versions) > 5, "the rollout ended before the update could land"
    assert versions[0] == 0 and versions[-1] == 7 and np.all(np.diff(versions) >= 0)
    backend.close()


def test_prometheus_endpoint_serves_node_metrics(kafka: KafkaSettings, experiment: str, tiny_model_dir: Path) -> None:
    """`ASTRAFLOW_METRICS_PORT` opts a node into a /metrics endpoint with its rollout figures."""
    import os
    import signal
    import socket
    import subprocess
    import sys
    import urllib.request

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    producer = RecordProducer(kafka)
    task = make_task(0, n_samples=2)
    task.sampling = SamplingParams(temperature=1.0, max_tokens=8)
    producer.send(Topics(experiment).tasks, task, key=task.group_id)
    producer.flush()
    env = {**os.environ, "ASTRAFLOW__KAFKA__BOOTSTRAP_SERVERS": kafka.bootstrap_servers, "ASTRAFLOW_METRICS_PORT": str(port)}
    # Metrics every second (the CLI keeps NodeSettings' 5 s default; the test waits for two rounds).
    proc = subprocess.Popen([sys.executable, "-m", "astraflow_cli.main", "raas", "serve", "-e", experiment,
                             "-p", f"policy={tiny_model_dir}", "--node-id", "prom-node", "--threads", "1",
                             "--no-follow-weights"], env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    body = ""
    try:
        deadline = time.monotonic() + 240  # a loaded machine: the engine process starts, the model loads
        while time.monotonic() < deadline and "astraflow_rollouts_total" not in body:
            time.sleep(1)
            try:
                body = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=2).read().decode()
            except OSError:
                continue
    finally:
        proc.send_signal(signal.SIGTERM)
        proc.wait(timeout=60)
    assert "astraflow_rollouts_total{" in body and 'node_id="prom-node"' in body, body[-2000:]
    assert any(ln.startswith("astraflow_policy_version{") and 'component="raas"' in ln for ln in body.splitlines())
    assert 'astraflow_role_up{component="raas"' in body
