"""`astraflow train`: run the trainer of one policy (Lightning) on its Kafka train topic."""

from __future__ import annotations

import typer

from astraflow_cli.common import console, handle_errors


@handle_errors
def train(
    ctx: typer.Context,
    experiment: str = typer.Option(..., "--experiment", "-e", help="Experiment name (topics are af.<experiment>.*)."),
    policy: str = typer.Option(..., "--policy", "-p", help="Policy to train: reads <policy>.train, publishes <policy>.weights."),
    model: str = typer.Option(..., "--model", "-m", help="Local directory of the causal LM (transformers format)."),
    config: str | None = typer.Option(None, "--config", "-c", help="YAML or TOML config (a `trainer:` section and the shared ones)."),
    set_: list[str] = typer.Option([], "--set", help="Override a value, e.g. trainer.lr=1e-6 (repeatable)."),
    devices: int | None = typer.Option(None, "--devices", help="Processes (ranks) on this machine: GPUs, or CPU processes with --accelerator cpu (trainer.devices)."),
    strategy: str | None = typer.Option(None, "--strategy", help="auto, ddp or fsdp (trainer.strategy); ddp / fsdp with --devices 2 or more."),
    accelerator: str | None = typer.Option(None, "--accelerator", help="cpu, gpu or auto (trainer.accelerator)."),
) -> None:
    """Train a policy whenever batches are available; publish versions; resume from checkpoints."""
    import logging

    from astraflow.config import load_config
    from trainers.config import TrainRunConfig

    root = ctx.find_root().obj or {}
    overrides = [*root.get("overrides", []), *set_, f"experiment={experiment}", f"trainer.policy={policy}", f"trainer.model_dir={model}"]
    for key, value in (("devices", devices), ("strategy", strategy), ("accelerator", accelerator)):
        if value is not None:
            overrides.append(f"trainer.{key}={value}")
    cfg = load_config(config or root.get("config_path"), overrides, model=TrainRunConfig)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(levelname)s %(message)s")
    from trainers.run import run_training  # heavy: torch, lightning, transformers

    summary = run_training(cfg)
    if summary.global_rank != 0:
        return
    console.print(
        f"[green]trained[/] {summary.steps} steps, {summary.trained_samples} samples; "
        f"last version {summary.version}; offsets {summary.offsets}; stopped by {summary.stopped_by} "
        f"({summary.seconds:.1f}s)"
    )
