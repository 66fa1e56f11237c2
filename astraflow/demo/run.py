"""The demo: a tool-using arithmetic agent learns on CPU through the whole AstraFlow dataflow.

Steps: Kafka (given, or the local one) -> a warm-started tiny model (cached between runs) ->
train / held-out datasets -> the experiment's topics -> curator, two RaaS nodes, reward,
curate, trainer and a held-out evaluator as separate processes -> a live view until the target
success or the time budget -> CSV, plot and summary.json in the run directory.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import sys
import time
from dataclasses import asdict, dataclass
from pathlib import Path

from rich.console import Console

from astraflow.config import AstraflowConfig, default_home, write_resolved
from astraflow.demo.monitor import Monitor
from astraflow.demo.report import write_csv, write_plot, write_summary
from astraflow.demo.supervisor import Role, RoleFailed, Supervisor
from astraflow.demo.view import render
from astraflow.kafka.topics import TopicAdmin, topic_specs


@dataclass(frozen=True)
class DemoSettings:
    """Knobs of one demo run (`astraflow demo --help` exposes the main ones)."""

    minutes: float = 8.0  # wall-time budget of the learning phase
    target_success: float = 0.9  # stop early when held-out success reaches this
    difficulty: int = 2  # arithmetic difficulty (astraflow.models.tasks.DIFFICULTIES)
    n_train: int = 4000  # training prompts
    n_heldout: int = 128  # held-out evaluation prompts
    n_samples: int = 8  # samples per prompt (GRPO group size)
    sft_steps: int = 900  # warm-start steps (with tool_fraction 0.5: 41% of sampled episodes call the tool, 14% succeed)
    tool_fraction: float = 0.5  # share of warm-start demonstrations that use the calculator (the rest answer directly)
    lr: float = 3e-4  # RL learning rate (1e-3 collapses the tiny model; 5e-5 barely moves it)
    batch_size: int = 64  # trainer batch (samples)
    max_ahead: int = 16  # tasks the curator keeps ahead of the trainer
    nodes: int = 2  # RaaS nodes
    max_inflight: int = 32  # rollouts per node
    publish_dtype: str = "float32"  # bf16 would round away most of a tiny model's small RL updates
    eval_interval_s: float = 30.0  # at most one held-out evaluation per this many seconds
    seed: int = 0


PY = [sys.executable, "-m", "astraflow.cli.main"]


def warm_model(settings: DemoSettings, console: Console) -> Path:
    """The warm-started tiny model, built once per settings and cached in ~/.cache/astraflow."""
    from transformers.utils import logging as hf_logging

    from astraflow.models.sft import warm_start
    from astraflow.models.tiny import init_tiny

    hf_logging.disable_progress_bar()

    key = hashlib.sha256(json.dumps([settings.sft_steps, settings.difficulty, settings.seed, settings.tool_fraction, 3]).encode()).hexdigest()[:10]
    cached = default_home() / "demo-models" / key
    if (cached / "config.json").exists():
        console.print(f"Reusing the warm-started tiny model in {cached}")
        return cached
    # A build directory of this process alone: two demos started at once must not build into the
    # same directory (the second one's rmtree would cut the first one's model in half).
    tmp = cached.with_name(f"{cached.name}.tmp-{os.getpid()}")
    shutil.rmtree(tmp, ignore_errors=True)
    console.print("Building a tiny Qwen2 model with a locally trained tokenizer...")
    init_tiny(tmp, seed=settings.seed)
    console.print(f"Warm-starting it with {settings.sft_steps} SFT steps: {settings.tool_fraction:.0%} of the demonstrations "
                  "use the calculator, the rest answer directly (about a minute)...")
    m = warm_start(tmp, steps=settings.sft_steps, difficulty=settings.difficulty, seed=settings.seed,
                   tool_fraction=settings.tool_fraction)
    console.print(f"  SFT loss {m.first_loss:.2f} -> {m.final_loss:.2f} in {m.seconds:.0f}s")
    try:
        tmp.rename(cached)
    except OSError:  # another process cached the same model first: keep theirs
        shutil.rmtree(tmp, ignore_errors=True)
    return cached


def write_datasets(settings: DemoSettings, data_dir: Path) -> tuple[Path, Path]:
    from astraflow.models.tasks import arithmetic_dataset, split_heldout

    problems = arithmetic_dataset(settings.n_train * 2, seed=settings.seed + 1, difficulty=settings.difficulty)
    train, heldout = split_heldout(problems, 0.2)
    data_dir.mkdir(parents=True, exist_ok=True)
    paths = []
    for name, rows in (("train", train[: settings.n_train]), ("heldout", heldout[: settings.n_heldout])):
        p = data_dir / f"{name}.jsonl"
        p.write_text("".join(json.dumps({"id": r.prompt_id, "prompt": r.prompt, "reference": r.reference,
                                          "difficulty": r.difficulty, "dataset": "arith"}) + "\n" for r in rows))
        paths.append(p)
    return paths[0], paths[1]


def role_env(bootstrap_servers: str) -> dict[str, str]:
    """Environment of every role process: the cluster, one torch thread, nothing from a hub."""
    return {"ASTRAFLOW__KAFKA__BOOTSTRAP_SERVERS": bootstrap_servers, "OMP_NUM_THREADS": "1",
            "HF_HUB_OFFLINE": "1", "TRANSFORMERS_NO_ADVISORY_WARNINGS": "1",
            "TOKENIZERS_PARALLELISM": "false", "PYTHONUNBUFFERED": "1"}


def roles(cfg: AstraflowConfig, s: DemoSettings, exp: str, model: Path, train: Path, heldout: Path, run_dir: Path) -> list[Role]:
    env = role_env(cfg.kafka.bootstrap_servers)
    out = [
        Role("curator", [*PY, "app", "run", "curator", "-e", exp, "--policy", "policy", "--dataset", str(train),
                         "--workflow", "tool_use", "--n-samples", str(s.n_samples), "--max-ahead", str(s.max_ahead),
                         "--temperature", "1.0", "--max-tokens", "24", "--max-turns", "2"], env),
        Role("reward", [*PY, "app", "run", "reward", "-e", exp], env),
        Role("curate", [*PY, "app", "run", "curate", "-e", exp, "--policy", "policy"], env),
        Role("trainer", [*PY, "train", "-e", exp, "-p", "policy", "-m", str(model),
                         "--set", f"run_dir={run_dir}", "--set", f"trainer.lr={s.lr}",
                         "--set", f"trainer.batch_size={s.batch_size}", "--set", "trainer.progress_bar=false",
                         "--set", "trainer.max_wait_s=5",
                         # The tiny model is 1.5 MB in fp32: publish exactly what the trainer holds.
                         "--set", f"trainer.publish_dtype={s.publish_dtype}"], env),
        Role("eval", [*PY, "eval", "-e", exp, "-p", "policy", "-m", str(model), "--heldout", str(heldout),
                      "--interval", str(s.eval_interval_s)], env),
    ]
    for i in range(s.nodes):
        out.append(Role(f"raas-{i + 1}", [*PY, "raas", "serve", "-e", exp, "-p", f"policy={model}", "--max-inflight",
                                          str(s.max_inflight), "--node-id", f"raas-{i + 1}", "--threads", "1",
                                          "--seed", str(s.seed + i)], env))
    return out


def run_demo(cfg: AstraflowConfig, s: DemoSettings, run_dir: Path, console: Console) -> int:
    """Runs the demo; returns the process exit code."""
    t_setup = time.monotonic()
    run_dir.mkdir(parents=True, exist_ok=True)
    exp = f"demo-{time.strftime('%Y%m%d-%H%M%S')}"
    write_resolved(cfg, run_dir)
    (run_dir / "demo.json").write_text(json.dumps({"experiment": exp, **asdict(s)}, indent=2) + "\n")
    model = warm_model(s, console)
    train, heldout = write_datasets(s, run_dir / "data")
    specs = topic_specs(exp, ["policy"], cfg.topics)
    TopicAdmin(cfg.kafka).create(specs, cfg.topics.replication_factor)
    console.print(f"Experiment [bold]{exp}[/]: {len(specs)} topics on {cfg.kafka.bootstrap_servers}; logs in {run_dir / 'logs'}")
    sup = Supervisor(run_dir / "logs")
    monitor = Monitor(cfg.kafka, exp, "policy", groups={
        f"af.{exp}.tasks": f"af.{exp}.raas", f"af.{exp}.rollouts": f"af.{exp}.reward",
        f"af.{exp}.scored": f"af.{exp}.curate", f"af.{exp}.policy.train": f"af.{exp}.policy.trainer"})
    failed: RoleFailed | None = None
    stopped_by = "time budget"
    setup_s = time.monotonic() - t_setup
    t0 = time.monotonic()
    try:
        for role in roles(cfg, s, exp, model, train, heldout, run_dir):
            sup.start(role)
        monitor.start()
        from rich.live import Live

        with Live(render(monitor.snapshot(), s, exp), console=console, refresh_per_second=1) as live:
            while time.monotonic() - t0 < s.minutes * 60:
                time.sleep(1.0)
                sup.check()
                snap = monitor.snapshot()
                live.update(render(snap, s, exp))
                if snap.eval_success is not None and snap.eval_version and snap.eval_success >= s.target_success:
                    stopped_by = f"target success {s.target_success:.0%}"
                    break
    except RoleFailed as exc:
        failed = exc
    except KeyboardInterrupt:
        stopped_by = "Ctrl-C"
    finally:
        console.print("Stopping all roles...")
        sup.stop_all()
        monitor.stop()
    wall = time.monotonic() - t0
    write_csv(monitor, run_dir)
    plot = write_plot(monitor, run_dir)
    summary = write_summary(monitor, run_dir, {"wall_time_s": round(wall, 1), "setup_s": round(setup_s, 1),
                                               "stopped_by": "failure" if failed else stopped_by,
                                               "failed_role": failed.role.name if failed else None})
    if failed:
        console.print(f"[bold red]{failed.role.name} failed[/] (exit code {failed.code}); last lines of {failed.role.log}:")
        console.print(failed.tail, markup=False, highlight=False)
        return 1
    w, f = summary["eval_success_warm_start"], summary["eval_success_final"]
    console.print(
        f"[bold]held-out success[/] (sampled): warm start {_pct(w)} -> final {_pct(f)} (best {_pct(summary['eval_success_best'])}); "
        f"greedy {_pct(summary['eval_success_greedy_warm_start'])} -> {_pct(summary['eval_success_greedy_final'])}; "
        f"{summary['versions_published']} versions, {summary['trajectories']} trajectories, {wall:.0f}s; stopped by {stopped_by}"
    )
    console.print(f"Run directory: {run_dir} (summary.json, learning.png, trajectories.csv, eval.csv, logs/)")
    console.print(f"Plot: {plot}")
    return 0


def _pct(x: float | None) -> str:
    return "n/a" if x is None else f"{x:.1%}"
