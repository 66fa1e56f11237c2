"""Entry point of the `astraflow` command."""

from __future__ import annotations

import typer

from astraflow_cli import (
    apps_cmd,
    archive_cmd,
    dashboard_cmd,
    demo_cmd,
    experiments_cmd,
    kafka_cmd,
    keys_cmd,
    logs_cmd,
    model_cmd,
    raas_cmd,
    registry_cmd,
    replay_cmd,
    smoke_cmd,
    status_cmd,
    topics_cmd,
    trace_cmd,
    train_cmd,
    wan_cmd,
)
from astraflow_cli.common import console, handle_errors, load

app = typer.Typer(
    help="AstraFlow: reinforcement learning for LLM agents as a dataflow on Apache Kafka.",
    no_args_is_help=True,
    pretty_exceptions_enable=False,
)
app.add_typer(kafka_cmd.app, name="kafka")
app.add_typer(registry_cmd.app, name="registry")
app.add_typer(wan_cmd.app, name="wan")
app.add_typer(topics_cmd.app, name="topics")
app.add_typer(experiments_cmd.app, name="experiments")
app.add_typer(keys_cmd.app, name="keys")
app.add_typer(apps_cmd.app_app, name="app")
app.add_typer(apps_cmd.control_app, name="control")
app.add_typer(apps_cmd.process_app, name="process")
app.command("smoke")(smoke_cmd.smoke)
app.add_typer(archive_cmd.app, name="archive")
app.add_typer(logs_cmd.app, name="logs")
app.command("replay")(replay_cmd.replay)
app.add_typer(raas_cmd.app, name="raas")
app.command("train")(train_cmd.train)
app.command("demo")(demo_cmd.demo)
app.command("eval")(demo_cmd.evaluate)
app.add_typer(model_cmd.app, name="model")
status_cmd.register(app)
trace_cmd.register(app)
dashboard_cmd.register(app)


@app.callback()
def main(
    ctx: typer.Context,
    config: str | None = typer.Option(None, "--config", "-c", help="YAML or TOML config file."),
    set_: list[str] = typer.Option([], "--set", help="Override a config value: section.field=value (repeatable)."),
) -> None:
    """Global options apply to every command."""
    ctx.obj = {"config_path": config, "overrides": set_}


@app.command("config")
@handle_errors
def show_config(ctx: typer.Context) -> None:
    """Print the resolved configuration (file, then ASTRAFLOW__* environment, then --set), secrets masked."""
    import json

    from astraflow.config import redacted

    console.print_json(json.dumps(redacted(load(ctx))))


if __name__ == "__main__":
    app()
