"""The demo: a tool-using arithmetic agent learns on CPU through the whole AstraFlow dataflow.

Steps: Kafka (given, or the local one) -> a warm-started tiny model (cached between runs) ->
train / held-out datasets -> the experiment's topics -> curator, two RaaS nodes, reward,
curate, trainer and a held-out evaluator as separate processes -> a live view until the target
success or the time budget -> CSV, plot and summary.json in the run directory.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import time
from collections.abc import Iterator
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from rich.console import Console

from astraflow.config import AstraflowConfig
from astraflow.demo.common import (
    PY,
    cached_model,
    curate_role,
    node_role,
    pct,
    print_failure,
    print_next_steps,
    role_env,
    start_run,
    supervise,
    trainer_role,
)
from astraflow.demo.monitor import Monitor
from astraflow.demo.report import write_csv, write_plot, write_summary
from astraflow.demo.supervisor import Role, Supervisor
from astraflow.demo.view import render
from astraflow.kafka.topics import Topics


@dataclass(frozen=True)
class DemoSettings:
    """Knobs of one demo run (`astraflow demo --help` exposes the main ones)."""

    minutes: float = 8.0  # wall-time budget of the learning phase
    target_success: float = 0.9  # stop early when held-out success reaches this
    versions: int | None = None  # stop early once this version is live (the trainer's or a node's version metric): work-bound runs
    difficulty: int = 2  # arithmetic difficulty (astraflow.models.tasks.DIFFICULTIES)
    n_train: int = 4000  # training prompts
    n_heldout: int = 128  # held-out evaluation prompts
    n_samples: int = 8  # samples per prompt (GRPO group size)
    sft_steps: int = 900  # warm-start steps
    sft_lr: float = 1e-3  # warm-start peak learning rate (3e-3 fails to learn copying for some seeds)
    tool_fraction: float = 0.3  # share of warm-start demonstrations that use the calculator (the rest answer directly)
    lr: float = 3e-4  # RL learning rate (1e-3 collapses the tiny model; 5e-5 barely moves it)
    batch_size: int = 64  # trainer batch (samples)
    max_ahead: int = 16  # tasks the curator keeps ahead of the trainer
    nodes: int = 2  # RaaS nodes
    max_inflight: int = 32  # rollouts per node
    publish_dtype: str = "float32"  # bf16 would round away most of a tiny model's small RL updates
    eval_interval_s: float = 30.0  # at most one held-out evaluation per this many seconds
    seed: int = 0
    backend: str = "torch"  # the nodes' inference backend: torch, or vllm (its CPU build; an untied model)
    vllm_kv_cache_gib: int = 1  # vllm: each node's KV cache (VLLM_CPU_KVCACHE_SPACE), so everything fits


def warm_model(settings: DemoSettings, console: Console) -> Path:
    """The warm-started tiny model, built once per settings and cached in ~/.cache/astraflow."""
    from transformers.utils import logging as hf_logging

    from astraflow.models.sft import warm_start
    from astraflow.models.tiny import init_tiny

    hf_logging.disable_progress_bar()

    tied = settings.backend != "vllm"  # vLLM's in-place weight reload needs an untied output head
    key = hashlib.sha256(json.dumps([settings.sft_steps, settings.difficulty, settings.seed, settings.tool_fraction,
                                     settings.sft_lr, 4, *([] if tied else ["untied"])]).encode()).hexdigest()[:10]

    def build(tmp: Path) -> None:
        console.print("Building a tiny Qwen2 model with a locally trained tokenizer...")
        init_tiny(tmp, seed=settings.seed, tie_embeddings=tied)
        console.print(f"Warm-starting it with {settings.sft_steps} SFT steps: {settings.tool_fraction:.0%} of the "
                      "demonstrations use the calculator, the rest answer directly (about a minute)...")
        m = warm_start(tmp, steps=settings.sft_steps, difficulty=settings.difficulty, seed=settings.seed,
                       tool_fraction=settings.tool_fraction, lr=settings.sft_lr)
        console.print(f"  SFT loss {m.first_loss:.2f} -> {m.final_loss:.2f} in {m.seconds:.0f}s")

    return cached_model(key, console, build)


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


def roles(cfg: AstraflowConfig, s: DemoSettings, exp: str, model: Path, train: Path, heldout: Path, run_dir: Path) -> list[Role]:
    env = role_env(cfg.kafka.bootstrap_servers)
    out = [
        Role("curator", [*PY, "app", "run", "curator", "-e", exp, "--policy", "policy", "--dataset", str(train),
                         "--workflow", "tool_use", "--n-samples", str(s.n_samples), "--max-ahead", str(s.max_ahead),
                         "--temperature", "1.0", "--max-tokens", "24", "--max-turns", "2"], env),
        Role("reward", [*PY, "app", "run", "reward", "-e", exp], env),
        curate_role(exp, ["policy"], env),
        trainer_role("trainer", exp, "policy", model, run_dir, s.lr, s.batch_size, env, s.publish_dtype),
        Role("eval", [*PY, "eval", "-e", exp, "-p", "policy", "-m", str(model), "--heldout", str(heldout),
                      "--interval", str(s.eval_interval_s)], env),
    ]
    extra = ["--backend", "vllm", "--kv-cache-gib", str(s.vllm_kv_cache_gib)] if s.backend == "vllm" else []
    out += [node_role(f"raas-{i + 1}", exp, {"policy": model}, s.max_inflight, s.seed + i, env, extra=extra)
            for i in range(s.nodes)]
    return out


def run_demo(cfg: AstraflowConfig, s: DemoSettings, run_dir: Path, console: Console, experiment: str | None = None) -> int:
    """Runs the demo; returns the process exit code."""
    if s.backend == "vllm":
        require_vllm()
    t_setup = time.monotonic()
    exp = experiment or f"demo-{time.strftime('%Y%m%d-%H%M%S')}"
    n_topics = start_run(cfg, run_dir, exp, ["policy"], asdict(s))
    model = warm_model(s, console)
    train, heldout = write_datasets(s, run_dir / "data")
    console.print(f"Experiment [bold]{exp}[/]: {n_topics} topics on {cfg.kafka.bootstrap_servers}; logs in {run_dir / 'logs'}")
    sup = Supervisor(run_dir / "logs", die_with_parent=True)
    t = Topics(exp)
    monitor = Monitor(cfg.kafka, exp, "policy", groups={
        t.tasks: t.raas_group, t.rollouts: t.group("reward"), t.scored: t.group("curate"),
        t.train("policy"): t.trainer_group("policy")})
    setup_s = time.monotonic() - t_setup
    live: list[Any] = []  # the rich Live view, once open

    @contextlib.contextmanager
    def view() -> Iterator[None]:
        from rich.live import Live

        page = _dashboard(cfg, exp, console)
        try:
            with Live(render(monitor.snapshot(), s, exp), console=console, refresh_per_second=1) as lv:
                live.append(lv)
                yield
        finally:
            if page is not None:
                page[0].close()
                page[1].stop()

    def step() -> str | None:
        snap = monitor.snapshot()
        live[0].update(render(snap, s, exp))
        if snap.eval_success is not None and snap.eval_version and snap.eval_success >= s.target_success:
            return f"target success {s.target_success:.0%}"
        if s.versions is not None and snap.newest_version >= s.versions:
            return f"{s.versions} versions published"
        return None

    run = supervise(console, sup, monitor, roles(cfg, s, exp, model, train, heldout, run_dir), minutes=s.minutes,
                    period_s=1.0, step=step, view=view)
    failed, stopped_by, wall = run.failed, run.stopped_by, run.wall_s
    write_csv(monitor, run_dir)
    plot = write_plot(monitor, run_dir)
    summary = write_summary(monitor, run_dir, {"wall_time_s": round(wall, 1), "setup_s": round(setup_s, 1),
                                               "stopped_by": "failure" if failed else stopped_by,
                                               "failed_role": failed.role.name if failed else None})
    if failed:
        print_failure(console, failed)
        return 1
    w, f = summary["eval_success_warm_start"], summary["eval_success_final"]
    console.print(
        f"[bold]held-out success[/] (sampled): warm start {pct(w)} -> final {pct(f)} (best {pct(summary['eval_success_best'])}); "
        f"greedy {pct(summary['eval_success_greedy_warm_start'])} -> {pct(summary['eval_success_greedy_final'])}; "
        f"{summary['versions_published']} versions, {summary['trajectories']} trajectories, {wall:.0f}s; stopped by {stopped_by}"
    )
    console.print(f"Run directory: {run_dir} (summary.json, learning.png, trajectories.csv, eval.csv, logs/)")
    console.print(f"Plot: {plot}")
    print_next_steps(console, exp, "policy", run_dir)
    return 0


def require_vllm() -> None:
    """Raise `ConfigError` unless vLLM can be imported by the role processes (this interpreter)."""
    import importlib.util

    from astraflow.errors import ConfigError

    if importlib.util.find_spec("vllm.entrypoints") is None:
        raise ConfigError("--backend vllm needs vLLM in this Python: run the demo from the virtualenv of "
                          "scripts/vllm-env.sh, e.g. `$(bash scripts/vllm-env.sh)/bin/astraflow demo --backend vllm`")


def _dashboard(cfg: AstraflowConfig, exp: str, console: Console) -> tuple[Any, Any] | None:
    """The live page of the run (`astraflow dashboard`), on 127.0.0.1:8787 or a free port."""
    from astraflow.errors import ConfigError
    from astraflow.ops.dashboard import DashboardServer, DashboardState

    state = DashboardState(cfg.kafka, exp, interval_s=5.0, window_s=30.0).start()
    for port in (8787, 0):
        try:
            server = DashboardServer(state, "127.0.0.1", port)
        except ConfigError:
            continue
        console.print(f"Live dashboard: [bold]{server.url}[/]")
        return server, state
    state.stop()
    return None

