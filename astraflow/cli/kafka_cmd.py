"""`astraflow kafka up | down | status | logs`: the local Apache Kafka."""

from __future__ import annotations

import json
import time

import typer

from astraflow.cli.common import console, handle_errors, load

app = typer.Typer(help="Run a real single-node Apache Kafka (KRaft) locally, without Docker.", no_args_is_help=True)


def _local(ctx: typer.Context, data_dir: str | None, port: int | None):
    from astraflow.kafka.local import LocalKafka

    overrides = []
    if data_dir:
        overrides.append(f"local_kafka.data_dir={data_dir}")
    if port:
        overrides += [f"local_kafka.port={port}", f"local_kafka.controller_port={port + 1}"]
    return LocalKafka(load(ctx, *overrides).local_kafka)


DATA_DIR = typer.Option(None, "--data-dir", help="Where jars, storage, logs and the pid file live.")
PORT = typer.Option(None, "--port", help="Broker port on 127.0.0.1 (the controller uses port+1).")


@app.command()
@handle_errors
def up(ctx: typer.Context, data_dir: str | None = DATA_DIR, port: int | None = PORT) -> None:
    """Start the broker (no-op if it is already running) and wait until it answers."""
    t0 = time.monotonic()
    st = _local(ctx, data_dir, port).up(echo=console.print)
    console.print(f"[green]ready[/] bootstrap.servers={st.bootstrap} pid={st.pid} ({time.monotonic() - t0:.1f}s)")


@app.command()
@handle_errors
def down(ctx: typer.Context, data_dir: str | None = DATA_DIR, port: int | None = PORT) -> None:
    """Stop the broker that `up` started from this data directory (and nothing else)."""
    _local(ctx, data_dir, port).down(echo=console.print)


@app.command()
@handle_errors
def status(
    ctx: typer.Context,
    data_dir: str | None = DATA_DIR,
    port: int | None = PORT,
    as_json: bool = typer.Option(False, "--json", help="Machine-readable output."),
) -> None:
    """Is the local broker running and answering? Exit code 3 when it is not."""
    st = _local(ctx, data_dir, port).status()
    if as_json:
        console.print_json(json.dumps({**st.__dict__, "data_dir": str(st.data_dir)}))
    else:
        state = "[green]running[/]" if st.answering else ("[yellow]starting[/]" if st.running else "[red]stopped[/]")
        console.print(f"Kafka {state} bootstrap={st.bootstrap} pid={st.pid} data_dir={st.data_dir}")
    if not st.answering:
        raise typer.Exit(3)


@app.command()
@handle_errors
def logs(
    ctx: typer.Context,
    data_dir: str | None = DATA_DIR,
    port: int | None = PORT,
    lines: int = typer.Option(50, "-n", help="How many lines from the end."),
) -> None:
    """Print the end of the broker's logs."""
    console.print(_local(ctx, data_dir, port).log_tail(lines), markup=False, highlight=False)
