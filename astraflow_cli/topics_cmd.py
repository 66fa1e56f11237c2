"""`astraflow topics create | list | describe`: an experiment's topics."""

from __future__ import annotations

import json

import typer
from rich.table import Table

from astraflow_cli.common import console, handle_errors, load

app = typer.Typer(help="Create and inspect an experiment's Kafka topics.", no_args_is_help=True)

EXPERIMENT = typer.Option(..., "--experiment", "-e", help="Experiment name (topics are af.<experiment>.*).")
POLICY = typer.Option([], "--policy", "-p", help="Policy name; repeat for several policies.")


@app.command()
@handle_errors
def create(
    ctx: typer.Context,
    experiment: str = EXPERIMENT,
    policy: list[str] = POLICY,
    stream: list[str] = typer.Option([], "--stream", "-s", help="Only this stream of the experiment (a custom one, "
                                     "e.g. a processor's sink: af.<experiment>.<stream>); repeatable."),
    partitions: int | None = typer.Option(None, "--partitions", min=1, help="Partitions of the --stream topics "
                                          "(default: topics.partitions of the config)."),
) -> None:
    """Create every topic the experiment needs, or only the --stream ones (existing ones are left alone)."""
    from astraflow.errors import ConfigError
    from astraflow.kafka.topics import TopicAdmin, stream_spec, topic_specs

    cfg = load(ctx)
    if partitions is not None and not stream:
        raise ConfigError("--partitions applies to --stream topics; the experiment's own take topics.partitions "
                          "(--set topics.partitions=N)")
    specs = ([stream_spec(experiment, s, cfg.topics, partitions) for s in stream] if stream
             else topic_specs(experiment, policy, cfg.topics))
    result = TopicAdmin(cfg.kafka).create(specs, cfg.topics.replication_factor)
    table = Table("topic", "partitions", "state", "config")
    for s in specs:
        table.add_row(s.name, str(s.partitions), result[s.name], ", ".join(f"{k}={v}" for k, v in s.config.items()))
    console.print(table)


@app.command("list")
@handle_errors
def list_(
    ctx: typer.Context,
    experiment: str | None = typer.Option(None, "--experiment", "-e", help="Only this experiment's topics."),
    as_json: bool = typer.Option(False, "--json"),
) -> None:
    """List topics (all AstraFlow topics, or one experiment's) with partition counts."""
    from astraflow.kafka.topics import PREFIX, TopicAdmin, Topics

    cfg = load(ctx)
    prefix = Topics(experiment).prefix if experiment else PREFIX
    topics = TopicAdmin(cfg.kafka).list(prefix)
    if as_json:
        console.print_json(json.dumps(topics))
        return
    table = Table("topic", "partitions")
    for name, parts in topics.items():
        table.add_row(name, str(parts))
    console.print(table)


@app.command()
@handle_errors
def describe(ctx: typer.Context, experiment: str = EXPERIMENT, policy: list[str] = POLICY) -> None:
    """Show the non-default configs of the experiment's topics."""
    from astraflow.kafka.topics import TopicAdmin, Topics, topic_specs

    cfg = load(ctx)
    admin = TopicAdmin(cfg.kafka)
    existing = admin.list(Topics(experiment).prefix)
    names = [s.name for s in topic_specs(experiment, policy, cfg.topics) if s.name in existing]
    table = Table("topic", "partitions", "config")
    for name, conf in admin.describe(names).items():
        table.add_row(name, str(existing[name]), ", ".join(f"{k}={v}" for k, v in sorted(conf.items())))
    console.print(table)
