"""The RL pieces the learning benchmarks share (`async_vs_sync.py`, `vs_trl.py`).

Two workloads on the demo's warm-started tiny model (`astraflow demo`'s cached model: 383k
parameters, locally trained tokenizer, 50% of its demonstrations call the calculator):

* **a**, compute-bound single turn: the `rlvr` workflow, one completion of up to 32 tokens per
  sample, no tool; rollouts cost only decoding. Held-out success is scored the same way (one
  turn, no tool).
* **b**, agentic multi-turn: the `tool_use` workflow, up to 2 turns of 24 tokens, the
  calculator behind `astraflow.raas.tools.slow_tool` (log-normal delay, median `median_s`,
  log-space std `sigma`). Held-out success runs the demo evaluator's protocol (the tool is
  instant there: evaluation measures the policy, not the tool).

Both use arithmetic prompts split as the demo splits them, 8 samples per prompt (one GRPO
group), 64 samples per optimizer step, lr 3e-4 (the demo's), exact-match reward (the reward
app's `answers_match`), GRPO advantages (`astraflow.dataflow.advantages.grpo`) and the
trainer's loss (`astraflow.rl.policy_loss`, PPO clip on the behaviour logprobs).

`one_run` runs one of two schedules in ONE process with one `TorchBackend` holding 64 rollout
slots (batched decode, per-token logprobs and versions):

* **sync** (trainer-centred, verl-like): take 8 prompts, run their 64 rollouts concurrently,
  wait for ALL of them, reward, GRPO, one optimizer step, push the weights to the backend, next
  batch. Staleness 0; the backend idles during training and while the slowest rollouts finish.
* **dataflow** (AstraFlow's scheduling, in-process): a slot is refilled as soon as its rollout
  ends (as a RaasNode keeps max-inflight busy); a group is rewarded and advantaged when its 8
  samples are in (as curate does); the trainer takes the first 8 complete groups, steps in its
  own thread while rollouts go on, and pushes the weights. New groups start only while at most
  `staleness` versions ahead (the curator's max-ahead), so training stays near on-policy. The
  same scheduling as the Kafka pipeline minus Kafka and serde; `_pipeline.py` runs the real
  multi-process pipeline.

Weights are snapshotted every `eval_every` steps with the wall time and scored after the run
(`score_snapshots`), so evaluation costs neither mode time.
"""

from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass, field

import numpy as np
import torch

from astraflow.dataflow.advantages import grpo
from astraflow.models.arith import answers_match, reference_answer
from astraflow.raas.backends.torch_backend import TorchBackend
from astraflow.raas.node import NodeSettings
from astraflow.raas.tools import ToolBox, calculator, slow_tool
from astraflow.raas.workflows import RolloutContext
from astraflow.raas.workflows.builtin import extract_answer, rlvr, tool_use
from astraflow.records import NodeInfo, SamplingParams, Task, Trajectory
from astraflow.rl import PolicyLossConfig, policy_loss, sequence_logprobs
from stream_apps.groups import train_samples
from trainers.batching import collate
from trainers.config import TrainerSettings

# Every schedule cuts a tool call where the pipeline's RaaS node does (`NodeSettings.tool_timeout_s`),
# so no side waits for a call another side would have cut.
TOOL_TIMEOUT_S = NodeSettings.__dataclass_fields__["tool_timeout_s"].default

GROUP = 8  # samples per prompt
PROMPTS_PER_STEP = 8  # 64 samples per optimizer step, as the demo's trainer batch
SLOTS = GROUP * PROMPTS_PER_STEP  # concurrent rollouts, both modes
LR = 3e-4
N_HELDOUT = 128
WORKLOADS = {
    "a": {"workflow": "rlvr", "max_tokens": 32, "max_turns": 1, "eval_calls": 0,
          "label": "a: single-turn rlvr, no tool (compute-bound)"},
    "b": {"workflow": "tool_use", "max_tokens": 24, "max_turns": 2, "eval_calls": 2,
          "label": "b: multi-turn tool_use, calculator behind a log-normal delay"},
}


@dataclass
class Run:
    """What one run measured."""

    mode: str
    workload: str
    sigma: float
    wall_s: float = 0.0
    trajectories: int = 0  # rolled out (a run may roll out ahead of what it trains)
    trained: int = 0  # samples trained on
    train_s: float = 0.0  # time inside optimizer steps (trainer busy)
    rollout_s: float = 0.0  # sum of rollout durations (slot busy)
    snapshots: list[tuple[int, float, dict[str, torch.Tensor]]] = field(default_factory=list)  # step, t, weights
    success: list[tuple[int, float, float]] = field(default_factory=list)  # step, t, held-out success
    train_reward: list[float] = field(default_factory=list)  # mean reward per step
    notes: dict[str, float] = field(default_factory=dict)  # mode-specific extras
    learner_metrics: list[dict[str, float]] = field(default_factory=list)  # per optimizer batch (in-process)
    stages: dict[str, list[float | None]] = field(default_factory=dict)  # pipeline: per step, when each stage got there

    def summary(self, target: float) -> dict:
        """The figures every benchmark reports, as JSON-ready values."""
        return {
            "mode": self.mode, "workload": self.workload, "sigma": self.sigma, "wall_s": self.wall_s,
            "trajectories": self.trajectories, "trained": self.trained,
            "trained_per_s": self.trained / self.wall_s if self.wall_s else 0.0,
            "trainer_busy": self.train_s / self.wall_s if self.wall_s else 0.0,
            "rollout_slot_util": self.rollout_s / (SLOTS * self.wall_s) if self.wall_s else 0.0,
            "success": self.success, "start_success": self.success[0][2] if self.success else None,
            "final_success": self.success[-1][2] if self.success else None,
            "train_reward": self.train_reward, "target": target, "time_to_target_s": reach(self, target),
            **({"stages": self.stages} if self.stages else {}), **self.notes,
        }


def warm_model_dir() -> str:
    """The demo's warm-started tiny model (built on first use, then cached)."""
    from rich.console import Console

    from astraflow.demo.run import DemoSettings, warm_model

    return str(warm_model(DemoSettings(), Console()))


def tiny_model_dir() -> str:
    """A freshly initialised tiny model, no warm start (the fault harness: what it learns does not
    matter there), built on first use, then cached."""
    import shutil
    import uuid

    from astraflow.config import default_home
    from astraflow.models.tiny import init_tiny

    out = default_home() / "bench-models" / "tiny-init"
    if not (out / "config.json").exists():
        tmp = out.with_suffix(f".tmp{uuid.uuid4().hex[:6]}")
        init_tiny(tmp, seed=0)
        shutil.rmtree(out, ignore_errors=True)
        tmp.rename(out)
    return str(out)


def make_tasks(n_prompts: int, seed: int, workload: str, n_heldout: int = N_HELDOUT) -> tuple[list[Task], list[tuple[str, str]]]:
    """Training tasks and held-out (prompt, answer) pairs, split as the demo splits them."""
    from astraflow.models.tasks import arithmetic_dataset, split_heldout

    w = WORKLOADS[workload]
    train, heldout = split_heldout(arithmetic_dataset(max(4000, n_prompts * 3), seed=seed + 1, difficulty=2), 0.2)
    sampling = SamplingParams(temperature=1.0, max_tokens=w["max_tokens"], max_turns=w["max_turns"])
    tasks = [Task(task_id=f"t{i}", group_id=f"g{i}", prompt_id=p.prompt_id, dataset="arith", workflow=w["workflow"],
                  prompt=p.prompt, reference=p.reference, policies=["policy"], n_samples=GROUP, sampling=sampling)
             for i, p in enumerate(train[:n_prompts])]
    return tasks, [(p.prompt, reference_answer(p.reference)) for p in heldout[:n_heldout]]


def final_answer(workload: str, completion: str) -> str | None:
    """The answer the workflow would report for this completion text (rlvr falls back to the text)."""
    answer = extract_answer(completion)
    return answer if answer is not None or workload == "b" else completion.strip()


def reward_of(workload: str, completion: str, reference: str | None) -> float:
    """The reward app's exact-match reward of a completion against a task reference."""
    return float(answers_match(final_answer(workload, completion), reference_answer(reference or "")))


class Learner:
    """The trainer side: its own copy of the model, AdamW, one GRPO batch per call.

    AdamW's weight decay and betas and the gradient clip are the trainer's defaults
    (`trainers.config.TrainerSettings`), so an in-process schedule optimises as `astraflow train` does.

    `loss` is the policy loss (default: PPO clip on the behaviour logprobs). A batch is split
    into `minibatches` optimizer steps; the proximal policy of decoupled PPO is the model before
    the first of them (its logprobs recomputed once per batch, no gradient), so from the second
    minibatch on the clip acts. `metrics` keeps, per batch, the loss metrics (mean over its
    minibatches) and the staleness of its samples (versions behind, by oldest token).
    """

    def __init__(self, model_dir: str, loss: PolicyLossConfig | None = None, minibatches: int = 1,
                 policy: str = "policy") -> None:
        from astraflow.models.tiny import load_tiny

        self.policy = policy  # the policy whose sequences of each trajectory it trains on
        self.model, self.tokenizer = load_tiny(model_dir)
        self.model.train()
        trainer = TrainerSettings()
        self.opt = torch.optim.AdamW(self.model.parameters(), lr=LR, betas=trainer.betas, weight_decay=trainer.weight_decay)
        self.grad_clip = trainer.grad_clip
        self.pad = self.tokenizer.pad_token_id or 0
        self.loss = loss or PolicyLossConfig()
        self.minibatches = max(1, minibatches)
        self.version = 0  # optimizer batches done = the version the rollouts see after the push
        self.metrics: list[dict[str, float]] = []

    def _logprobs(self, ids: torch.Tensor, attn: torch.Tensor) -> torch.Tensor:
        return sequence_logprobs(self.model(input_ids=ids, attention_mask=attn).logits.float(), ids)

    def step(self, groups: list[list[tuple[Trajectory, float]]]) -> None:
        trajs = [t for g in groups for t, _ in g]
        rewards = np.array([r for g in groups for _, r in g])
        gids = np.array([i for i, g in enumerate(groups) for _ in g])
        adv = grpo(rewards, gids)  # on the full groups; corrections mask tokens afterwards
        samples = [s for t, a in zip(trajs, adv, strict=True) for s in train_samples(t, self.policy, advantage=float(a))]
        batch = collate(samples, self.pad)
        ids, attn, mask = batch["input_ids"], batch["attention_mask"], batch["loss_mask"]
        lags = torch.where(mask, self.version - batch["versions"], torch.zeros_like(batch["versions"]))
        proximal = None
        if self.minibatches > 1:
            with torch.no_grad():
                proximal = self._logprobs(ids, attn)
        parts = [p for p in torch.arange(len(samples)).chunk(self.minibatches) if len(p)]
        seen: list[dict[str, float]] = []
        for part in parts:
            out = policy_loss(self._logprobs(ids[part], attn[part]), batch["behaviour_logprobs"][part],
                              batch["advantages"][part], mask[part], self.loss,
                              proximal_logprobs=None if proximal is None else proximal[part], token_lags=lags[part])
            self.opt.zero_grad()
            out.loss.backward()
            if self.grad_clip is not None:
                torch.nn.utils.clip_grad_norm_(self.model.parameters(), self.grad_clip)
            self.opt.step()
            seen.append(out.metrics)
        row = {k: float(np.mean([m[k] for m in seen if k in m])) for k in seen[0]}
        sample_lags = (self.version - batch["min_versions"]).clamp(min=0).float()
        row.update(staleness_mean=sample_lags.mean().item(), staleness_max=sample_lags.max().item())
        self.metrics.append(row)
        self.version += 1

    def weights(self) -> dict[str, torch.Tensor]:
        return {k: v.detach().clone() for k, v in self.model.state_dict().items()}


async def rollout(task: Task, k: int, backend: TorchBackend, tools: ToolBox, node: NodeInfo, run: Run) -> tuple[Trajectory, float]:
    t0 = time.monotonic()
    flow = tool_use if task.workflow == "tool_use" else rlvr
    traj = await flow(RolloutContext(task, k, {"policy": backend}, tools, node))
    run.rollout_s += time.monotonic() - t0
    run.trajectories += 1
    traj.reward = float(answers_match(traj.final_answer, reference_answer(task.reference)))  # the reward app's exact match
    return traj, traj.reward


async def sync_mode(tasks: list[Task], steps: int, backend: TorchBackend, learner: Learner, tools: ToolBox,
                    eval_every: int, run: Run) -> None:
    node = NodeInfo("sync", backend.hardware(), "local", "torch")
    t0 = time.monotonic()
    run.snapshots.append((0, 0.0, learner.weights()))
    for step in range(1, steps + 1):
        batch = tasks[(step - 1) * PROMPTS_PER_STEP: step * PROMPTS_PER_STEP]
        outs = await asyncio.gather(*(rollout(t, k, backend, tools, node, run) for t in batch for k in range(GROUP)))
        groups = [list(outs[i * GROUP:(i + 1) * GROUP]) for i in range(len(batch))]
        run.train_reward.append(float(np.mean([r for _, r in outs])))
        ts = time.monotonic()
        learner.step(groups)  # nothing else runs meanwhile: that is the trainer-centred loop
        w = learner.weights()
        backend.update_weights(w, step)
        run.train_s += time.monotonic() - ts
        run.trained += len(outs)
        if step % eval_every == 0 or step == steps:
            run.snapshots.append((step, time.monotonic() - t0, w))
    run.wall_s = time.monotonic() - t0


async def dataflow_mode(tasks: list[Task], steps: int, backend: TorchBackend, learner: Learner, tools: ToolBox,
                        eval_every: int, staleness: int, run: Run, slots: int = SLOTS, weight_lag: int = 0) -> None:
    """The dataflow schedule (module docstring). `weight_lag` L > 0 pushes the rollout engine the
    weights of version v - L when the trainer reaches v: rollouts run L versions behind, so the
    trained samples are about L + 1 versions stale, as behind a queue L batches deep."""
    node = NodeInfo("dataflow", backend.hardware(), "local", "torch")
    t0 = time.monotonic()
    run.snapshots.append((0, 0.0, learner.weights()))
    pending: dict[int, list[tuple[Trajectory, float]]] = {}
    ready: list[list[tuple[Trajectory, float]]] = []
    history: dict[int, dict[str, torch.Tensor]] = {0: learner.weights()}  # versions not yet pushed
    version, next_task, slots_busy = 0, 0, 0
    wake = asyncio.Event()
    samples = ((i, k) for i in range(len(tasks)) for k in range(GROUP))  # group by group, as the curator issues
    stop = False

    async def one(i: int, k: int) -> None:
        nonlocal slots_busy
        out = await rollout(tasks[i], k, backend, tools, node, run)
        pending.setdefault(i, []).append(out)
        if len(pending[i]) == GROUP:
            ready.append(pending.pop(i))
        slots_busy -= 1
        wake.set()

    async def trainer() -> None:
        nonlocal version, stop
        while version < steps:
            while len(ready) < PROMPTS_PER_STEP:
                wake.clear()
                await wake.wait()
            groups, ready[:] = ready[:PROMPTS_PER_STEP], ready[PROMPTS_PER_STEP:]
            run.train_reward.append(float(np.mean([r for g in groups for _, r in g])))
            ts = time.monotonic()
            await asyncio.to_thread(learner.step, groups)  # rollouts go on meanwhile
            w = learner.weights()
            history[version + 1] = w
            pushed = max(0, version + 1 - weight_lag)
            backend.update_weights(history[pushed], pushed)
            for old in [v for v in history if v < pushed]:
                del history[old]
            run.train_s += time.monotonic() - ts
            run.trained += sum(len(g) for g in groups)
            version += 1
            if version % eval_every == 0 or version == steps:
                run.snapshots.append((version, time.monotonic() - t0, w))
            wake.set()
        stop = True

    train_task = asyncio.create_task(trainer())
    running: set[asyncio.Task] = set()
    while not stop:
        # Bounded staleness: a group may start at most `staleness` steps ahead of the trainer.
        limit = min(len(tasks), (version + 1 + staleness) * PROMPTS_PER_STEP)
        while slots_busy < slots and next_task < limit:
            i, k = next(samples)
            slots_busy += 1
            t = asyncio.create_task(one(i, k))
            running.add(t)
            t.add_done_callback(running.discard)
            if k == GROUP - 1:
                next_task = i + 1
        wake.clear()
        await wake.wait()
    await train_task
    run.wall_s = time.monotonic() - t0
    for t in list(running):
        t.cancel()
    await asyncio.gather(*running, return_exceptions=True)


def heldout_success(model, tokenizer, heldout: list[tuple[str, str]], workload: str, seed: int) -> float:
    """Sampled (temperature 1, 2 episodes per problem) held-out success with the workload's protocol."""
    from astraflow.models.arith import parse_answer
    from astraflow.models.evaluate import run_tool_use

    items = heldout * 2
    calls = WORKLOADS[workload]["eval_calls"]
    correct = 0
    torch.manual_seed(seed)
    with torch.no_grad():
        for lo in range(0, len(items), 128):
            chunk = items[lo: lo + 128]
            outs = run_tool_use(model, tokenizer, [p for p, _ in chunk], temperature=1.0, max_calls=calls)
            correct += sum(answers_match(parse_answer(text), ref) for (text, _), (_, ref) in zip(outs, chunk, strict=True))
    return correct / max(len(items), 1)


def score_snapshots(run: Run, model, tokenizer, heldout: list[tuple[str, str]]) -> None:
    """Held-out success of each snapshot (the same seed per step for every run); frees the snapshots."""
    model.eval()
    for step, t, w in run.snapshots:
        missing, unexpected = model.load_state_dict(w, strict=False)  # published weights may omit buffers
        assert not unexpected and not [k for k in missing if k in dict(model.named_parameters())], (missing, unexpected)
        run.success.append((step, t, heldout_success(model, tokenizer, heldout, run.workload, 1000 + step)))
    run.snapshots.clear()


def reach(run: Run, target: float) -> float | None:
    """Wall time of the first snapshot at or above `target`, or None."""
    return next((t for _, t, s in run.success if s >= target), None)


def one_run(mode: str, workload: str, sigma: float, *, steps: int, eval_every: int, staleness: int, seed: int,
            median_s: float, model_dir: str, tasks: list[Task], heldout: list[tuple[str, str]],
            loss: PolicyLossConfig | None = None, minibatches: int = 1, slots: int = SLOTS, weight_lag: int = 0) -> Run:
    """One in-process run ("sync" or "dataflow"), scored; `loss` / `minibatches`: see `Learner`;
    `slots` / `weight_lag`: rollouts in flight and lag of the engine's weights in dataflow mode."""
    torch.manual_seed(seed)
    backend = TorchBackend("policy", model_dir, seed=seed, max_batch=max(SLOTS, slots), threads=1, device="cpu")
    learner = Learner(model_dir, loss, minibatches)
    tools = ToolBox({"calc": slow_tool(calculator, median_s, sigma, seed=seed)}, timeout_s=TOOL_TIMEOUT_S)
    run = Run(mode, workload, sigma)
    if mode == "sync":
        asyncio.run(sync_mode(tasks, steps, backend, learner, tools, eval_every, run))
    else:
        asyncio.run(dataflow_mode(tasks, steps, backend, learner, tools, eval_every, staleness, run, slots, weight_lag))
    backend.close()
    run.learner_metrics = learner.metrics
    score_snapshots(run, learner.model, learner.tokenizer, heldout)
    return run
