"""`astraflow model init-tiny | sft`: tiny local models for tests, demos and CPU nodes."""

from __future__ import annotations

import typer

from astraflow_cli.common import console, handle_errors

app = typer.Typer(help="Build and warm-start tiny local models (no hub downloads).", no_args_is_help=True)


@app.command("init-tiny")
@handle_errors
def init_tiny_cmd(
    out: str = typer.Option(..., "--out", help="Directory to write the model and tokenizer to."),
    seed: int = typer.Option(0),
) -> None:
    """A small Qwen2-architecture model with a tokenizer trained locally on a synthetic corpus."""
    from astraflow.models.tiny import init_tiny

    path = init_tiny(out, seed=seed)
    console.print(f"tiny model written to {path}")


@app.command()
@handle_errors
def sft(
    model: str = typer.Option(..., "--model", help="Model directory (updated in place unless --out)."),
    out: str | None = typer.Option(None, "--out"),
    steps: int = typer.Option(300),
    difficulty: int = typer.Option(2),
    seed: int = typer.Option(0),
) -> None:
    """Warm-start on synthetic calculator demonstrations so RL starts from a policy that sometimes succeeds."""
    from astraflow.models.sft import warm_start

    m = warm_start(model, steps=steps, difficulty=difficulty, seed=seed, out_dir=out)
    console.print(f"SFT loss {m.first_loss:.3f} -> {m.final_loss:.3f} in {m.seconds:.0f}s; saved to {m.out_dir}")
