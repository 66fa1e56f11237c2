"""The environments end to end on the real broker: Tasks in, a RaaS node runs the OpenAI-API agent
against its per-rollout endpoint, Trajectories out, scored by the environments' rewards.

The database and OS tests drive the node with a scripted "model" (a test double that writes a
chosen reply through the real tokenizer, so the test knows which answers are right and which
are wrong); the programming test uses the real torch backend and checks that every recorded
token is exactly what that model sampled, by recomputing its logprobs from the recorded context.
"""

from __future__ import annotations

import asyncio
import json
import re
import time
from collections.abc import Callable
from pathlib import Path

import numpy as np
import torch
from helpers import ScriptedBackend, collect

from astraflow.config import AstraflowConfig, KafkaSettings
from astraflow.dataflow.registry import REGISTRY
from astraflow.dataflow.rewards import score_async
from astraflow.envs.datasets import env_dataset
from astraflow.kafka.clients import RecordProducer
from astraflow.kafka.topics import Topics
from astraflow.raas.backends.torch_backend import TorchBackend
from astraflow.raas.node import NodeSettings, RaasNode
from astraflow.records import SamplingParams, Task, Trajectory, TrajectoryStatus


def _backend(model_dir: Path, brain: Callable[[str], str]) -> ScriptedBackend:
    """A scripted model: `brain(prompt text)` chooses the reply, encoded with the real tokenizer."""
    return ScriptedBackend("policy", model_dir, brain, version=2, context_length=2048, eos=True)


def _task(i: int, prompt: str, reference: dict, workflow: str, max_turns: int = 4) -> Task:
    return Task(task_id=f"{workflow}-{i}", group_id=f"g-{workflow}-{i}", prompt_id=f"p-{i}", dataset=workflow,
                workflow=workflow, prompt=prompt, reference=json.dumps(reference), policies=["policy"], n_samples=1,
                sampling=SamplingParams(temperature=1.0, max_tokens=24, max_turns=max_turns))


def _serve(kafka: KafkaSettings, experiment: str, tasks: list[Task], backend) -> list[Trajectory]:
    topics = Topics(experiment)
    producer = RecordProducer(kafka)
    for t in tasks:
        producer.send(topics.tasks, t, key=t.group_id)
    producer.flush()
    node = RaasNode(AstraflowConfig(kafka=kafka), NodeSettings(experiment, max_inflight=4), {"policy": backend})

    async def run() -> None:
        task = asyncio.create_task(node.run())
        deadline = time.monotonic() + 120
        while node.tasks_done < len(tasks) and time.monotonic() < deadline:
            await asyncio.sleep(0.1)
        node.stop()
        await task

    asyncio.run(run())
    out: list[Trajectory] = collect(kafka, topics.rollouts, Trajectory, lambda got: len(got) >= len(tasks), timeout_s=30)
    assert len(out) == len(tasks)
    assert node.agent_api.port is not None and node.agent_api.host == "127.0.0.1"
    return sorted(out, key=lambda t: t.task_id)


def _last_result(prompt: str) -> str | None:
    found = re.findall(r"<result>(.*?)</result>", prompt, re.S)
    return found[-1].strip().splitlines()[0] if found else None


def test_database_env_right_wrong_and_escaping_sql(kafka: KafkaSettings, experiment: str, tiny_model_dir: Path,
                                                  tmp_path: Path) -> None:
    rows = {r["prompt"]: r for r in env_dataset("db", 30, seed=1)}
    (q_right, right), (q_wrong, wrong) = list(rows.items())[:2]
    escape = tmp_path / "escape.db"
    plan = {q_right: json.loads(right["reference"])["query"], q_wrong: None}

    def brain(prompt: str) -> str:
        question = next(q for q in plan if q in prompt) if any(q in prompt for q in plan) else None
        result = _last_result(prompt)
        if question is None:  # the third task: try to write outside the database, then answer
            return f"<sql>ATTACH DATABASE '{escape}' AS x</sql>" if result is None else "Answer: 0"
        if plan[question] is None:
            return "Answer: -12345"
        return f"<sql>{plan[question]}</sql>" if result is None else f"Answer: {result}"

    third = _task(2, "How many tables can you attach?", json.loads(right["reference"]), "db_agent")
    tasks = [_task(0, q_right, json.loads(right["reference"]), "db_agent"),
             _task(1, q_wrong, json.loads(wrong["reference"]), "db_agent"), third]
    trajs = _serve(kafka, experiment, tasks, _backend(tiny_model_dir, brain))
    reward = REGISTRY.get("reward", "sql_result")
    got = [asyncio.run(score_async(reward, t)).reward for t in trajs[:2]]
    assert got == [1.0, 0.0]
    assert all(t.status is TrajectoryStatus.OK for t in trajs)
    assert trajs[0].tool_calls[0].name == "sql" and trajs[0].tool_calls[0].error is None
    escaped = trajs[2].tool_calls[0]
    assert "not authorized" in escaped.result and not escape.exists()
    seg_roles = [s.role for s in trajs[0].segments]
    assert seg_roles == ["prompt", "assistant", "tool", "assistant"]
    assert all(s.loss_mask.all() == (s.role == "assistant") for s in trajs[0].segments)


def test_os_env_check_script_right_wrong_and_network(kafka: KafkaSettings, experiment: str, tiny_model_dir: Path) -> None:
    ref = {"files": {"logs/app.log": "ERROR a\nINFO b\nERROR c\nERROR d\n"},
           "check": 'test "$(echo $ANSWER)" = "$(grep -c ERROR logs/app.log)"'}
    plan = {"Count A": ("grep -c ERROR logs/app.log", None), "Count B": (None, "7"),
            "Count C": ("python3 -c \"import socket; socket.create_connection(('1.1.1.1', 80), timeout=3)\"", "0"),
            "Count D": ("seq 1 1000", "1")}  # its output (~3,900 tokens) overflows the context

    def brain(prompt: str) -> str:
        key = next(k for k in plan if k in prompt)
        command, answer = plan[key]
        result = _last_result(prompt)
        if command is not None and result is None:
            return f"<bash>{command}</bash>"
        return f"Answer: {answer if answer is not None else result}"

    tasks = [_task(i, f"{k}: how many lines of logs/app.log contain ERROR?", ref, "os_agent") for i, k in enumerate(plan)]
    trajs = _serve(kafka, experiment, tasks, _backend(tiny_model_dir, brain))
    reward = REGISTRY.get("reward", "os_check")
    assert [reward(t).reward for t in trajs] == [1.0, 0.0, 0.0, 0.0]
    assert trajs[0].final_answer == "3" and trajs[0].tool_calls[0].result.startswith("3")
    net = trajs[2].tool_calls[0].result
    assert "Address family not supported" in net or "Operation not permitted" in net
    assert all(t.status is TrajectoryStatus.OK for t in trajs[:3])
    # the prompt with the long tool result is refused (400 context_length_exceeded), not truncated:
    # the episode ends TRUNCATED with the first call's segments only, and the node served the rest
    over = trajs[3]
    assert over.status is TrajectoryStatus.TRUNCATED and [s.role for s in over.segments] == ["prompt", "assistant"]
    assert over.tool_calls[0].result.startswith("1\n2\n3")


def test_code_env_real_model_tokens_are_exactly_the_sampled_ones(kafka: KafkaSettings, experiment: str,
                                                                 tiny_model_dir: Path) -> None:
    rows = env_dataset("code", 2, seed=0)
    tasks = [_task(i, r["prompt"], json.loads(r["reference"]), "code_agent", max_turns=2) for i, r in enumerate(rows)]
    backend = TorchBackend("policy", str(tiny_model_dir), seed=0, max_batch=4)
    try:
        trajs = _serve(kafka, experiment, tasks, backend)
        model = backend.model
        for t in trajs:
            assert t.status is not TrajectoryStatus.ERROR, t.error
            ids = np.concatenate([s.token_ids for s in t.segments])
            with torch.no_grad():
                logp = torch.log_softmax(model(torch.tensor([ids.tolist()])).logits[0].float(), -1)
            at = 0
            for s in t.segments:
                if s.role == "assistant":
                    want = logp[at - 1 : at - 1 + len(s)].gather(-1, torch.tensor(s.token_ids, dtype=torch.long)[:, None])
                    np.testing.assert_allclose(want.squeeze(-1).numpy(), s.logprobs, atol=1e-3)
                    assert s.loss_mask.all() and (s.versions == 0).all()
                else:
                    assert s.loss_mask.sum() == 0
                at += len(s)
            result = asyncio.run(score_async(REGISTRY.get("reward", "code_tests"), t))
            assert result.components["tests_total"] == 3.0  # a random model's text passes no test
    finally:
        backend.close()
