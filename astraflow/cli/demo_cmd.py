"""`astraflow demo` (the main job) and `astraflow eval` (held-out evaluation following the weights)."""

from __future__ import annotations

from pathlib import Path

import typer

from astraflow.cli.common import console, handle_errors, load


@handle_errors
def demo(
    ctx: typer.Context,
    minutes: float = typer.Option(8.0, help="Time budget of the learning phase."),
    bootstrap: str | None = typer.Option(None, help="Use this Kafka (HOST:PORT) instead of the local one."),
    out: str | None = typer.Option(None, help="Run directory (default runs/demo-<time>)."),
    target: float = typer.Option(0.9, help="Stop once held-out success reaches this."),
    nodes: int = typer.Option(2, help="RaaS nodes."),
    n_samples: int = typer.Option(8, help="Samples per prompt (group size)."),
    lr: float = typer.Option(3e-4, help="RL learning rate."),
    batch_size: int = typer.Option(64, help="Trainer batch size (samples)."),
    sft_steps: int | None = typer.Option(None, help="Warm-start SFT steps (default 900; scenarios db/os/code: 300)."),
    scenario: str = typer.Option("arith", help="arith (the calculator agent), or an AgentBench-style environment "
                                 "through the OpenAI endpoint: db (SQL), os (sandboxed shell), code (hidden tests)."),
) -> None:
    """Learn a tool-using agent on CPU through the whole dataflow (default: arithmetic, with a live view)."""
    import time

    from astraflow.demo.run import DemoSettings, run_demo

    if scenario not in ("arith", "db", "os", "code"):
        raise typer.BadParameter(f"--scenario {scenario!r}: choose arith, db, os or code")

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
    run_dir = Path(out) if out else Path("runs") / f"demo-{time.strftime('%Y%m%d-%H%M%S')}"
    if scenario != "arith":
        from astraflow.demo.scenarios import ScenarioSettings, run_scenario

        steps = {"sft_steps": sft_steps} if sft_steps else {}
        raise typer.Exit(run_scenario(cfg, ScenarioSettings(scenario, minutes=minutes, **steps), run_dir, console))
    settings = DemoSettings(minutes=minutes, target_success=target, nodes=nodes, n_samples=n_samples, lr=lr,
                            batch_size=batch_size, sft_steps=sft_steps or DemoSettings.sft_steps)
    code = run_demo(cfg, settings, run_dir, console)
    raise typer.Exit(code)


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
