"""`astraflow experiments list | delete`: the experiments on a cluster, and removing one.

An experiment is its topics, `af.<experiment>.*` (the Faust apps' changelog topics included), and
its consumer groups, `af.<experiment>.*`. `list` groups the cluster's topics by experiment;
`delete` removes both after a confirmation (`--yes` skips it).
"""

from __future__ import annotations

import json

import typer
from rich.table import Table

from astraflow_cli.common import console, handle_errors, load

app = typer.Typer(help="List the experiments on the cluster, or delete one (its topics and consumer groups).",
                  no_args_is_help=True)


@app.command("list")
@handle_errors
def list_(ctx: typer.Context, as_json: bool = typer.Option(False, "--json", help="One JSON object per experiment.")) -> None:
    """Every experiment that has topics: its policies, its other streams (processors' sinks, replay
    targets) and how many topics and consumer groups it has."""
    from astraflow.kafka.topics import (
        POLICY_STREAMS,
        PREFIX,
        SHARED_STREAMS,
        TopicAdmin,
        Topics,
        experiment_of,
    )

    cfg = load(ctx)
    admin = TopicAdmin(cfg.kafka)
    by: dict[str, list[str]] = {}
    for name in admin.list(PREFIX):
        exp = experiment_of(name)
        if exp is not None:
            by.setdefault(exp, []).append(name.removeprefix(Topics(exp).prefix))
    groups = admin.groups(PREFIX)
    rows = []
    for exp, streams in sorted(by.items()):
        policies = sorted({s.rsplit(".", 1)[0] for s in streams if s.count(".") == 1 and s.rsplit(".", 1)[1] in POLICY_STREAMS})
        builtin = set(SHARED_STREAMS) | {f"{p}.{k}" for p in policies for k in POLICY_STREAMS}
        other = sorted(s for s in streams if s not in builtin and not s.endswith("-changelog")
                       and not s.startswith("tasks."))
        rows.append({"experiment": exp, "topics": len(streams), "policies": policies, "streams": other,
                     "groups": sum(1 for g in groups if Topics(exp).of_experiment(g))})
    if as_json:
        for r in rows:
            typer.echo(json.dumps(r))
        return
    if not rows:
        console.print(f"no experiments on {cfg.kafka.bootstrap_servers} (`astraflow topics create -e NAME -p POLICY` "
                      "or `astraflow demo` makes one)")
        return
    table = Table("experiment", "topics", "policies", "other streams", "groups",
                  title=f"experiments on {cfg.kafka.bootstrap_servers}", title_justify="left")
    for r in rows:
        table.add_row(r["experiment"], str(r["topics"]), ", ".join(r["policies"]) or "-", ", ".join(r["streams"]) or "-",
                      str(r["groups"]))
    console.print(table)


@app.command("delete")
@handle_errors
def delete(
    ctx: typer.Context,
    name: str = typer.Argument(..., help="The experiment (see `astraflow experiments list`)."),
    yes: bool = typer.Option(False, "--yes", "-y", help="Do not ask for confirmation."),
) -> None:
    """Delete every topic (records included) and consumer group of experiment NAME. Stop its roles
    first: a group with a member still connected is left in place, and said so."""
    from astraflow.kafka.topics import TopicAdmin, Topics

    cfg = load(ctx)
    admin = TopicAdmin(cfg.kafka)
    topics = admin.experiment(name)  # one line naming it, and how to list what exists, when it has none
    groups = admin.groups(Topics(name).prefix)
    console.print(f"experiment {name} on {cfg.kafka.bootstrap_servers}: {len(topics)} topics "
                  f"({', '.join(t.removeprefix(Topics(name).prefix) for t in topics)}) and {len(groups)} consumer groups")
    if not yes and not typer.confirm("Delete them and every record they hold? This cannot be undone", default=False):
        console.print("nothing deleted")
        raise typer.Exit(1)
    admin.delete(list(topics))
    kept = admin.delete_groups(groups)
    console.print(f"deleted {len(topics)} topics and {len(groups) - len(kept)} consumer groups of {name}")
    for g in kept:
        console.print(f"[yellow]kept group[/] {g}: stop its members, then run this again")
    if kept:
        raise typer.Exit(1)
