"""`astraflow registry up | down | status`: a Confluent-API schema registry (Apicurio) on this machine;
`astraflow registry bundle DIR`: the build context of the compose stack's registry image."""

from __future__ import annotations

import time
from pathlib import Path
from typing import TYPE_CHECKING

import typer

from astraflow_cli.common import console, handle_errors, load

if TYPE_CHECKING:
    from astraflow.local_registry import LocalRegistry

app = typer.Typer(help="Run a schema registry (Apicurio Registry, Confluent-compatible API) locally without Docker, or stage its compose image.",
                  no_args_is_help=True)

DATA_DIR = typer.Option(None, "--data-dir", help="Where its database (the schemas and their ids), log and pid file live.")
PORT = typer.Option(None, "--port", help="HTTP port on 127.0.0.1 (default 18081).")


def _local(ctx: typer.Context, data_dir: str | None, port: int | None) -> LocalRegistry:
    from astraflow.local_registry import LocalRegistry

    overrides = [f"local_registry.data_dir={data_dir}" if data_dir else "", f"local_registry.port={port}" if port else ""]
    return LocalRegistry(load(ctx, *overrides).local_registry)


@app.command()
@handle_errors
def up(ctx: typer.Context, data_dir: str | None = DATA_DIR, port: int | None = PORT) -> None:
    """Resolve Apicurio from Maven Central (first run), start it and wait until its API answers."""
    t0 = time.monotonic()
    st = _local(ctx, data_dir, port).up(echo=console.print)
    console.print(f"[green]ready[/] kafka.schema_registry_url={st.url} pid={st.pid} ({time.monotonic() - t0:.1f}s)")


@app.command()
@handle_errors
def down(ctx: typer.Context, data_dir: str | None = DATA_DIR, port: int | None = PORT) -> None:
    """Stop the registry `up` started from this data directory (and nothing else)."""
    _local(ctx, data_dir, port).down(echo=console.print)


@app.command()
@handle_errors
def status(ctx: typer.Context, data_dir: str | None = DATA_DIR, port: int | None = PORT) -> None:
    """Whether the registry runs and answers; exit code 1 when it does not."""
    st = _local(ctx, data_dir, port).status()
    if st.running and st.answering:
        console.print(f"[green]up[/] {st.url} pid={st.pid} schemas={st.database}")
        return
    if st.running:
        console.print(f"[yellow]starting or stuck[/]: pid {st.pid} runs but {st.url} does not answer; log: {st.log}")
    else:
        kept = f"; its schemas are kept in {st.database}" if st.database.exists() else ""
        console.print(f"[red]down[/]: no schema registry runs at {st.url}{kept}; start one with `astraflow registry up` "
                      "(roles with kafka.schema_registry_url set wait for it at start-up)")
    raise typer.Exit(1)


@app.command()
@handle_errors
def bundle(ctx: typer.Context, out: Path = typer.Argument(..., help="The folder to write (dist/ and java/).")) -> None:
    """Stage the compose registry image's build context: Apicurio's application and a jlinked Java 21+ runtime."""
    from astraflow.registry_image import bundle as stage

    t0 = time.monotonic()
    path = stage(out, load(ctx).local_registry, echo=console.print)
    console.print(f"[green]staged[/] {path} ({time.monotonic() - t0:.1f}s): "
                  f"docker build -f docker/registry/Dockerfile {path}")
