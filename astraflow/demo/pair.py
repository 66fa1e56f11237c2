"""`astraflow demo --scenario solver-verifier`: two policies learn together on CPU.

The solver answers arithmetic questions with the calculator; the verifier reads the question
and the solver's answer and says whether it is right (it may use the calculator too, as
``<calc>EXPR-(PROPOSED)</calc>``: 0 means yes). Both are tiny models warm-started locally (the
solver as in the arithmetic demo; the verifier from the solver's weights, then SFT on
judgements of which half use the calculator), both cached between runs.

One process per role, as in production: a curator issuing `solver_verifier` tasks, RaaS nodes
serving and following both policies, the reward (`solver_verifier`: each policy its own reward,
see `astraflow.dataflow.judge_rewards`), curate (each policy's samples to its own train
topic), **one trainer per policy**, each publishing its own weights topic and never waiting
for the other, and one held-out evaluator per policy. The solver is scored on held-out
problems; the verifier on a fixed, balanced held-out set (half right proposals, half wrong:
always saying yes scores 50%). Both curves go to `learning.png` and `summary.json`.
"""

from __future__ import annotations

import hashlib
import json
import shutil
import time
from dataclasses import asdict, dataclass
from pathlib import Path

from rich.console import Console

from astraflow.config import AstraflowConfig
from astraflow.demo.common import (
    PY,
    cached_model,
    curate_role,
    node_role,
    pct,
    print_failure,
    role_env,
    start_run,
    supervise,
    trainer_role,
)
from astraflow.demo.pair_report import PairMonitor, write_pair_report
from astraflow.demo.run import DemoSettings, warm_model
from astraflow.demo.supervisor import Role, Supervisor

POLICIES = ("solver", "verifier")


@dataclass(frozen=True)
class PairSettings:
    """Knobs of one solver-verifier run."""

    minutes: float = 9.0  # wall-time budget of the learning phase
    versions: int | None = None  # stop early once every policy has published this many versions and been evaluated
    difficulty: int = 1  # arithmetic difficulty (astraflow.models.tasks.DIFFICULTIES)
    n_train: int = 4000  # training prompts
    n_heldout: int = 128  # held-out problems for the solver, and as many judgements for the verifier
    n_samples: int = 8  # samples per prompt (GRPO group size; each sample is one solver + one verifier rollout)
    sft_steps: int = 900  # solver warm-start steps (the arithmetic demo's)
    verifier_sft_steps: int = 600  # verifier steps on top of the solver's weights
    tool_fraction: float = 0.5  # share of warm-start demonstrations (both policies) that use the calculator
    lr: float = 3e-4  # RL learning rate of both trainers
    batch_size: int = 32  # samples per trainer batch
    max_ahead: int = 12  # tasks the curator keeps ahead of the slower trainer
    nodes: int = 1  # RaaS nodes (each serves both policies)
    max_inflight: int = 32  # rollouts per node
    bonus: float = 0.2  # solver bonus for a correct answer the verifier accepts
    eval_interval_s: float = 40.0  # at most one held-out evaluation per policy per this many seconds
    seed: int = 0


def solver_model(s: PairSettings, console: Console) -> Path:
    return warm_model(DemoSettings(sft_steps=s.sft_steps, difficulty=s.difficulty, tool_fraction=s.tool_fraction,
                                   seed=s.seed), console)


def verifier_model(s: PairSettings, solver: Path, console: Console) -> Path:
    """The solver's warm start, then SFT on judgements; cached in ~/.cache/astraflow/demo-models."""
    from astraflow.models.sft import sft
    from astraflow.models.tasks import arithmetic_dataset, split_heldout
    from astraflow.models.verifier import verifier_examples

    key = hashlib.sha256(json.dumps([solver.name, s.verifier_sft_steps, s.difficulty, s.tool_fraction, s.seed, 1])
                         .encode()).hexdigest()[:10]

    def build(tmp: Path) -> None:
        shutil.copytree(solver, tmp)
        train, _ = split_heldout(arithmetic_dataset(2000, seed=s.seed, difficulty=s.difficulty), 0.2)
        console.print(f"Warm-starting the verifier from the solver with {s.verifier_sft_steps} SFT steps on judgements "
                      f"({s.tool_fraction:.0%} check with the calculator)...")
        m = sft(tmp, verifier_examples(train, s.tool_fraction, s.seed), steps=s.verifier_sft_steps, seed=s.seed)
        console.print(f"  SFT loss {m.first_loss:.2f} -> {m.final_loss:.2f} in {m.seconds:.0f}s")

    return cached_model(f"verifier-{key}", console, build)


def write_datasets(s: PairSettings, data_dir: Path) -> dict[str, Path]:
    """train.jsonl (problems), heldout-solver.jsonl, heldout-verifier.jsonl (balanced judgements)."""
    from astraflow.models.tasks import arithmetic_dataset, split_heldout
    from astraflow.models.verifier import heldout_items

    problems = arithmetic_dataset(s.n_train * 2, seed=s.seed + 1, difficulty=s.difficulty)
    train, heldout = split_heldout(problems, 0.2)
    heldout = heldout[: s.n_heldout]
    data_dir.mkdir(parents=True, exist_ok=True)
    rows = {
        "train": [(r.prompt_id, r.prompt, r.answer) for r in train[: s.n_train]],
        "heldout-solver": [(r.prompt_id, r.prompt, r.answer) for r in heldout],
        "heldout-verifier": [(f"{r.prompt_id}-judge", prompt, verdict)
                             for r, (prompt, verdict) in zip(heldout, heldout_items(heldout), strict=True)],
    }
    out = {}
    for name, items in rows.items():
        path = out[name] = data_dir / f"{name}.jsonl"
        path.write_text("".join(json.dumps({"id": i, "prompt": p, "reference": json.dumps({"answer": a}), "dataset": "arith"}) + "\n"
                                for i, p, a in items))
    return out


def roles(cfg: AstraflowConfig, s: PairSettings, exp: str, models: dict[str, Path], data: dict[str, Path],
          run_dir: Path) -> list[Role]:
    env = role_env(cfg.kafka.bootstrap_servers)
    out = [
        Role("curator", [*PY, "app", "run", "curator", "-e", exp, "--policy", "solver", "--policy", "verifier",
                         "--dataset", str(data["train"]), "--workflow", "solver_verifier", "--n-samples", str(s.n_samples),
                         "--max-ahead", str(s.max_ahead), "--temperature", "1.0", "--max-tokens", "24",
                         "--max-turns", "2"], env),
        Role("reward", [*PY, "app", "run", "reward", "-e", exp, "--default",
                        f"reward=solver_verifier:{json.dumps({'bonus': s.bonus})}"], env),
        curate_role(exp, POLICIES, env),
    ]
    for policy in POLICIES:
        out.append(trainer_role(f"trainer-{policy}", exp, policy, models[policy], run_dir / policy, s.lr, s.batch_size,
                                env))
        out.append(Role(f"eval-{policy}", [*PY, "eval", "-e", exp, "-p", policy, "-m", str(models[policy]),
                                           "--heldout", str(data[f"heldout-{policy}"]), "--interval", str(s.eval_interval_s)],
                        env))
    served = {p: models[p] for p in POLICIES}
    out += [node_role(f"raas-{i + 1}", exp, served, s.max_inflight, s.seed + i, env) for i in range(s.nodes)]
    return out


def run_pair(cfg: AstraflowConfig, s: PairSettings, run_dir: Path, console: Console, experiment: str | None = None) -> int:
    """Runs the scenario; returns the process exit code."""
    t_setup = time.monotonic()
    exp = experiment or f"demo-sv-{time.strftime('%Y%m%d-%H%M%S')}"
    n_topics = start_run(cfg, run_dir, exp, POLICIES, {"scenario": "solver-verifier", **asdict(s)})
    solver = solver_model(s, console)
    models = {"solver": solver, "verifier": verifier_model(s, solver, console)}
    data = write_datasets(s, run_dir / "data")
    console.print(f"Experiment [bold]{exp}[/] (solver + verifier): {n_topics} topics; logs in {run_dir / 'logs'}")
    sup = Supervisor(run_dir / "logs", die_with_parent=True)
    monitor = PairMonitor(cfg.kafka, exp, "solver")
    setup_s = time.monotonic() - t_setup

    def step() -> str | None:
        console.print(monitor.line())
        if s.versions is not None and monitor.reached(POLICIES, s.versions):
            return f"version {s.versions} of every policy"
        return None

    run = supervise(console, sup, monitor, roles(cfg, s, exp, models, data, run_dir), minutes=s.minutes, period_s=10.0,
                    step=step)
    failed, stopped_by, wall = run.failed, run.stopped_by, run.wall_s
    summary = write_pair_report(monitor, run_dir, list(POLICIES), {"scenario": "solver-verifier", "wall_time_s": round(wall, 1),
                                                   "setup_s": round(setup_s, 1),
                                                   "stopped_by": "failure" if failed else stopped_by,
                                                   "failed_role": failed.role.name if failed else None})
    if failed:
        print_failure(console, failed)
        return 1
    for policy in POLICIES:
        p = summary["policies"][policy]
        console.print(f"[bold]{policy}[/] held-out {p['eval_metric']} (sampled): {pct(p['eval_warm_start'])} -> "
                      f"{pct(p['eval_final'])} (best {pct(p['eval_best'])}); greedy {pct(p['eval_greedy_warm_start'])} -> "
                      f"{pct(p['eval_greedy_final'])}; {p['versions_published']} versions, {p['samples_trained']} samples")
    console.print(f"{summary['trajectories']} trajectories in {wall:.0f}s; run directory: {run_dir} "
                  "(summary.json, learning.png, eval.csv, logs/)")
    return 0

