"""`astraflow dashboard -e EXP`: a live local web page of a running experiment (astraflow.ops.dashboard)."""

from __future__ import annotations

import typer

from astraflow_cli.common import console, handle_errors, load, serve_until_stopped


@handle_errors
def dashboard(
    ctx: typer.Context,
    experiment: str = typer.Option(..., "--experiment", "-e", help="Experiment name (topics are af.<experiment>.*)."),
    port: int = typer.Option(8787, "--port", help="Serve http://ADDR:PORT/ (0 picks a free port)."),
    addr: str = typer.Option("127.0.0.1", "--addr", help="Address to listen on (0.0.0.0: every network; the page has no authentication)."),
    interval: float = typer.Option(2.0, "--interval", help="Seconds between refreshes from the topics."),
) -> None:
    """Serve a live page of the experiment: the dataflow graph with rates and lag, versions per
    node, reward and held-out curves, the DLQ's latest reasons. Ctrl-C stops it."""
    from astraflow.ops.dashboard import DashboardServer, DashboardState

    cfg = load(ctx)
    state = DashboardState(cfg.kafka, experiment, interval_s=interval, window_s=max(10.0, 5 * interval)).start()
    server = DashboardServer(state, addr, port)
    console.print(f"dashboard of {experiment}: {server.url} (Ctrl-C stops it)")
    serve_until_stopped(server.close, state.stop)


def register(app: typer.Typer) -> None:
    app.command("dashboard")(dashboard)
