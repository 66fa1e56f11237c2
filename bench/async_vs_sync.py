"""Dataflow vs trainer-centred RL under heavy-tailed tool latency (issue 9, workload b).

Workload (b): the demo's agentic task. The tiny warm-started model (`astraflow demo`'s cached
model: 50% of its demonstrations call the calculator) runs the multi-turn `tool_use` workflow on
arithmetic prompts (8 samples per prompt, 24 tokens a turn, 2 turns, temperature 1); the
calculator sits behind `astraflow.raas.tools.slow_tool`, a log-normal delay with a median of
0.2 s and sigma in {0.5, 1.0, 1.5}. Why log-normal: latencies of remote services (web APIs,
sandboxes, simulators) are products of many independent slow-downs, so their logs are roughly
normal, with a long right tail; a 0.2 s median is a fast remote API. Sigma sets the tail: the
p99 is 3.2x (0.5), 10x (1.0) and 33x (1.5) the median, i.e. 0.6 s, 2 s and 6.6 s. With 64
rollouts a batch, the slowest one is around the p98.5 of the distribution.

Both modes run in ONE process on the same machine, model, prompts (same order), sample budget
(`--steps` x 64 samples), learning rate (3e-4, the demo's), GRPO advantages
(`astraflow.dataflow.advantages.grpo`), loss (`astraflow.rl.policy_loss`, PPO clip on the
behaviour logprobs), one AdamW step per 64 samples, and the same 64 rollout slots on one
`TorchBackend` (batched decode, per-token logprobs and versions):

* sync (trainer-centred, verl-like): take 8 prompts, run their 64 rollouts concurrently, wait
  for ALL of them, reward, GRPO, one optimizer step, push the weights to the backend, next
  batch. Staleness 0; the backend idles during training and while the slowest tools finish.
* dataflow (AstraFlow's scheduling, in-process): the 64 slots are refilled as soon as a
  rollout ends (as a RaasNode keeps max-inflight busy); a group is rewarded and its GRPO
  advantages computed when its 8 samples are in (as curate does); the trainer takes the first 8
  complete groups, steps in its own thread while rollouts go on, and pushes the weights. New
  groups are only issued while they are at most `--staleness` versions ahead (the curator's
  max-ahead), so training stays near on-policy. This is the same scheduling as the Kafka
  pipeline minus Kafka and serde (bench/dataplane.py measures those); it is NOT the multi-process
  pipeline (`astraflow demo`) itself.

Evaluation: the trainer's weights are snapshotted every `--eval-every` steps with the wall time;
after the run each snapshot is scored with the demo evaluator's `evaluate` (held-out prompts,
temperature 1, 2 episodes each; the tool is instant there), so evaluation costs neither mode
time. Figures per mode: wall time, trajectories/s (trained ones: steps x 64 / wall; the dataflow
also rolls out up to `--staleness` batches ahead, counted apart), held-out success per snapshot, time to reach
the target success, trainer busy fraction (optimizer-step time / wall) and rollout-slot
utilisation (sum of rollout durations / (64 x wall)); their complements are the idle fractions.
torch runs with 1 thread per role (backend engine, trainer) on this 2-core machine.

Usage: python bench/async_vs_sync.py [--quick] [--json OUT] [--sigmas 0.5,1.0,1.5] [--steps N]
"""

from __future__ import annotations

import argparse
import asyncio
import time
from dataclasses import dataclass, field
from typing import Any

import _common  # first: it takes bench/ off sys.path (see _common.py)
import numpy as np
import torch

from astraflow.dataflow.advantages import grpo
from astraflow.models.arith import answers_match, reference_answer
from astraflow.raas.backends.torch_backend import TorchBackend
from astraflow.raas.tools import ToolBox, calculator, slow_tool
from astraflow.raas.workflows import RolloutContext
from astraflow.raas.workflows.builtin import tool_use
from astraflow.records import NodeInfo, SamplingParams, Task, Trajectory
from astraflow.rl import PolicyLossConfig, policy_loss, sequence_logprobs
from stream_apps.groups import train_sample
from trainers.data import collate

GROUP = 8  # samples per prompt
PROMPTS_PER_STEP = 8  # 64 samples per optimizer step, as the demo's trainer batch
SLOTS = GROUP * PROMPTS_PER_STEP  # concurrent rollouts, both modes
LR = 3e-4


@dataclass
class Run:
    """What one mode measured."""

    mode: str
    sigma: float
    wall_s: float = 0.0
    trajectories: int = 0
    train_s: float = 0.0  # time inside optimizer steps
    rollout_s: float = 0.0  # sum of rollout durations
    snapshots: list[tuple[int, float, dict[str, torch.Tensor]]] = field(default_factory=list)  # step, t, weights
    success: list[tuple[int, float, float]] = field(default_factory=list)  # step, t, held-out success
    train_reward: list[float] = field(default_factory=list)  # mean reward per step


class Learner:
    """The trainer side: its own copy of the model, AdamW, one GRPO step per call."""

    def __init__(self, model_dir: str) -> None:
        from astraflow.models.tiny import load_tiny

        self.model, self.tokenizer = load_tiny(model_dir)
        self.model.train()
        self.opt = torch.optim.AdamW(self.model.parameters(), lr=LR)
        self.pad = self.tokenizer.pad_token_id or 0

    def step(self, groups: list[list[tuple[Trajectory, float]]]) -> None:
        trajs = [t for g in groups for t, _ in g]
        rewards = np.array([r for g in groups for _, r in g])
        gids = np.array([i for i, g in enumerate(groups) for _ in g])
        adv = grpo(rewards, gids)
        samples = [s for t, a in zip(trajs, adv, strict=True) if (s := train_sample(t, "policy", advantage=float(a)))]
        batch = collate(samples, self.pad)
        logits = self.model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"]).logits
        out = policy_loss(sequence_logprobs(logits.float(), batch["input_ids"]), batch["behaviour_logprobs"],
                          batch["advantages"], batch["loss_mask"], PolicyLossConfig())
        self.opt.zero_grad()
        out.loss.backward()
        torch.nn.utils.clip_grad_norm_(self.model.parameters(), 1.0)
        self.opt.step()

    def weights(self) -> dict[str, torch.Tensor]:
        return {k: v.detach().clone() for k, v in self.model.state_dict().items()}


def make_tasks(n_prompts: int, seed: int) -> tuple[list[Task], list[tuple[str, str]]]:
    """Training tasks and held-out (prompt, answer) pairs, split as the demo splits them."""
    from astraflow.models.tasks import arithmetic_dataset, split_heldout

    train, heldout = split_heldout(arithmetic_dataset(max(4000, n_prompts * 3), seed=seed + 1, difficulty=2), 0.2)
    sampling = SamplingParams(temperature=1.0, max_tokens=24, max_turns=2)
    tasks = [Task(task_id=f"t{i}", group_id=f"g{i}", prompt_id=p.prompt_id, dataset="arith", workflow="tool_use",
                  prompt=p.prompt, reference=p.reference, policies=["policy"], n_samples=GROUP, sampling=sampling)
             for i, p in enumerate(train[:n_prompts])]
    return tasks, [(p.prompt, reference_answer(p.reference)) for p in heldout[:128]]


async def rollout(task: Task, k: int, backend: TorchBackend, tools: ToolBox, node: NodeInfo, run: Run) -> tuple[Trajectory, float]:
    t0 = time.monotonic()
    traj = await tool_use(RolloutContext(task, k, {"policy": backend}, tools, node))
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
        if step % eval_every == 0 or step == steps:
            run.snapshots.append((step, time.monotonic() - t0, w))
    run.wall_s = time.monotonic() - t0


async def dataflow_mode(tasks: list[Task], steps: int, backend: TorchBackend, learner: Learner, tools: ToolBox,
                        eval_every: int, staleness: int, run: Run) -> None:
    node = NodeInfo("dataflow", backend.hardware(), "local", "torch")
    t0 = time.monotonic()
    run.snapshots.append((0, 0.0, learner.weights()))
    pending: dict[int, list[tuple[Trajectory, float]]] = {}
    ready: list[list[tuple[Trajectory, float]]] = []
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
            backend.update_weights(w, version + 1)
            run.train_s += time.monotonic() - ts
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
        while slots_busy < SLOTS and next_task < limit:
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


def score(run: Run, learner: Learner, heldout: list[tuple[str, str]]) -> None:
    """Held-out success of each snapshot, with the demo evaluator's logic (sampled, 2 episodes)."""
    from astraflow.demo.evaluator import evaluate

    model = learner.model
    model.eval()
    with torch.no_grad():
        for step, t, w in run.snapshots:
            model.load_state_dict(w)
            torch.manual_seed(1000 + step)
            run.success.append((step, t, evaluate(model, learner.tokenizer, heldout, temperature=1.0, repeats=2)))
    run.snapshots.clear()


def one_run(mode: str, sigma: float, args: argparse.Namespace, model_dir: str, tasks: list[Task],
            heldout: list[tuple[str, str]]) -> Run:
    torch.manual_seed(args.seed)
    backend = TorchBackend("policy", model_dir, seed=args.seed, max_batch=SLOTS, threads=1, device="cpu")
    learner = Learner(model_dir)
    tools = ToolBox({"calc": slow_tool(calculator, args.median_s, sigma, seed=args.seed)}, timeout_s=120.0)
    run = Run(mode, sigma)
    if mode == "sync":
        asyncio.run(sync_mode(tasks, args.steps, backend, learner, tools, args.eval_every, run))
    else:
        asyncio.run(dataflow_mode(tasks, args.steps, backend, learner, tools, args.eval_every, args.staleness, run))
    backend.close()
    score(run, learner, heldout)
    return run


def reach(run: Run, target: float) -> float | None:
    return next((t for _, t, s in run.success if s >= target), None)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="sigma 1.0 only, 6 steps")
    ap.add_argument("--json", default=None, help="default bench/results/async_vs_sync.json")
    ap.add_argument("--sigmas", default=None, help="log-normal sigmas of the tool delay (default 0.5,1.0,1.5)")
    ap.add_argument("--median-s", type=float, default=0.2, help="median tool delay (s)")
    ap.add_argument("--steps", type=int, default=None, help="optimizer steps of 64 samples (default 16, quick 6)")
    ap.add_argument("--eval-every", type=int, default=None, help="steps between snapshots (default 4, quick 3)")
    ap.add_argument("--staleness", type=int, default=1, help="dataflow: versions a group may start ahead")
    ap.add_argument("--target-gain", type=float, default=0.05, help="target = warm-start success + this")
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args()
    args.steps = args.steps or (6 if args.quick else 16)
    args.eval_every = args.eval_every or (3 if args.quick else 4)
    sigmas = [float(s) for s in (args.sigmas or ("1.0" if args.quick else "0.5,1.0,1.5")).split(",")]
    torch.set_num_threads(1)
    from rich.console import Console

    from astraflow.demo.run import DemoSettings, warm_model

    model_dir = str(warm_model(DemoSettings(), Console()))
    tasks, heldout = make_tasks(args.steps * PROMPTS_PER_STEP, args.seed)
    rows: list[dict[str, Any]] = []
    for sigma in sigmas:
        runs = {}
        for mode in ("sync", "dataflow"):
            print(f"sigma {sigma}: {mode} ({args.steps} steps x {SLOTS} samples) ...", flush=True)
            runs[mode] = r = one_run(mode, sigma, args, model_dir, tasks, heldout)
            print(f"  {r.wall_s:.1f}s, {args.steps * SLOTS / r.wall_s:.1f} trained traj/s ({r.trajectories} rolled out), success "
                  + " ".join(f"{s:.3f}@{t:.0f}s" for _, t, s in r.success), flush=True)
        target = runs["sync"].success[0][2] + args.target_gain
        for mode, r in runs.items():
            rows.append({
                "sigma": sigma, "mode": mode, "wall_s": r.wall_s, "trajectories": r.trajectories,
                "traj_per_s": args.steps * SLOTS / r.wall_s, "trainer_busy": r.train_s / r.wall_s,
                "rollout_slot_util": r.rollout_s / (SLOTS * r.wall_s), "success": r.success,
                "final_success": r.success[-1][2], "train_reward": r.train_reward, "target": target,
                "time_to_target_s": reach(r, target),
            })
    print()
    hdr = f"{'sigma':>5} {'mode':<9} {'wall s':>7} {'traj/s':>7} {'trainer busy':>12} {'slot util':>9} " \
          f"{'success start->final':>20} {'to target':>10}"
    print(hdr)
    for x in rows:
        tt = f"{x['time_to_target_s']:.0f}s" if x["time_to_target_s"] is not None else "not reached"
        print(f"{x['sigma']:>5} {x['mode']:<9} {x['wall_s']:>7.1f} {x['traj_per_s']:>7.1f} {x['trainer_busy']:>12.0%} "
              f"{x['rollout_slot_util']:>9.0%} {x['success'][0][2]:>9.3f}->{x['final_success']:.3f} {tt:>10}")
    ratios = []
    for sigma in sigmas:
        s, d = (next(x for x in rows if x["sigma"] == sigma and x["mode"] == m) for m in ("sync", "dataflow"))
        ratios.append((sigma, d["traj_per_s"] / s["traj_per_s"], s["time_to_target_s"], d["time_to_target_s"]))
    tts = "; ".join(f"sigma {sg}: " + (f"{a / b:.2f}x" if a and b else "target not reached by both")
                    for sg, _, a, b in ratios)
    print(f"time to target, sync / dataflow: {tts}")
    print("dataflow vs sync, trajectories/s: " + ", ".join(f"sigma {sg}: {r:.2f}x" for sg, r, _, _ in ratios))
    _common.write_json(args.json, "async_vs_sync", {
        "workload": "b: tool_use, calculator behind log-normal delay", "median_s": args.median_s, "steps": args.steps,
        "samples_per_step": SLOTS, "lr": LR, "staleness": args.staleness, "rows": rows,
        "throughput_ratio": {str(sg): r for sg, r, _, _ in ratios},
    })


if __name__ == "__main__":
    main()
