"""`astraflow demo --scenario db|os|code`: a tiny policy learns an AgentBench-style environment.

Steps: a tiny model warm-started by SFT on the environment's demonstrations (its known solutions
in the endpoint's chat format, one share of them replaced by a wrong answer so RL has something
to fix; cached between runs) -> a generated dataset -> the experiment's topics -> curator, one
RaaS node (the environment's workflow: the OpenAI-API agent against the node's per-rollout
endpoint), reward (the environment's reward), curate and trainer as separate processes -> a
line of figures every few seconds -> `summary.json` (mean reward per policy version) in the run
directory.
"""

from __future__ import annotations

import hashlib
import json
import os
import random
import shutil
import time
from dataclasses import asdict, dataclass
from pathlib import Path

from rich.console import Console

from astraflow.config import AstraflowConfig, default_home, write_resolved
from astraflow.demo.monitor import Monitor
from astraflow.demo.run import PY, role_env
from astraflow.demo.supervisor import Role, RoleFailed, Supervisor
from astraflow.kafka.topics import TopicAdmin, topic_specs

REWARDS = {"db": "sql_result", "os": "os_check", "code": "code_tests"}


@dataclass(frozen=True)
class ScenarioSettings:
    """Knobs of one scenario run."""

    scenario: str  # db | os | code
    minutes: float = 6.0  # wall-time budget of the learning phase
    n_train: int = 2000  # training prompts
    n_samples: int = 4  # samples per prompt (GRPO group size)
    sft_steps: int = 300  # warm-start steps (about 2 s each on one free core: sequences of ~200 tokens)
    sft_batch: int = 16  # warm-start batch
    wrong_fraction: float = 0.4  # share of warm-start demonstrations that end with a wrong answer
    lr: float = 3e-4  # RL learning rate
    batch_size: int = 16  # trainer batch (samples)
    max_inflight: int = 8  # rollouts of the node
    seed: int = 0


def demonstrations(scenario: str, n: int, wrong_fraction: float, seed: int) -> list[tuple[str, str]]:
    """(prompt, completion) pairs in the endpoint's chat format (`astraflow.raas.agent_api.render`)."""
    from astraflow.envs.database import GuardedDb, parse_spec, schema_text
    from astraflow.envs.datasets import env_dataset
    from astraflow.raas.workflows.envs import CODE_SYSTEM, SYSTEM

    rng = random.Random(seed)
    out = []
    for row in env_dataset(scenario, n, seed=seed + 1000):  # other rows than the training set's
        ref = json.loads(row["reference"])
        wrong = rng.random() < wrong_fraction
        if scenario == "db":
            tables = parse_spec(ref["db"])
            db = GuardedDb(tables)
            result = db.run_text(ref["query"])
            db.close()
            user = f"{row['prompt']}\nTables:\n{schema_text(tables)}"
            answer = str(rng.randint(0, 99)) if wrong else result.splitlines()[0]
            completion = f"<sql>{ref['query']}</sql><result>{result}</result>Answer: {answer}"
            system = SYSTEM
        elif scenario == "os":
            sol = ref["solution"]
            shown = f"{sol['output']}\n[exit code 0]".strip()
            answer = str(rng.randint(0, 99)) if wrong else sol["answer"]
            completion = f"<bash>{sol['command']}</bash><result>{shown}</result>Answer: {answer}"
            user, system = row["prompt"], SYSTEM
        else:
            code = ref["solution"].replace("return", "return -1 +") if wrong else ref["solution"]
            completion = f"```python\n{code}```"
            user, system = row["prompt"], CODE_SYSTEM
        out.append((f"{system}\nQ: {user.strip()}\nA:", completion))
    return out


def warm_model(s: ScenarioSettings, console: Console) -> Path:
    """The warm-started tiny model of the scenario, built once per settings in ~/.cache/astraflow."""
    from astraflow.models.sft import sft
    from astraflow.models.tiny import init_tiny

    key = hashlib.sha256(json.dumps([s.scenario, s.sft_steps, s.sft_batch, s.wrong_fraction, s.seed, 1]).encode()).hexdigest()[:10]
    cached = default_home() / "demo-models" / f"{s.scenario}-{key}"
    if (cached / "config.json").exists():
        console.print(f"Reusing the warm-started tiny model in {cached}")
        return cached
    # A build directory of this process alone: two demos started at once must not build into the
    # same directory (the second one's rmtree would cut the first one's model in half).
    tmp = cached.with_name(f"{cached.name}.tmp-{os.getpid()}")
    shutil.rmtree(tmp, ignore_errors=True)
    console.print("Building a tiny Qwen2 model with a locally trained tokenizer...")
    init_tiny(tmp, seed=s.seed)
    console.print(f"Warm-starting it with {s.sft_steps} SFT steps on {s.scenario} demonstrations "
                  f"({s.wrong_fraction:.0%} of them end with a wrong answer)...")
    def progress(step: int, loss: float) -> None:
        if (step + 1) % 25 == 0:
            console.print(f"  step {step + 1}/{s.sft_steps}  loss {loss:.3f}")

    m = sft(tmp, demonstrations(s.scenario, 1000, s.wrong_fraction, s.seed), steps=s.sft_steps,
            batch_size=s.sft_batch, seed=s.seed, on_step=progress)
    console.print(f"  SFT loss {m.first_loss:.2f} -> {m.final_loss:.2f} in {m.seconds:.0f}s")
    try:
        tmp.rename(cached)
    except OSError:  # another process cached the same model first: keep theirs
        shutil.rmtree(tmp, ignore_errors=True)
    return cached


def roles(s: ScenarioSettings, bootstrap: str, exp: str, model: Path, train: Path, run_dir: Path) -> list[Role]:
    env = role_env(bootstrap)
    return [
        Role("curator", [*PY, "app", "run", "curator", "-e", exp, "--policy", "policy", "--dataset", str(train),
                         "--n-samples", str(s.n_samples), "--max-ahead", "8", "--temperature", "1.0",
                         "--max-tokens", "96", "--max-turns", "3"], env),
        Role("reward", [*PY, "app", "run", "reward", "-e", exp, "--default", f"reward={REWARDS[s.scenario]}"], env),
        Role("curate", [*PY, "app", "run", "curate", "-e", exp, "--policy", "policy"], env),
        Role("trainer", [*PY, "train", "-e", exp, "-p", "policy", "-m", str(model), "--set", f"run_dir={run_dir}",
                         "--set", f"trainer.lr={s.lr}", "--set", f"trainer.batch_size={s.batch_size}",
                         "--set", "trainer.progress_bar=false", "--set", "trainer.max_wait_s=5",
                         "--set", "trainer.publish_dtype=float32"], env),
        Role("raas", [*PY, "raas", "serve", "-e", exp, "-p", f"policy={model}", "--max-inflight", str(s.max_inflight),
                      "--node-id", "raas-1", "--threads", "1", "--seed", str(s.seed)], env),
    ]


def run_scenario(cfg: AstraflowConfig, s: ScenarioSettings, run_dir: Path, console: Console) -> int:
    """Runs the scenario; returns the process exit code."""
    from astraflow.envs.datasets import write_dataset

    run_dir.mkdir(parents=True, exist_ok=True)
    exp = f"demo-{s.scenario}-{time.strftime('%Y%m%d-%H%M%S')}"
    write_resolved(cfg, run_dir)
    (run_dir / "demo.json").write_text(json.dumps({"experiment": exp, **asdict(s)}, indent=2) + "\n")
    model = warm_model(s, console)
    train = write_dataset(s.scenario, s.n_train, run_dir / "data" / "train.jsonl", seed=s.seed)
    specs = topic_specs(exp, ["policy"], cfg.topics)
    TopicAdmin(cfg.kafka).create(specs, cfg.topics.replication_factor)
    console.print(f"Experiment [bold]{exp}[/] ({s.scenario}, reward {REWARDS[s.scenario]}); logs in {run_dir / 'logs'}")
    sup = Supervisor(run_dir / "logs")
    monitor = Monitor(cfg.kafka, exp, "policy")
    failed: RoleFailed | None = None
    t0 = time.monotonic()
    try:
        for role in roles(s, cfg.kafka.bootstrap_servers, exp, model, train, run_dir):
            sup.start(role)
        monitor.start()
        while time.monotonic() - t0 < s.minutes * 60:
            time.sleep(10.0)
            sup.check()
            snap = monitor.snapshot()
            reward = "n/a" if snap.reward_recent is None else f"{snap.reward_recent:.3f}"
            console.print(f"{snap.elapsed_s:6.0f}s  trajectories {snap.trajectories:5d}  reward(last 64) {reward}  "
                          f"trainer version {snap.trainer_version}  dlq {snap.dlq}")
    except RoleFailed as exc:
        failed = exc
    except KeyboardInterrupt:
        pass
    finally:
        console.print("Stopping all roles...")
        sup.stop_all()
        monitor.stop()
    by_version = monitor.by_version()
    summary = {"experiment": exp, "scenario": s.scenario, "reward": REWARDS[s.scenario],
               "trajectories": monitor.snapshot().trajectories, "wall_time_s": round(time.monotonic() - t0, 1),
               "mean_reward_by_version": {str(v): round(r, 4) for v, r in sorted(by_version.items())},
               "failed_role": failed.role.name if failed else None}
    (run_dir / "summary.json").write_text(json.dumps(summary, indent=2) + "\n")
    if failed:
        console.print(f"[bold red]{failed.role.name} failed[/] (exit code {failed.code}); last lines of {failed.role.log}:")
        console.print(failed.tail, markup=False, highlight=False)
        return 1
    console.print(f"mean reward by policy version: {summary['mean_reward_by_version']}")
    console.print(f"Run directory: {run_dir} (summary.json, logs/)")
    return 0
