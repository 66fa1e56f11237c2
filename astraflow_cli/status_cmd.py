"""`astraflow status` (what an experiment is doing) and `astraflow metrics serve` (the same, for Prometheus)."""

from __future__ import annotations

import json
import time
from typing import TYPE_CHECKING

import typer

from astraflow_cli.common import console, err_console, handle_errors, load, serve_until_stopped

if TYPE_CHECKING:
    from astraflow.ops.status import StatusReport

metrics_app = typer.Typer(help="Prometheus metrics of a running experiment.", no_args_is_help=True)

EXPERIMENT = typer.Option(..., "--experiment", "-e", help="Experiment name (topics are af.<experiment>.*).")
WINDOW = typer.Option(60.0, "--window", help="Topic rates are records written in the last this-many seconds, per second.")
RECENT = typer.Option(256, "--recent", help="Scored trajectories that reward and staleness are computed over.")


@handle_errors
def status(
    ctx: typer.Context,
    experiment: str = EXPERIMENT,
    watch: bool = typer.Option(False, "--watch", "-w", help="Refresh every --interval seconds until Ctrl-C."),
    interval: float = typer.Option(5.0, "--interval", help="Seconds between refreshes with --watch."),
    as_json: bool = typer.Option(False, "--json", help="Print JSON (one object per refresh with --watch)."),
    window: float = WINDOW,
    recent: int = RECENT,
) -> None:
    """Topics (records a consumer reads, and rates), consumer lag per group, stream apps and user
    processors (records in, out, dead-lettered), RaaS nodes, policy versions and trainers,
    staleness, recent reward and the DLQ of one experiment, read from its topics."""
    from astraflow.ops.cluster_offsets import OffsetReader
    from astraflow.ops.render import render_status
    from astraflow.ops.status import collect_status

    cfg = load(ctx)
    reader = OffsetReader(cfg.kafka)

    def take() -> StatusReport:
        return collect_status(cfg.kafka, experiment, window_s=window, recent=recent, reader=reader)

    def emit_json(report: StatusReport) -> None:
        # Plain stdout, not Rich: machines get exact JSON (one line per refresh when watching).
        typer.echo(json.dumps(report.to_json(), default=str, indent=None if watch else 2))

    if not watch:
        report = take()
        if as_json:
            emit_json(report)
        else:
            console.print(render_status(report))
        return
    try:
        if as_json:
            while True:
                started = time.monotonic()
                emit_json(take())
                time.sleep(max(0.0, interval - (time.monotonic() - started)))
        if not console.is_terminal:  # a pipe or a file: one full report per refresh, flushed
            while True:
                started = time.monotonic()
                console.print(render_status(take()))
                console.rule()
                console.file.flush()
                time.sleep(max(0.0, interval - (time.monotonic() - started)))
        from rich.live import Live

        with Live(render_status(take()), console=console, refresh_per_second=2) as live:
            while True:
                time.sleep(interval)
                live.update(render_status(take()))
    except (KeyboardInterrupt, BrokenPipeError):
        pass
    finally:
        reader.close()


@metrics_app.command("serve")
@handle_errors
def serve(
    ctx: typer.Context,
    experiment: str = EXPERIMENT,
    port: int = typer.Option(9464, "--port", help="Serve http://ADDR:PORT/metrics (0 picks a free port)."),
    addr: str = typer.Option("127.0.0.1", "--addr", help="Address to listen on (0.0.0.0: every network; the endpoint has no authentication)."),
    interval: float = typer.Option(15.0, "--interval", help="Seconds between refreshes of the experiment's status."),
    window: float = WINDOW,
    recent: int = RECENT,
) -> None:
    """Serve what only Kafka knows of an experiment (lag, topic rates, published versions, staleness,
    reward, DLQ) as Prometheus gauges until Ctrl-C / SIGTERM; each role serves its own series
    (ASTRAFLOW_METRICS_PORT, docs/metrics.md)."""
    from prometheus_client import CollectorRegistry

    from astraflow.metrics_export import MetricsBridge, start_metrics_server

    cfg = load(ctx)
    bridge = MetricsBridge(cfg.kafka, experiment, interval, window_s=window, recent=recent)
    registry = CollectorRegistry()
    registry.register(bridge)
    bridge.start()
    server = start_metrics_server(port, addr, registry)
    console.print(f"serving metrics of {experiment} on http://{addr}:{server.port}/metrics (refresh every {interval:.0f}s)")
    if bridge.last_error:
        err_console.print(f"[yellow]not yet:[/] {bridge.last_error}; retrying every {interval:.0f}s")
    serve_until_stopped(server.close, bridge.stop, sigterm=True)  # `docker stop`: close the port cleanly


def register(app: typer.Typer) -> None:
    """Adds `status` and `metrics` to the root command."""
    app.command("status")(status)
    app.add_typer(metrics_app, name="metrics")
