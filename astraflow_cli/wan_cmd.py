"""`astraflow wan up | down | status`: the simulated WAN (Toxiproxy) in front of the local Kafka's
second listener, for region-B clients (docs/deploy-regions.md)."""

from __future__ import annotations

import json

import typer
from rich.markup import escape

from astraflow_cli.common import console, handle_errors, load
from astraflow_cli.kafka_cmd import DATA_DIR, PORT, _local

app = typer.Typer(help="Simulate a WAN link (latency, bandwidth cap) between region B and the local Kafka.",
                  no_args_is_help=True)


def _wan(ctx: typer.Context):
    from astraflow.kafka.wan import Wan

    return Wan(load(ctx).wan)


@app.command()
@handle_errors
def up(ctx: typer.Context, data_dir: str | None = DATA_DIR, port: int | None = PORT) -> None:
    """Build Toxiproxy on first use, start it, and put one WAN link in front of each Kafka node's
    WAN listener (started with `astraflow kafka up --wan-proxy-port N`). Settings: wan.*."""
    from astraflow.errors import WanError
    from astraflow.kafka.wan import Link

    local = _local(ctx, data_dir, port)
    if local.wan_bootstrap is None:
        raise WanError(f"the Kafka in {local.root} has no WAN listener: start it with "
                       "`astraflow kafka up --wan-proxy-port N` (a new data directory, or after `kafka down`)")
    links = [Link(f"kafka-{n.node_id}", n.wan_proxy_port, n.wan_port) for n in local.nodes]  # type: ignore[arg-type]
    _wan(ctx).up(links, echo=console.print)
    console.print(f"[green]ready[/] region B: bootstrap.servers={local.wan_bootstrap}")


@app.command()
@handle_errors
def down(ctx: typer.Context) -> None:
    """Stop the Toxiproxy server that `up` started (and nothing else)."""
    _wan(ctx).down(echo=console.print)


@app.command()
@handle_errors
def status(ctx: typer.Context, as_json: bool = typer.Option(False, "--json", help="Machine-readable output.")) -> None:
    """The links, their toxics and the bytes each carried; exit code 3 when the proxy is not running."""
    wan = _wan(ctx)
    if wan.pid() is None:
        console.print("Toxiproxy: [red]stopped[/]")
        raise typer.Exit(3)
    links, counted = wan.links(), wan.bytes()
    if as_json:
        console.print_json(json.dumps({"links": links, "bytes": counted}))
        return
    for name, p in links.items():
        toxics = ", ".join(f"{t['type']} {t['stream']} {t['attributes']}" for t in p.get("toxics", []))
        b = counted.get(name, {})
        console.print(escape(f"{name}: {p['listen']} -> {p['upstream']} enabled={p['enabled']} ({toxics}); "
                             f"bytes to Kafka={b.get('upstream', 0)}, to region B={b.get('downstream', 0)}"))
