"""`astraflow demo` (the main job) and `astraflow eval` (held-out evaluation following the weights)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import typer

from astraflow_cli.common import console, handle_errors, load


@handle_errors
def demo(
    ctx: typer.Context,
    minutes: float = typer.Option(8.0, help="Time budget of the learning phase."),
    bootstrap: str | None = typer.Option(None, help="Use this Kafka (HOST:PORT) instead of the local one."),
    out: str | None = typer.Option(None, help="Run directory (default runs/demo-<time>)."),
    target: float = typer.Option(0.9, help="Stop once held-out success reaches this."),
    versions: int | None = typer.Option(None, min=1, help="Stop once the trainer has published this many versions "
                                        "(solver-verifier: every policy, each also evaluated at least once)."),
    nodes: int = typer.Option(2, help="RaaS nodes."),
    n_samples: int | None = typer.Option(None, min=1, help="Samples per prompt (group size; default 8, scenarios "
                                         "db/os/code: 8)."),
    lr: float = typer.Option(3e-4, help="RL learning rate."),
    batch_size: int | None = typer.Option(None, help="Trainer batch size (samples; 64, solver-verifier 32, "
                                          "scenarios db/os/code 16)."),
    sft_steps: int | None = typer.Option(None, help="Warm-start SFT steps (default 900; scenarios db/os/code: 1200; "
                                         "solver-verifier: the solver's, the verifier gets 2/3 of them)."),
    heldout: int | None = typer.Option(None, min=0, help="Held-out tasks evaluated after the learning phase "
                                       "(scenarios db/os/code; default 200, 0: none)."),
    tool_fraction: float | None = typer.Option(None, help="Share of warm-start demonstrations that call the tool "
                                               "(arith: the calculator, default 0.3; db/os: sql/bash, default "
                                               "0.3)."),
    experiment: str | None = typer.Option(None, "--experiment", "-e", help="Name of the run's experiment (its topics "
                                          "are af.<experiment>.*; a new one; default demo-<time>)."),
    scenario: str = typer.Option("arith", help="arith (the calculator agent), solver-verifier (two policies trained "
                                 "together), or an AgentBench-style environment through the OpenAI endpoint: db (SQL), "
                                 "os (sandboxed shell), code (hidden tests)."),
    backend: str = typer.Option("torch", help="The RaaS nodes' inference backend (arith): torch, or vllm (vLLM's CPU "
                                "build; run from the virtualenv of scripts/vllm-env.sh)."),
) -> None:
    """Learn a tool-using agent on CPU through the whole dataflow (default: arithmetic, with a live view)."""
    import time

    from astraflow.demo.run import DemoSettings, run_demo

    if scenario not in ("arith", "solver-verifier", "db", "os", "code"):
        raise typer.BadParameter(f"--scenario {scenario!r}: choose arith, solver-verifier, db, os or code")
    if backend not in ("torch", "vllm") or (backend == "vllm" and scenario != "arith"):
        raise typer.BadParameter(f"--backend {backend!r}: choose torch, or vllm (with the arith scenario)")
    if tool_fraction is not None and not 0.0 <= tool_fraction <= 1.0:
        raise typer.BadParameter(f"--tool-fraction {tool_fraction}: give a share between 0 and 1")

    overrides = [f"kafka.bootstrap_servers={bootstrap}"] if bootstrap else []
    cfg = load(ctx, *overrides)
    if bootstrap:
        console.print(f"Using the Kafka at {bootstrap}")
    else:
        from astraflow.kafka.local import LocalKafka

        local = LocalKafka(cfg.local_kafka)
        console.print(f"No --bootstrap given: using the local Apache Kafka at {local.bootstrap} (astraflow kafka up)")
        local.up(echo=console.print)
        cfg = load(ctx, f"kafka.bootstrap_servers={local.bootstrap}")
    if experiment is not None:
        _check_new(cfg, experiment)
    run_dir = Path(out) if out else Path("runs") / f"demo-{time.strftime('%Y%m%d-%H%M%S')}"
    if scenario == "solver-verifier":
        from astraflow.demo.pair import PairSettings, run_pair

        steps = {"sft_steps": sft_steps, "verifier_sft_steps": max(1, sft_steps * 2 // 3)} if sft_steps else {}
        pair = PairSettings(minutes=minutes, versions=versions, n_samples=n_samples or PairSettings.n_samples, lr=lr,
                            batch_size=batch_size or PairSettings.batch_size, **steps)
        raise typer.Exit(run_pair(cfg, pair, run_dir, console, experiment=experiment))
    if scenario != "arith":
        from astraflow.demo.scenarios import ScenarioSettings, run_scenario

        steps = {"sft_steps": sft_steps} if sft_steps else {}
        if tool_fraction is not None:
            steps["tool_fraction"] = tool_fraction
        env = ScenarioSettings(scenario, minutes=minutes, versions=versions, n_samples=n_samples or ScenarioSettings.n_samples,
                               lr=lr, batch_size=batch_size or ScenarioSettings.batch_size,
                               n_heldout=ScenarioSettings.n_heldout if heldout is None else heldout, **steps)
        raise typer.Exit(run_scenario(cfg, env, run_dir, console, experiment=experiment))
    settings = DemoSettings(minutes=minutes, target_success=target, versions=versions, nodes=nodes,
                            n_samples=n_samples or DemoSettings.n_samples, lr=lr,
                            batch_size=batch_size or DemoSettings.batch_size, sft_steps=sft_steps or DemoSettings.sft_steps,
                            tool_fraction=DemoSettings.tool_fraction if tool_fraction is None else tool_fraction,
                            backend=backend)
    code = run_demo(cfg, settings, run_dir, console, experiment=experiment)
    raise typer.Exit(code)


def _check_new(cfg: object, experiment: str) -> None:
    """A demo starts a fresh experiment: a name already in use would mix two runs' records."""
    from astraflow.errors import ConfigError
    from astraflow.kafka.topics import TopicAdmin, Topics

    c: Any = cfg
    existing = TopicAdmin(c.kafka).list(Topics(experiment).prefix)
    if existing:
        raise ConfigError(f"experiment {experiment!r} already exists on {c.kafka.bootstrap_servers} ({len(existing)} "
                          f"topics): choose another --experiment, or delete it first with "
                          f"`astraflow experiments delete {experiment}`")


@handle_errors
def evaluate(
    ctx: typer.Context,
    experiment: str = typer.Option(..., "--experiment", "-e"),
    policy: str = typer.Option(..., "--policy", "-p"),
    model: str = typer.Option(..., "--model", "-m", help="The starting model directory (tokenizer and architecture)."),
    heldout: str = typer.Option(..., help="JSONL of {prompt, reference} rows."),
    interval: float = typer.Option(30.0, help="At most one evaluation per this many seconds."),
) -> None:
    """Follow the policy's weights and publish held-out success per version to the metrics topic."""
    from astraflow.demo.evaluator import run_evaluator

    run_evaluator(load(ctx), experiment, policy, model, Path(heldout), min_interval_s=interval)
