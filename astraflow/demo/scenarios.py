"""`astraflow demo --scenario db|os|code`: a tiny policy learns an AgentBench-style environment.

Steps: a tiny model (its tokenizer trained on the synthetic corpus and the environment's
demonstrations) warm-started by SFT on those demonstrations (the known solutions in the
endpoint's chat format; in db and os only a share of them uses the tool, the others answer at
once, so RL has a decision to learn; cached between runs) -> a generated dataset -> the experiment's topics -> curator, one
RaaS node (the environment's workflow: the OpenAI-API agent against the node's per-rollout
endpoint), reward (the environment's reward), curate and trainer as separate processes -> a
line of figures every few seconds -> `summary.json` (mean reward per policy version) in the run
directory.
"""

from __future__ import annotations

import hashlib
import json
import random
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
    print_failure,
    role_env,
    start_run,
    supervise,
    trainer_role,
)
from astraflow.demo.monitor import Monitor
from astraflow.demo.supervisor import Role, Supervisor

REWARDS = {"db": "sql_result", "os": "os_check", "code": "code_tests"}
MAX_TOKENS, MAX_TURNS = 96, 3  # per model call; model calls per episode


@dataclass(frozen=True)
class ScenarioSettings:
    """Knobs of one scenario run."""

    scenario: str  # db | os | code
    minutes: float = 6.0  # wall-time budget of the learning phase
    versions: int | None = None  # stop early once the trainer has published this many versions
    n_train: int = 2000  # training prompts
    n_samples: int = 8  # samples per prompt (GRPO group size)
    sft_steps: int = 1200  # warm-start steps (db: 164 s in all on a free core, sequences of ~70 tokens)
    sft_batch: int = 32  # warm-start batch
    sft_lr: float = 1e-3  # warm-start peak learning rate
    wrong_fraction: float = 0.0  # share of the warm start's tool-using demonstrations that end with a wrong answer
    tool_fraction: float = 0.3  # share of warm-start demonstrations (db, os) that use the tool; the rest answer at once
    lr: float = 3e-4  # RL learning rate
    batch_size: int = 16  # trainer batch (samples)
    max_inflight: int = 8  # rollouts of the node
    n_heldout: int = 200  # held-out rows evaluated after the learning phase (0: none)
    seed: int = 0


def demonstrations(scenario: str, n: int, wrong_fraction: float, seed: int,
                   tool_fraction: float = 1.0) -> list[tuple[str, str]]:
    """(prompt, completion) pairs in the endpoint's chat format (`astraflow.raas.agent_api.render`).

    db and os: a share `tool_fraction` of them runs the task's known solution through the tool
    and answers from its output (a share `wrong_fraction` of those with a wrong number instead);
    the others answer at once with the right value, which the agent cannot know without the
    tool (it never sees the data): the warm start then calls the tool only sometimes, and RL has
    a decision to learn (as the arithmetic demo's calculator)."""
    from astraflow.envs.database import GuardedDb, parse_spec, schema_text
    from astraflow.envs.datasets import env_dataset
    from astraflow.raas.workflows.envs import CODE_SYSTEM, SYSTEM

    rng = random.Random(seed)
    out = []
    for row in env_dataset(scenario, n, seed=seed + 1000):  # other rows than the training set's
        ref = json.loads(row["reference"])
        wrong = rng.random() < wrong_fraction
        direct = rng.random() >= tool_fraction
        if scenario == "db":
            tables = parse_spec(ref["db"])
            db = GuardedDb(tables)
            result = db.run_text(ref["query"])
            db.close()
            user = f"{row['prompt']}\nTables:\n{schema_text(tables)}"
            right = result.splitlines()[0]
            answer = str(rng.randint(0, 99)) if wrong and not direct else right
            call = "" if direct else f"<sql>{ref['query']}</sql><result>{result}</result>"
            completion = f"{call}Answer: {answer}"
            system = SYSTEM
        elif scenario == "os":
            sol = ref["solution"]
            shown = f"{sol['output']}\n[exit code 0]".strip()
            answer = str(rng.randint(0, 99)) if wrong and not direct else sol["answer"]
            call = "" if direct else f"<bash>{sol['command']}</bash><result>{shown}</result>"
            completion = f"{call}Answer: {answer}"
            user, system = row["prompt"], SYSTEM
        else:
            code = ref["solution"].replace("return", "return -1 +") if wrong else ref["solution"]
            completion = f"```python\n{code}```"
            user, system = row["prompt"], CODE_SYSTEM
        out.append((f"{system}\nQ: {user.strip()}\nA:", completion))
    return out


def warm_model(s: ScenarioSettings, console: Console) -> Path:
    """The warm-started tiny model of the scenario, built once per settings in ~/.cache/astraflow."""
    from astraflow.models.corpus import synthetic_corpus
    from astraflow.models.sft import sft
    from astraflow.models.tiny import init_tiny

    knobs = [s.scenario, s.sft_steps, s.sft_batch, s.sft_lr, s.wrong_fraction, s.tool_fraction, s.seed, 2]
    key = hashlib.sha256(json.dumps(knobs).encode()).hexdigest()[:10]

    def progress(step: int, loss: float) -> None:
        if (step + 1) % 25 == 0:
            console.print(f"  step {step + 1}/{s.sft_steps}  loss {loss:.3f}")

    def build(tmp: Path) -> None:
        demos = demonstrations(s.scenario, 1000, s.wrong_fraction, s.seed, s.tool_fraction)
        console.print("Building a tiny Qwen2 model with a tokenizer trained on the synthetic corpus and the "
                      f"{s.scenario} demonstrations...")
        init_tiny(tmp, seed=s.seed, corpus=synthetic_corpus(seed=s.seed) + [p + c for p, c in demos])
        console.print(f"Warm-starting it with {s.sft_steps} SFT steps on {s.scenario} demonstrations "
                      f"({s.wrong_fraction:.0%} of them end with a wrong answer)...")
        m = sft(tmp, demos, steps=s.sft_steps, lr=s.sft_lr, batch_size=s.sft_batch, seed=s.seed, on_step=progress)
        console.print(f"  SFT loss {m.first_loss:.2f} -> {m.final_loss:.2f} in {m.seconds:.0f}s")

    return cached_model(f"{s.scenario}-{key}", console, build)


def roles(s: ScenarioSettings, bootstrap: str, exp: str, model: Path, train: Path, run_dir: Path) -> list[Role]:
    env = role_env(bootstrap)
    return [
        Role("curator", [*PY, "app", "run", "curator", "-e", exp, "--policy", "policy", "--dataset", str(train),
                         "--n-samples", str(s.n_samples), "--max-ahead", "8", "--temperature", "1.0",
                         "--max-tokens", str(MAX_TOKENS), "--max-turns", str(MAX_TURNS)], env),
        Role("reward", [*PY, "app", "run", "reward", "-e", exp, "--default", f"reward={REWARDS[s.scenario]}"], env),
        curate_role(exp, ["policy"], env),
        trainer_role("trainer", exp, "policy", model, run_dir, s.lr, s.batch_size, env),
        node_role("raas-1", exp, {"policy": model}, s.max_inflight, s.seed, env, name="raas"),
    ]


def run_scenario(cfg: AstraflowConfig, s: ScenarioSettings, run_dir: Path, console: Console, experiment: str | None = None) -> int:
    """Runs the scenario; returns the process exit code."""
    from astraflow.envs.datasets import write_dataset

    exp = experiment or f"demo-{s.scenario}-{time.strftime('%Y%m%d-%H%M%S')}"
    start_run(cfg, run_dir, exp, ["policy"], asdict(s))
    model = warm_model(s, console)
    train = write_dataset(s.scenario, s.n_train, run_dir / "data" / "train.jsonl", seed=s.seed)
    console.print(f"Experiment [bold]{exp}[/] ({s.scenario}, reward {REWARDS[s.scenario]}); logs in {run_dir / 'logs'}")
    sup = Supervisor(run_dir / "logs", die_with_parent=True)
    monitor = Monitor(cfg.kafka, exp, "policy")

    def step() -> str | None:
        snap = monitor.snapshot()
        reward = "n/a" if snap.reward_recent is None else f"{snap.reward_recent:.3f}"
        console.print(f"{snap.elapsed_s:6.0f}s  trajectories {snap.trajectories:5d}  reward(last 64) {reward}  "
                      f"trainer version {snap.trainer_version}  dlq {snap.dlq}")
        if s.versions is not None and snap.newest_version >= s.versions:
            return f"{s.versions} versions published"
        return None

    run = supervise(console, sup, monitor, roles(s, cfg.kafka.bootstrap_servers, exp, model, train, run_dir),
                    minutes=s.minutes, period_s=10.0, step=step)
    failed = run.failed
    by_version = monitor.by_version()
    summary = {"experiment": exp, "scenario": s.scenario, "reward": REWARDS[s.scenario],
               "trajectories": monitor.snapshot().trajectories, "wall_time_s": round(run.wall_s, 1),
               "stopped_by": "failure" if failed else run.stopped_by,
               "mean_reward_by_version": {str(v): round(r, 4) for v, r in sorted(by_version.items())},
               "failed_role": failed.role.name if failed else None}
    if not failed and s.n_heldout:
        from astraflow.demo.env_eval import evaluate_run

        console.print(f"Held-out evaluation on {s.n_heldout} rows (warm start and final weights, sampled and greedy)...")
        summary["heldout"] = evaluate_run(cfg, exp, s.scenario, REWARDS[s.scenario], model, s.n_heldout, s.seed,
                                          MAX_TOKENS, MAX_TURNS, s.n_train)
        console.print(f"held-out reward: {summary['heldout']}")
    (run_dir / "summary.json").write_text(json.dumps(summary, indent=2) + "\n")
    if failed:
        print_failure(console, failed)
        return 1
    console.print(f"mean reward by policy version: {summary['mean_reward_by_version']}")
    console.print(f"Run directory: {run_dir} (summary.json, logs/)")
    return 0
