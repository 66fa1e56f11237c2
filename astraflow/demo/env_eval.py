"""Held-out reward of an environment scenario (`astraflow demo --scenario db|os|code`).

`heldout_rewards` runs the environment's workflow (the OpenAI-API agent against a per-rollout
endpoint, in this process) on held-out dataset rows that neither the warm start nor training
saw (`heldout_tasks`), with a torch backend of the given weights, and scores each trajectory with the
environment's reward. `final_weights` reads the newest version a trainer published, the way a
RaaS node follows it. The scenario calls both after its learning phase: the warm start's and the
final weights' mean reward on the same rows, sampled as in training and greedy.
"""

from __future__ import annotations

import asyncio
import math
import time
from pathlib import Path
from typing import Any

from astraflow.config import AstraflowConfig
from astraflow.records import NodeInfo, SamplingParams, Task

HELDOUT_SEED_OFFSET = 2000  # training rows use the seed, demonstrations seed + 1000


def final_weights(cfg: AstraflowConfig, experiment: str, policy: str, idle_s: float = 5.0,
                  limit_s: float = 90.0) -> tuple[int, dict[str, Any]] | None:
    """(version, state) of the newest version on the policy's weights topic; None when none was published."""
    from astraflow.weights.follow import KafkaWeightFollower
    from astraflow.weights.verify import FollowLimits

    follower = KafkaWeightFollower(cfg.kafka, experiment, policy, request_snapshots=False, requester="scenario-eval",
                                   limits=FollowLimits.from_settings(cfg.weights), report_refusals=False)
    try:
        follower.start()
        deadline, last_change, seen = time.monotonic() + limit_s, time.monotonic(), None
        while time.monotonic() < deadline and time.monotonic() - last_change < idle_s:
            follower.poll(timeout_s=0.5)
            if follower.follower.version != seen:
                seen, last_change = follower.follower.version, time.monotonic()
        if seen is None:
            return None
        return int(seen), dict(follower.follower.state)
    finally:
        follower.close()


def heldout_tasks(scenario: str, n: int, seed: int, temperature: float, max_tokens: int, max_turns: int,
                  n_train: int = 2000) -> list[Task]:
    """Up to `n` one-sample tasks of the scenario that neither the training rows (`n_train` rows of
    `seed`) nor the warm start's demonstrations (1000 rows of `seed + 1000`) hold: the os and code
    task spaces are small enough that fresh draws often repeat a training task, so those are
    skipped (code has 25 tasks in all: none is left)."""
    from astraflow.envs.datasets import env_dataset

    seen = {r["reference"] for r in env_dataset(scenario, n_train, seed=seed)}
    seen |= {r["reference"] for r in env_dataset(scenario, 1000, seed=seed + 1000)}
    sampling = SamplingParams(temperature=temperature, max_tokens=max_tokens, max_turns=max_turns)
    rows, chosen = env_dataset(scenario, 50 * n, seed=seed + HELDOUT_SEED_OFFSET), []
    for row in rows:
        if row["reference"] not in seen and len(chosen) < n:
            seen.add(row["reference"])
            chosen.append(row)
    return [Task(task_id=f"heldout-{i}", group_id=f"heldout-{i}", prompt_id=row["id"], dataset=row["dataset"],
                 workflow=row["workflow"], prompt=row["prompt"], reference=row["reference"], policies=["policy"],
                 n_samples=1, sampling=sampling)
            for i, row in enumerate(chosen)]


def heldout_rewards(model_dir: Path, weights: tuple[int, dict[str, Any]] | None, tasks: list[Task], reward: str,
                    concurrency: int = 16) -> list[float]:
    """The reward of each of `tasks` run by the model in `model_dir` (with `weights` applied, when given)."""
    from astraflow.dataflow.registry import REGISTRY
    from astraflow.dataflow.rewards import score_async
    from astraflow.raas.agent_api import AgentEndpoint
    from astraflow.raas.backends.torch_backend import TorchBackend
    from astraflow.raas.tools import ToolBox
    from astraflow.raas.workflows import RolloutContext
    from astraflow.raas.workflows.envs import ENV_WORKFLOWS

    backend = TorchBackend("policy", str(model_dir), max_batch=concurrency, seed=0, threads=2)
    try:
        if weights is not None:
            backend.update_weights(weights[1], weights[0])
            if not backend.wait_version(weights[0], 120.0):
                raise TimeoutError(f"the evaluation backend did not apply version {weights[0]} in 120 s")
        scorer = REGISTRY.get("reward", reward)

        async def run_all() -> list[float]:
            endpoint = AgentEndpoint()
            gate = asyncio.Semaphore(concurrency)

            async def one(task: Task) -> float:
                async with gate:
                    ctx = RolloutContext(task, 0, {"policy": backend}, ToolBox({}),
                                         NodeInfo("eval", "cpu", "local", "torch"), agent_api=endpoint)
                    try:
                        traj = await ENV_WORKFLOWS[task.workflow](ctx)
                    except Exception:  # an episode the workflow cannot finish scores 0, as a node's error does
                        return 0.0
                    return float((await score_async(scorer, traj)).reward)

            try:
                return await asyncio.gather(*(one(t) for t in tasks))
            finally:
                await endpoint.close()

        rewards = asyncio.run(run_all())
    finally:
        backend.close()
    return list(rewards)


def mean_se(xs: list[float]) -> tuple[float, float]:
    """(mean, standard error of the mean) of `xs`; the error is 0 below two values."""
    n = len(xs)
    if n == 0:
        return 0.0, 0.0
    mean = sum(xs) / n
    if n < 2:
        return mean, 0.0
    var = sum((x - mean) ** 2 for x in xs) / (n - 1)
    return mean, math.sqrt(var / n)


def evaluate_run(cfg: AstraflowConfig, experiment: str, scenario: str, reward: str, model_dir: Path, n: int,
                 seed: int, max_tokens: int, max_turns: int, n_train: int) -> dict[str, Any]:
    """The warm start's and the final weights' held-out reward, sampled (T=1) and greedy, each with
    its standard error (`_se`), and the change on the same tasks with the standard error of the
    paired differences (`_change`, `_change_se`)."""
    final = final_weights(cfg, experiment, "policy")
    rows = len(heldout_tasks(scenario, n, seed, 1.0, max_tokens, max_turns, n_train))
    out: dict[str, Any] = {"heldout_rows": rows, "final_version": final[0] if final else 0}
    if not rows:
        return out
    for label, temperature in (("sampled", 1.0), ("greedy", 0.0)):
        tasks = heldout_tasks(scenario, n, seed, temperature, max_tokens, max_turns, n_train)
        warm = heldout_rewards(model_dir, None, tasks, reward)
        out[f"heldout_{label}_warm_start"], out[f"heldout_{label}_warm_start_se"] = _rounded(mean_se(warm))
        out[f"heldout_{label}_final"] = out[f"heldout_{label}_final_se"] = None
        if final:
            last = heldout_rewards(model_dir, final, tasks, reward)
            out[f"heldout_{label}_final"], out[f"heldout_{label}_final_se"] = _rounded(mean_se(last))
            diffs = [b - a for a, b in zip(warm, last, strict=True)]
            out[f"heldout_{label}_change"], out[f"heldout_{label}_change_se"] = _rounded(mean_se(diffs))
    return out


def _rounded(pair: tuple[float, float]) -> tuple[float, float]:
    return round(pair[0], 4), round(pair[1], 4)


__all__ = ["evaluate_run", "final_weights", "heldout_rewards", "heldout_tasks", "mean_se"]

