"""Several policies through the whole dataflow on a real broker: curator -> RaaS node -> reward -> curate.

One node serves every policy (tiny random models); the reward gives each policy its own reward,
and curate routes each policy's samples to its own train topic, each holding only that
policy's tokens. Two workflows: `solver_verifier` with a solver and two verifiers, and
`coder_tester` (the coder's function and the tester's asserts run in the sandbox).
"""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import Callable
from pathlib import Path

import pytest

from astraflow.config import AstraflowConfig, KafkaSettings
from astraflow.envs.datasets import env_dataset
from astraflow.kafka.topics import Topics
from astraflow.raas.backends.torch_backend import TorchBackend
from astraflow.raas.node import NodeSettings, RaasNode
from astraflow.records import SamplingParams, TrainSample, Trajectory
from stream_apps.curator import CuratorOptions
from stream_apps.engine import EngineSettings
from stream_apps.launch import AppOptions, build_worker
from stream_apps.slots import SlotDefault

TASKS, SAMPLES = 3, 2
ALL = ["solver", "v1", "v2", "coder", "tester"]


@pytest.fixture
def exp(make_experiment: Callable[..., str]) -> str:
    return make_experiment("exp", ALL)


def run_job(kafka: KafkaSettings, exp: str, model: Path, data: Path, policies: list[str], workflow: str,
            reward: SlotDefault) -> tuple[list[Trajectory], list[TrainSample]]:
    from test_stream_pipeline import start, stop

    from astraflow.testing import read_records

    topics = Topics(exp)
    curator = CuratorOptions([data], policies, n_samples=SAMPLES, max_ahead=TASKS, workflow=workflow, max_tasks=TASKS,
                             trainer_group="none", sampling=SamplingParams(max_tokens=6, max_turns=2))
    # Random models: every reward may be equal and every rollout truncated; keep all samples.
    keep_all = {"filter.zero_variance": SlotDefault("none"), "filter.length": SlotDefault("none")}
    settings = dict(metrics_interval_s=1.0, commit_interval_s=0.5)
    workers = [build_worker("curator", EngineSettings(exp, kafka, **settings), AppOptions(curator=curator)),
               build_worker("reward", EngineSettings(exp, kafka, **settings), AppOptions(defaults={"reward": reward})),
               build_worker("curate", EngineSettings(exp, kafka, **settings), AppOptions(policies=policies, defaults=keep_all))]
    threads = start(*workers)
    backends = {p: TorchBackend(p, str(model), seed=i, max_batch=8) for i, p in enumerate(policies)}
    node = RaasNode(AstraflowConfig(kafka=kafka), NodeSettings(exp, max_inflight=8, metrics_interval_s=1.0), backends)

    async def serve() -> None:
        run = asyncio.create_task(node.run())
        deadline = time.monotonic() + 120
        while node.tasks_done < TASKS and time.monotonic() < deadline:
            await asyncio.sleep(0.2)
        node.stop()
        await run

    try:
        asyncio.run(serve())
        want = len(policies) * TASKS * SAMPLES
        samples = read_records(kafka, [topics.train(p) for p in policies], lambda out: len(out) >= want, timeout_s=90)
        scored = read_records(kafka, [topics.scored], lambda out: len(out) >= TASKS * SAMPLES)
    finally:
        for b in backends.values():
            b.close()
        stop(workers, threads)
    return scored, samples


def check(scored: list[Trajectory], samples: list[TrainSample], policies: list[str]) -> dict[str, Trajectory]:
    assert len(scored) == TASKS * SAMPLES and all(isinstance(t, Trajectory) for t in scored)
    by_id = {t.trajectory_id: t for t in scored}
    assert all(isinstance(s, TrainSample) for s in samples)
    assert sorted(s.sample_id for s in samples) == sorted(f"{t}#{p}" for t in by_id for p in policies)  # one each, no more
    for s in samples:
        t = by_id[s.trajectory_id]
        own = [seg for seg in t.segments if seg.policy == s.policy]
        assert s.token_ids.tolist() == [int(i) for seg in own for i in seg.token_ids]  # its tokens only, in order
        assert s.reward == pytest.approx(t.reward_components[f"policy.{s.policy}"])
    return by_id


def test_a_solver_and_two_verifiers_train_on_their_own_topics(kafka: KafkaSettings, exp: str, tiny_model_dir: Path,
                                                               tmp_path: Path) -> None:
    data = tmp_path / "arith.jsonl"
    data.write_text("".join(json.dumps({"id": f"q{i}", "prompt": f"Q: What is {i}+{i}?\nA:", "reference": {"answer": str(2 * i)}})
                            + "\n" for i in range(5)))
    policies = ["solver", "v1", "v2"]
    scored, samples = run_job(kafka, exp, tiny_model_dir, data, policies, "solver_verifier",
                              SlotDefault("solver_verifier", {"bonus": 0.5}))
    for t in check(scored, samples, policies).values():
        assert set(t.metadata) >= {"solver", "verdict.v1", "verdict.v2"} and t.metadata["solver"] == "solver"


def test_a_coder_and_a_tester_are_rewarded_from_the_sandbox(kafka: KafkaSettings, exp: str, tiny_model_dir: Path,
                                                            tmp_path: Path) -> None:
    data = tmp_path / "code.jsonl"
    rows = [{k: v for k, v in row.items() if k != "workflow"} for row in env_dataset("code", 5, seed=0)]  # not code_agent
    data.write_text("".join(json.dumps(row) + "\n" for row in rows))
    policies = ["coder", "tester"]
    scored, samples = run_job(kafka, exp, tiny_model_dir, data, policies, "coder_tester",
                              SlotDefault("coder_tester", {"timeout_s": 10, "cpu_s": 2, "memory_mb": 256}))
    for t in check(scored, samples, policies).values():
        assert t.workflow == "coder_tester" and t.reward_components["hidden_total"] >= 1  # the hidden tests ran
        assert {"tests_written", "tests_valid", "caught"} <= set(t.reward_components)
