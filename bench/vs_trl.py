"""AstraFlow against TRL's GRPOTrainer on the same tiny model and tasks (issue 9, peer benchmark).

Both sides train the demo's warm-started tiny model (`_rl.warm_model_dir()`, 383k parameters,
locally trained tokenizer) from the same weights, on the same training prompts in the same order
(8 prompts a step, `_rl.make_tasks`), with the same reward (`_rl.reward_of`, the reward app's
exact match), group size 8, 64 completions per optimizer step, lr 3e-4, temperature 1, no KL
(beta 0, no reference model), one optimizer step per generation batch, token-mean PPO-clip loss
(eps 0.2), std-scaled group advantages, grad-norm clip 1.0, AdamW with weight decay 0.01:

* **a**, single turn (`rlvr`, up to 32 tokens, no tool): compute-bound.
* **b**, agentic (`tool_use`: up to 2 turns of 24 tokens, the calculator behind
  `astraflow.raas.tools.slow_tool`, log-normal delay, median 0.2 s, `--sigmas`).

TRL side: `trl.GRPOTrainer` (TRL 1.16, the `bench` extra) on CPU, no vLLM, fp32, the dataset
unshuffled (`shuffle_dataset=False`: its `RepeatSampler` then yields prompts in dataset order,
each 8 times in a row), `per_device_train_batch_size=64`, no gradient accumulation (so
`generation_batch_size=64`, one generation per optimizer step), constant lr, no logging, no
checkpoints. For (a) TRL generates with its own path (`transformers` `generate`, left-padded
batch of 64, KV cache). For (b) TRL cannot run our protocol with its `tools=` argument: that
needs a chat template with JSON tool-call parsing, and our tiny model speaks plain text
(`<calc>EXPR</calc>`, see `astraflow.models.protocol`). So (b) uses TRL's own hook for custom
multi-turn rollouts, `rollout_func` (experimental in TRL, supported without vLLM):
`ToolRollout` runs the `tool_use` workflow's protocol on the trainer's current model -- turn 1
for all 64 samples as one batched `generate`, then ALL the batch's calculator calls at once
(`asyncio.gather`, each behind the same `slow_tool` delay: the best a trainer-centred loop can do),
the tool replies appended, turn 2 for the samples that called, as one batch -- and returns
`env_mask` (1 on model tokens, 0 on tool replies), which TRL multiplies into its loss mask, so
tool text is not trained, as in AstraFlow. No sampling logprobs are returned (TRL's own non-vLLM
path returns none either; with one step per generation batch it takes the old policy to be the
current one, exactly on-policy).

AstraFlow sides (`--sides`): `astraflow` = `_rl.one_run("dataflow", ...)`, AstraFlow's
scheduling in one process (64 rollout slots on a `TorchBackend`, groups trained as they
complete, the trainer in its own thread, at most `--staleness` versions ahead), minus Kafka and
serde; `pipeline` = `_pipeline.run_pipeline(..., "dataflow", ...)`, the real multi-process
pipeline on the local Kafka (curator, RaaS node, reward, curate, Lightning trainer as separate
processes; its curate drops zero-variance groups, so it rolls out more than it trains).

Threads (2-core machine): AstraFlow uses 1 torch thread per role, the backend's decode thread and
the trainer thread, so up to 2 cores while they overlap. TRL runs generation and training one after
the other in one thread; it gets `--trl-threads` torch threads (default 2: the same 2 cores,
as intra-op parallelism). Held-out success of weight snapshots (every `--eval-every` steps) is
scored after training with `_rl.score_snapshots`, so evaluation costs neither side time.

Not the same on both sides (only the last sentence is about speed): TRL scales
advantages by the unbiased group std + 1e-4, AstraFlow by the population std + 1e-6 (TRL's
advantages are ~6% smaller for groups of 8); AstraFlow issues prompts at most `--staleness`
batches ahead of its trainer and trains off policy (PPO ratio to the behaviour logprobs; the
pipeline's samples were 2.4-2.6 versions behind its trainer on average in 64-step runs, its JSON's
`staleness_mean`), TRL exactly on policy; AstraFlow trains the first 8
groups to complete (quick groups first), TRL the next 8 in order. TRL's generation stops on the
`</calc>` token id, AstraFlow's backend on the decoded string: the same here, the tag is one
token. TRL does its Trainer bookkeeping each step (metrics, callbacks), and with 2 torch threads
it was faster than with 1 (156 vs 139 samples/s on (a), 8 steps), so 2 is its default.

Figures per workload: wall time, trained samples/s, train reward per step, held-out success
start -> final, time to the target success (warm start + `--target-gain`), TRL/AstraFlow ratios.

`--repeats N` runs every workload's sides N times in turn (TRL, then the others, then TRL again...),
the same work each time, and prints every repeat's samples/s ratio with their mean and median:
the machine's speed drifts between runs (TRL alone measured 121-241 samples/s on the same code).

Usage: python bench/vs_trl.py [--quick] [--json OUT] [--sigmas 1.0] [--steps N] [--workloads a,b] [--repeats N]
"""

from __future__ import annotations

import argparse
import asyncio
import os
import statistics
import tempfile
import time
from collections.abc import Callable
from typing import Any

import _common
import _rl
import torch
from _stats import censored_ratio, mean_ci, ratio_text

from astraflow.raas.tools import ToolBox, calculator, slow_tool
from astraflow.records import Task

TERMS = {  # what the figures compare (written into the results JSON)
    "ours": "astraflow (AstraFlow's schedule in one process) and pipeline (the real roles on Kafka)",
    "against": "TRL GRPOTrainer (TRL 1.16, CPU, fp32), same model and data",
    "settings": "the demo's tiny model, same prompts and reward, group 8, 64 completions per step, lr 3e-4, no KL, "
                "token-mean PPO-clip; TRL 2 torch threads, AstraFlow 1 per role; AstraFlow trains up to --staleness "
                "versions off policy, TRL exactly on policy",
}


class ToolRollout:
    """TRL `rollout_func`: the `tool_use` protocol for one generation batch (see the docstring)."""

    def __init__(self, tools: ToolBox, max_tokens: int, max_turns: int, temperature: float) -> None:
        self.tools = tools
        self.max_tokens = max_tokens  # per turn, as `SamplingParams.max_tokens` in the workflow
        self.max_turns = max_turns
        self.temperature = temperature
        self.rollout_s = 0.0  # time inside rollouts (generation and tools)

    def __call__(self, prompts: list[str], trainer: Any) -> dict[str, Any]:
        from astraflow.models.evaluate import generate_batch  # the evaluator's left-padded batched generate
        from astraflow.models.protocol import CALC_CLOSE

        t0 = time.monotonic()
        model, tok = trainer.model, trainer.processing_class
        stop_ids = [tok.eos_token_id, tok.convert_tokens_to_ids(CALC_CLOSE)]
        training = model.training
        model.eval()
        try:
            out = self.run(prompts, tok, lambda rows: generate_batch(model, rows, stop_ids, tok.pad_token_id,
                                                                self.max_tokens, self.temperature))
        finally:
            model.train(training)
        self.rollout_s += time.monotonic() - t0
        return out

    def run(self, prompts: list[str], tok: Any, generate: Callable[[list[list[int]]], list[list[int]]]) -> dict[str, Any]:
        """The protocol on one batch; `generate` continues each row by one turn (a batch in, a batch out)."""
        from astraflow.raas.workflows.builtin import TOOL_CALL  # the workflow's own call pattern

        prompt_ids = [tok.encode(p, add_special_tokens=True) for p in prompts]  # <bos> first, as add_bos
        completion: list[list[int]] = [[] for _ in prompts]
        env_mask: list[list[int]] = [[] for _ in prompts]
        active = list(range(len(prompts)))
        for turn in range(self.max_turns):
            if not active:
                break
            new = generate([prompt_ids[i] + completion[i] for i in active])
            calls = []
            for i, ids in zip(active, new, strict=True):
                completion[i] += ids
                env_mask[i] += [1] * len(ids)
                # The pattern needs the turn to END with the closing tag, i.e. generation stopped on it.
                call = TOOL_CALL.search(tok.decode(ids, skip_special_tokens=True))
                if call is not None:
                    calls.append((i, call.group(1), call.group(2).strip()))
            records = asyncio.run(self._call_all(calls, turn))  # every call of the batch at once
            for (i, _, _), record in zip(calls, records, strict=True):
                reply = f"<result>{record.result if record.error is None else 'error: ' + record.error}</result>"
                ids = tok.encode(reply, add_special_tokens=False)
                completion[i] += ids
                env_mask[i] += [0] * len(ids)
            active = [i for i, _, _ in calls]
        return {"prompt_ids": prompt_ids, "completion_ids": completion, "logprobs": None, "env_mask": env_mask}

    async def _call_all(self, calls: list[tuple[int, str, str]], turn: int) -> list:
        return await asyncio.gather(*(self.tools.call(name, args, turn) for _, name, args in calls))


def grpo_config(workload: str, steps: int, seed: int, out_dir: str) -> Any:
    """The GRPOConfig that matches AstraFlow's trainer settings (see the module docstring)."""
    from trl import GRPOConfig

    return GRPOConfig(
        output_dir=out_dir, use_cpu=True, bf16=False, fp16=False, use_vllm=False, seed=seed, data_seed=seed,
        max_steps=steps, per_device_train_batch_size=_rl.SLOTS, gradient_accumulation_steps=1,
        num_generations=_rl.GROUP, num_iterations=1, shuffle_dataset=False,
        learning_rate=_rl.LR, lr_scheduler_type="constant", warmup_steps=0, optim="adamw_torch",
        weight_decay=0.01, max_grad_norm=1.0,  # torch AdamW's default decay, AstraFlow's Learner clip
        beta=0.0, epsilon=0.2, loss_type="dapo", scale_rewards="group", mask_truncated_completions=False,
        temperature=1.0, top_p=1.0, top_k=0, max_completion_length=_rl.WORKLOADS[workload]["max_tokens"],
        report_to="none", logging_strategy="no", save_strategy="no", disable_tqdm=True,
        log_completions=False, remove_unused_columns=False, dataloader_num_workers=0,
    )


def trl_run(workload: str, sigma: float, *, steps: int, eval_every: int, seed: int, median_s: float,
            model_dir: str, tasks: list[Task], heldout: list[tuple[str, str]], threads: int) -> _rl.Run:
    """One TRL GRPOTrainer run on `steps` x 64 samples, snapshots scored after training."""
    os.environ.setdefault("TRL_EXPERIMENTAL_SILENCE", "1")  # rollout_func's experimental-API notice
    from datasets import Dataset
    from transformers import PrinterCallback, TrainerCallback
    from trl import GRPOTrainer

    from astraflow.models.tiny import load_tiny

    torch.set_num_threads(threads)
    torch.manual_seed(seed)
    run = _rl.Run("trl", workload, sigma)
    used = tasks[: steps * _rl.PROMPTS_PER_STEP]
    data = Dataset.from_dict({"prompt": [t.prompt for t in used], "reference": [t.reference for t in used]})

    def exact_match(completions: list[str], reference: list[str], **_: Any) -> list[float]:
        rewards = [_rl.reward_of(workload, c, r) for c, r in zip(completions, reference, strict=True)]
        run.train_reward.append(sum(rewards) / len(rewards))  # one call per generation batch = per step
        return rewards

    class Clock(TrainerCallback):
        """Snapshots the weights with the wall time since training began."""

        def on_train_begin(self, args, state, control, model=None, **kw):
            self.t0 = time.monotonic()
            run.snapshots.append((0, 0.0, _clone(model)))

        def on_step_end(self, args, state, control, model=None, **kw):
            step = state.global_step
            if step % eval_every == 0 or step == steps:
                run.snapshots.append((step, time.monotonic() - self.t0, _clone(model)))

        def on_train_end(self, args, state, control, **kw):
            run.wall_s = time.monotonic() - self.t0

    rollout = None
    if workload == "b":
        w = _rl.WORKLOADS[workload]
        tools = ToolBox({"calc": slow_tool(calculator, median_s, sigma, seed=seed)}, timeout_s=_rl.TOOL_TIMEOUT_S)
        rollout = ToolRollout(tools, w["max_tokens"], w["max_turns"], temperature=1.0)
    model, tokenizer = load_tiny(model_dir)
    with tempfile.TemporaryDirectory(prefix="vs_trl-") as out_dir:
        trainer = GRPOTrainer(model=model, reward_funcs=exact_match, args=grpo_config(workload, steps, seed, out_dir),
                              train_dataset=data, processing_class=tokenizer, callbacks=[Clock()],
                              rollout_func=rollout)
        trainer.remove_callback(PrinterCallback)  # its end-of-training metrics dump; we print our own
        import _pipeline

        own0, busy0 = os.times(), _pipeline.machine_busy_s()
        trainer.train()
        own1 = os.times()
        run.notes["cpu_s.trl"] = round(own1.user + own1.system - own0.user - own0.system, 2)  # this process
        run.notes["cpu_s.machine"] = round(_pipeline.machine_busy_s() - busy0, 2)
    run.trained = steps * _rl.SLOTS
    run.trajectories = run.trained
    if rollout is not None:
        run.notes["rollout_s"] = rollout.rollout_s
    scorer, _ = load_tiny(model_dir)
    _rl.score_snapshots(run, scorer, tokenizer, heldout)
    return run


def steady_per_s(run: _rl.Run) -> float | None:
    """Trained samples/s between the first snapshot after the start (step `eval_every`) and the last
    one: the run without its fill (the pipeline's first rollouts, TRL's first generation), timed the
    same way on every side (snapshot times since the run's start). None with fewer than two."""
    marks = [(step, t) for step, t, _ in run.success if step > 0]
    if len(marks) < 2 or marks[-1][1] <= marks[0][1]:
        return None
    return (marks[-1][0] - marks[0][0]) * _rl.SLOTS / (marks[-1][1] - marks[0][1])


def repeat_summary(ratios: dict[str, dict[str, Any]]) -> dict[str, dict[str, Any]]:
    """Per workload and side (the ratios' names without their ' #<repeat>'): the samples/s ratio
    AstraFlow/TRL of every repeat, in order, with their mean (and its 95% interval, `ci95`) and median."""
    every: dict[str, list[float]] = {}
    for name, r in ratios.items():
        case, side = name.rsplit(" ", 1)
        every.setdefault(f"{case.split(' #')[0]} {side}", []).append(r["samples_per_s_astraflow_over_trl"])
    return {name: {"every": xs, "mean": statistics.fmean(xs), "ci95": mean_ci(xs).as_json()["ci95"],
                   "median": statistics.median(xs)} for name, xs in every.items()}


def _clone(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="4 steps, snapshots every 2")
    ap.add_argument("--json", default=None, help="default bench/results/[quick/]vs_trl.json")
    ap.add_argument("--workloads", default="a,b", help="a (single turn), b (agentic), or both")
    ap.add_argument("--sigmas", default="1.0", help="workload b: log-normal sigmas of the tool delay")
    ap.add_argument("--median-s", type=float, default=0.2, help="workload b: median tool delay (s)")
    ap.add_argument("--steps", type=int, default=None, help="optimizer steps of 64 samples (default 16, quick 4)")
    ap.add_argument("--eval-every", type=int, default=None, help="steps between snapshots (default 2)")
    ap.add_argument("--staleness", type=int, default=1, help="AstraFlow: versions a group may start ahead")
    ap.add_argument("--target-gain", type=float, default=0.05, help="target = warm-start success + this")
    ap.add_argument("--trl-threads", type=int, default=2, help="torch threads of the TRL run (AstraFlow: 1 per role)")
    ap.add_argument("--trainer-threads", default="1",
                    help="pipeline: torch threads of its trainer (other roles 1); several (1,2): one pipeline run each")
    ap.add_argument("--sides", default="trl,astraflow,pipeline",
                    help="trl, astraflow (in-process scheduling) and/or pipeline (the real Kafka pipeline)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--repeats", type=int, default=1,
                    help="run each workload's sides (TRL first, then the others, in turn) this many times: every "
                         "repeat's ratios, then their mean and median (the machine's speed drifts between runs)")
    args = ap.parse_args()
    if args.repeats < 1:
        ap.error("--repeats must be >= 1")
    args.steps = args.steps or (4 if args.quick else 16)
    args.eval_every = args.eval_every or 2
    os.environ.setdefault("HF_HUB_OFFLINE", "1")  # nothing here may reach a hub
    try:
        import trl
    except ImportError:
        raise SystemExit("TRL is not installed: use the venv of `bash scripts/env.sh` (it installs the `bench` extra)") from None

    model_dir = _rl.warm_model_dir()
    cases = [(w, s) for w in args.workloads.split(",") for s in ([0.0] if w == "a" else
                                                                   [float(x) for x in args.sigmas.split(",")])]
    rows: list[dict[str, Any]] = []
    for (workload, sigma), repeat in ((c, r) for c in cases for r in range(1, args.repeats + 1)):
        tasks, heldout = _rl.make_tasks(args.steps * _rl.PROMPTS_PER_STEP, args.seed, workload)
        label = f"{workload}" + (f" (sigma {sigma})" if workload == "b" else "") + (f" #{repeat}" if args.repeats > 1 else "")
        runs: dict[str, _rl.Run] = {}
        trainer_threads = [int(x) for x in str(args.trainer_threads).split(",")]
        sides = [x for x in args.sides.split(",") if x != "trl"]
        if len(trainer_threads) > 1 and "pipeline" in sides:
            at = sides.index("pipeline")
            sides[at:at + 1] = [f"pipeline-t{n}" for n in trainer_threads]
        for side in ["trl", *sides]:
            print(f"{label}: {side} ({args.steps} steps x {_rl.SLOTS} samples) ...", flush=True)
            common = dict(steps=args.steps, eval_every=args.eval_every, seed=args.seed, median_s=args.median_s,
                          model_dir=model_dir, tasks=tasks, heldout=heldout)
            if side == "trl":
                r = trl_run(workload, sigma, threads=args.trl_threads, **common)
            elif side == "astraflow":
                torch.set_num_threads(1)
                r = _rl.one_run("dataflow", workload, sigma, staleness=args.staleness, **common)
            elif side == "pipeline" or side.startswith("pipeline-t"):
                import _pipeline

                torch.set_num_threads(1)
                threads = int(side.removeprefix("pipeline-t")) if side != "pipeline" else trainer_threads[0]
                r = _pipeline.run_pipeline("dataflow", workload, sigma, staleness=args.staleness,
                                           trainer_threads=threads, **common)
            else:
                ap.error(f"unknown side {side!r}: choose from trl, astraflow, pipeline")
            runs[side] = r
            if side == "trl":
                print(f"  CPU s: TRL's process {r.notes['cpu_s.trl']:.1f}, machine {r.notes['cpu_s.machine']:.1f}")
            print(f"  {r.wall_s:.1f}s, {r.trained / r.wall_s:.1f} samples/s, success "
                  + " ".join(f"{s:.3f}@{t:.0f}s" for _, t, s in r.success), flush=True)
        target = runs["trl"].success[0][2] + args.target_gain
        for side, r in runs.items():
            rows.append({"side": side, "case": label, "repeat": repeat, **r.summary(target),
                         "steady_per_s": steady_per_s(r)})

    print()
    print(f"{'workload':<16} {'side':<12} {'wall s':>7} {'samples/s':>9} {'steady':>7} {'reward 1st->last':>16} "
          f"{'success start->final':>20} {'to target':>10}")
    for x in rows:
        tt = f"{x['time_to_target_s']:.0f}s" if x["time_to_target_s"] is not None else "not reached"
        rw = x["train_reward"]
        steady = f"{x['steady_per_s']:.1f}" if x["steady_per_s"] is not None else "-"
        print(f"{x['case']:<16} {x['side']:<12} {x['wall_s']:>7.1f} {x['trained_per_s']:>9.1f} {steady:>7} "
              f"{rw[0]:>9.3f}->{rw[-1]:.3f} {x['start_success']:>13.3f}->{x['final_success']:.3f} {tt:>10}")
    ratios = {}
    for case in dict.fromkeys(x["case"] for x in rows):
        t = next(x for x in rows if x["case"] == case and x["side"] == "trl")
        for a in (x for x in rows if x["case"] == case and x["side"] != "trl"):
            # a side that missed the target counts at its wall time: the ratio is then a bound (`_stats`)
            tt, bound = censored_ratio(t["time_to_target_s"], t["wall_s"], a["time_to_target_s"], a["wall_s"])
            steady = (a["steady_per_s"] / t["steady_per_s"]) if a["steady_per_s"] and t["steady_per_s"] else None
            ratios[f"{case} {a['side']}"] = {"wall_trl_over_astraflow": t["wall_s"] / a["wall_s"],
                                             "samples_per_s_astraflow_over_trl": a["trained_per_s"] / t["trained_per_s"],
                                             "steady_per_s_astraflow_over_trl": steady,
                                             "time_to_target_trl_over_astraflow": tt,
                                             "time_to_target_bound": bound}
    print("time to target, TRL / AstraFlow: " + "; ".join(
        f"{c}: {ratio_text(r['time_to_target_trl_over_astraflow'], r['time_to_target_bound'])}" for c, r in ratios.items()))
    _common.write_json(args.json, "vs_trl", {
        "trl_version": trl.__version__, "steps": args.steps, "repeats": args.repeats,
        "repeat_summary": repeat_summary(ratios), "samples_per_step": _rl.SLOTS, "lr": _rl.LR,
        "group": _rl.GROUP, "median_s": args.median_s, "staleness": args.staleness,
        "threads": {"astraflow": "1 per role (decode, trainer)", "pipeline_trainer": trainer_threads,
                    "trl": args.trl_threads},
        "rows": rows, "ratios": ratios,
    }, terms=TERMS, quick=args.quick)
    print("AstraFlow vs TRL, samples/s: " + ", ".join(
        f"{c} {r['samples_per_s_astraflow_over_trl']:.2f}x" for c, r in ratios.items()))
    print("AstraFlow vs TRL, steady samples/s (after the first snapshot): " + ", ".join(
        f"{c} {r['steady_per_s_astraflow_over_trl']:.2f}x" for c, r in ratios.items()
        if r["steady_per_s_astraflow_over_trl"] is not None))
    if args.repeats > 1:
        for name, summary in repeat_summary(ratios).items():
            print(f"over {args.repeats} repeats, {name}: samples/s ratio mean {mean_ci(summary['every']).text()}, median "
                  f"{summary['median']:.2f}x, every repeat " + " ".join(f"{x:.2f}x" for x in summary["every"]))


if __name__ == "__main__":
    main()
