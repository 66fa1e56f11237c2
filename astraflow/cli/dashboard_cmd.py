"""`astraflow dashboard -e EXP`: a live local web page of a running experiment (astraflow.ops.dashboard)."""

from __future__ import annotations

import json
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

import typer

from astraflow.cli.common import console, handle_errors, load, serve_until_stopped

PAGE = Path(__file__).resolve().parent.parent / "ops" / "dashboard.html"


class DashboardServer:
    """Serves the page at / and the state at /api/state from a daemon thread."""

    def __init__(self, state: Any, addr: str = "127.0.0.1", port: int = 0) -> None:
        from astraflow.errors import ConfigError

        page = PAGE.read_bytes()

        class Handler(BaseHTTPRequestHandler):
            def do_GET(self) -> None:
                if self.path in ("/", "/index.html"):
                    body, kind = page, "text/html; charset=utf-8"
                elif self.path.split("?")[0] == "/api/state":
                    body, kind = json.dumps(state.snapshot()).encode(), "application/json"
                else:
                    self.send_error(404)
                    return
                self.send_response(200)
                self.send_header("Content-Type", kind)
                self.send_header("Content-Length", str(len(body)))
                self.send_header("Cache-Control", "no-store")
                self.end_headers()
                self.wfile.write(body)

            def log_message(self, *args: Any) -> None:  # polled every 2 s: not worth a line each
                pass

        try:
            self.httpd = ThreadingHTTPServer((addr, port), Handler)
        except OSError as exc:
            raise ConfigError(f"cannot serve the dashboard on {addr}:{port}: {exc} (choose another --port)") from exc
        self.httpd.daemon_threads = True
        self.addr, self.port = addr, int(self.httpd.server_address[1])
        self.thread = threading.Thread(target=self.httpd.serve_forever, name="astraflow-dashboard-http", daemon=True)
        self.thread.start()

    @property
    def url(self) -> str:
        return f"http://{self.addr}:{self.port}/"

    def close(self) -> None:
        self.httpd.shutdown()
        self.httpd.server_close()


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
    from astraflow.ops.dashboard import DashboardState

    cfg = load(ctx)
    state = DashboardState(cfg.kafka, experiment, interval_s=interval, window_s=max(10.0, 5 * interval)).start()
    server = DashboardServer(state, addr, port)
    console.print(f"dashboard of {experiment}: {server.url} (Ctrl-C stops it)")
    serve_until_stopped(server.close, state.stop)


def register(app: typer.Typer) -> None:
    app.command("dashboard")(dashboard)
