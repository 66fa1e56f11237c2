"""Dataflow vs trainer-centred RL (issue 9, item 1): workloads (a) and (b), in-process and on Kafka.

Workloads, model, prompts, reward, loss and learning rate: see `bench/_rl.py`. In short, the
demo's warm-started tiny model, arithmetic prompts, 8 samples per prompt, 64 samples per
optimizer step, lr 3e-4, GRPO, PPO-clip loss; (a) single-turn `rlvr` with no tool
(compute-bound), (b) multi-turn `tool_use` whose calculator sits behind a log-normal delay.

Why log-normal for (b): latencies of remote services (web APIs, sandboxes, simulators) are
products of many independent slow-downs, so their logs are roughly normal, with a long right
tail; a 0.2 s median is a fast remote API. Sigma sets the tail: the p99 is 3.2x (0.5), 10x
(1.0) and 33x (1.5) the median, i.e. 0.6 s, 2 s and 6.6 s. With 64 rollouts a batch, the
slowest one of a batch is around the p98.5 of the distribution.

Modes, each on the same tasks in the same order, the same sample budget (`--steps` x 64
trained samples), the same learning rate, one rollout engine with 64 slots and one trainer:

* `sync` / `dataflow`: the two schedules in ONE process (`_rl.one_run`): no Kafka, no serde;
  they isolate the scheduling.
* `pipeline-sync` / `pipeline-dataflow`: the real multi-process pipeline on the local Kafka
  (`_pipeline.run_pipeline`): curator, RaaS node, reward, curate and Lightning trainer as
  separate `astraflow` processes; the two modes differ only in the curator's max-ahead (one
  batch = the trainer-centred barrier, or 1 + `--staleness` batches).

Figures per run: wall time, trained samples/s, rollouts made, held-out success per weight
snapshot (scored after the run, so evaluation costs no run time), time to reach the target
(warm-start success + `--target-gain`), and for the in-process modes the trainer-busy fraction
(optimizer-step time / wall) and rollout-slot utilisation (sum of rollout durations / (64 x
wall)); their complements are the idle fractions. For the pipeline, the trainer's mean
staleness (versions behind per trained sample). torch runs 1 thread per role on this 2-core
machine.

Usage: python bench/async_vs_sync.py [--quick] [--json OUT] [--workloads a,b] [--sigmas 0.5,1.0,1.5]
       [--modes sync,dataflow,pipeline-sync,pipeline-dataflow] [--steps N]
"""

from __future__ import annotations

import argparse
from typing import Any

import _common
import _rl
import torch
from _stats import censored_ratio, ratio_text

TERMS = {  # what the figures compare (written into the results JSON)
    "ours": "dataflow: AstraFlow's schedule in one process, and pipeline-dataflow: the real roles on Kafka",
    "against": "sync: a synchronous loop (roll out a whole batch, train, push weights), in one process and as pipeline-sync",
    "settings": "the demo's tiny model, same prompts in the same order, 16 steps x 64 samples (quick 6), lr 3e-4, "
                "PPO-clip, one 64-slot rollout engine, 1 torch thread per role; curate's filters off in the pipeline",
}


MODES = ("sync", "dataflow", "pipeline-sync", "pipeline-dataflow")


def run_one(mode: str, workload: str, sigma: float, args: argparse.Namespace, model_dir: str) -> _rl.Run:
    tasks, heldout = _rl.make_tasks(args.steps * _rl.PROMPTS_PER_STEP * 4, args.seed, workload)  # room for dropped groups
    kw = {"steps": args.steps, "eval_every": args.eval_every, "staleness": args.staleness, "seed": args.seed,
          "median_s": args.median_s, "model_dir": model_dir, "tasks": tasks, "heldout": heldout}
    if not mode.startswith("pipeline-"):
        return _rl.one_run(mode, workload, sigma, **kw)
    import _pipeline

    return _pipeline.run_pipeline(mode.removeprefix("pipeline-"), workload, sigma, **kw)


def cases(args: argparse.Namespace) -> list[tuple[str, float]]:
    out: list[tuple[str, float]] = []
    for w in args.workloads.split(","):
        out += [("a", 0.0)] if w == "a" else [("b", float(x)) for x in args.sigmas.split(",")]
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="workload b at sigma 1.0 only, 6 steps")
    ap.add_argument("--json", default=None, help="default bench/results/[quick/]async_vs_sync.json")
    ap.add_argument("--workloads", default=None, help="a (single-turn, compute-bound) and/or b (agentic); default a,b")
    ap.add_argument("--sigmas", default=None, help="workload b: log-normal sigmas of the tool delay (default 0.5,1.0,1.5)")
    ap.add_argument("--modes", default=None, help=f"subset of {','.join(MODES)} (default all; quick: in-process)")
    ap.add_argument("--median-s", type=float, default=0.2, help="median tool delay (s)")
    ap.add_argument("--steps", type=int, default=None, help="optimizer steps of 64 samples (default 16, quick 6)")
    ap.add_argument("--eval-every", type=int, default=None, help="steps between snapshots (default 2, quick 3)")
    ap.add_argument("--staleness", type=int, default=1, help="dataflow: batches a group may start ahead of training")
    ap.add_argument("--target-gain", type=float, default=0.05, help="target = warm-start success + this")
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args()
    args.steps = args.steps or (6 if args.quick else 16)
    args.eval_every = args.eval_every or (3 if args.quick else 2)
    args.workloads = args.workloads or ("b" if args.quick else "a,b")
    args.sigmas = args.sigmas or ("1.0" if args.quick else "0.5,1.0,1.5")
    modes = (args.modes or ("sync,dataflow" if args.quick else ",".join(MODES))).split(",")
    if bad := [m for m in modes if m not in MODES]:
        ap.error(f"unknown mode(s) {bad}; choose from {', '.join(MODES)}")
    torch.set_num_threads(1)
    model_dir = _rl.warm_model_dir()
    rows: list[dict[str, Any]] = []
    for workload, sigma in cases(args):
        runs: dict[str, _rl.Run] = {}
        for mode in modes:
            label = f"workload {workload}" + (f", sigma {sigma}" if workload == "b" else "")
            print(f"{label}: {mode} ({args.steps} steps x {_rl.SLOTS} samples) ...", flush=True)
            runs[mode] = r = run_one(mode, workload, sigma, args, model_dir)
            print(f"  {r.wall_s:.1f}s, {r.trained / r.wall_s:.1f} trained samples/s ({r.trajectories} rolled out), "
                  "success " + " ".join(f"{s:.3f}@{t:.0f}s" for _, t, s in r.success), flush=True)
        target = next(iter(runs.values())).success[0][2] + args.target_gain
        rows += [r.summary(target) for r in runs.values()]
    print()
    print(f"{'case':<10} {'mode':<17} {'wall s':>7} {'samples/s':>9} {'rollouts':>8} {'trainer busy':>12} "
          f"{'slot util':>9} {'success start->final':>20} {'to target':>10}")
    for x in rows:
        case = "a" if x["workload"] == "a" else f"b s={x['sigma']}"
        tt = f"{x['time_to_target_s']:.0f}s" if x["time_to_target_s"] is not None else "not reached"
        busy = "-" if x["mode"].startswith("pipeline") else f"{x['trainer_busy']:.0%}"
        util = "-" if x["mode"].startswith("pipeline") else f"{x['rollout_slot_util']:.0%}"
        print(f"{case:<10} {x['mode']:<17} {x['wall_s']:>7.1f} {x['trained_per_s']:>9.1f} {x['trajectories']:>8} "
              f"{busy:>12} {util:>9} {x['start_success']:>9.3f}->{x['final_success']:.3f} {tt:>10}")
    headline = []
    for workload, sigma in cases(args):
        case = [x for x in rows if x["workload"] == workload and x["sigma"] == sigma]
        name = "a" if workload == "a" else f"b sigma {sigma}"
        for prefix in ("", "pipeline-"):
            got = {x["mode"].removeprefix(prefix): x for x in case if x["mode"] in (prefix + "sync", prefix + "dataflow")}
            if len(got) < 2:
                continue
            s, d = got["sync"], got["dataflow"]
            # a side that missed the target counts at its wall time: the ratio is then a bound (`_stats`)
            ratio, bound = censored_ratio(s["time_to_target_s"], s["wall_s"], d["time_to_target_s"], d["wall_s"])
            tt = f", time to target {ratio_text(ratio, bound)}"
            headline.append(f"{name} ({prefix.rstrip('-') or 'in-process'}) samples/s {d['trained_per_s'] / s['trained_per_s']:.2f}x{tt}")
    print("dataflow vs sync: " + "; ".join(headline))
    _common.write_json(args.json, "async_vs_sync", {
        "workloads": {w: _rl.WORKLOADS[w]["label"] for w in args.workloads.split(",")}, "median_s": args.median_s,
        "steps": args.steps, "samples_per_step": _rl.SLOTS, "lr": _rl.LR, "staleness": args.staleness,
        "modes": modes, "rows": rows, "headline": headline,
    }, terms=TERMS, quick=args.quick)


if __name__ == "__main__":
    main()
