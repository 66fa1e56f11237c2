"""The live page of one experiment (`astraflow dashboard -e EXP`): what it shows, as JSON.

`DashboardState` refreshes an `astraflow status` report every `interval_s` and turns it into the
page's model (`snapshot()`):

- **graph**: roles and topics as nodes; an edge role -> topic for what a role writes (the topic's
  write rate) and topic -> role for what it reads (the rate, and the lag of its consumer group);
- **nodes**: every RaaS node with the version of each policy it serves;
- **policies**: published version, trainer step, loss;
- **curves**: mean reward of recent scored trajectories per refresh, and held-out success per
  evaluated version (the evaluator's `eval_success` metric);
- **dlq**: records and the latest reasons.

The page (`astraflow/ops/dashboard.html`) polls `/api/state` and redraws; the server
(`DashboardServer`, started by `astraflow dashboard`) binds to 127.0.0.1 unless told otherwise.
"""

from __future__ import annotations

import json
import threading
import time
from collections import deque
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

from astraflow.config import KafkaSettings
from astraflow.errors import AstraflowError, ConfigError
from astraflow.kafka.topics import Topics
from astraflow.ops.cluster_offsets import OffsetReader
from astraflow.ops.status import StatusReport, collect_status

ROLES = ("curator", "raas", "reward", "curate", "trainer", "archive")
# (role, stream, direction, consumer group suffix): direction "w" = role writes, "r" = role reads.
FLOWS = (
    ("curator", "tasks", "w", None), ("raas", "tasks", "r", "raas"), ("raas", "rollouts", "w", None),
    ("reward", "rollouts", "r", "reward"), ("reward", "scored", "w", None), ("curate", "scored", "r", "curate"),
    ("curate", "train", "w", None), ("trainer", "train", "r", "trainer"), ("trainer", "policies", "w", None),
    ("archive", "rollouts", "r", "archive"), ("archive", "scored", "r", "archive"),
)
SIDE_STREAMS = ("dlq", "lineage", "metrics")


def _stream_of(stream: str) -> str:
    """`solver.train` -> `train`: the graph draws one train node for every policy."""
    return stream.rsplit(".", 1)[-1] if stream.endswith((".train", ".weights")) else stream


def graph(r: StatusReport) -> dict[str, Any]:
    """Nodes and edges with rates (records/s) and lags (records)."""
    rates: dict[str, float] = {}
    records: dict[str, int] = {}
    for t in r.topics:
        s = _stream_of(t.stream)
        rates[s] = rates.get(s, 0.0) + t.rate_per_s
        records[s] = records.get(s, 0) + t.records
    lag: dict[tuple[str, str], int] = {}
    pre = Topics(r.experiment).prefix
    for g in r.lags:
        suffix = g.group.removeprefix(pre)
        role = "trainer" if suffix.endswith(".trainer") else "archive" if suffix.startswith("archive") else suffix
        stream = _stream_of(g.topic.removeprefix(pre))
        lag[(role, stream)] = lag.get((role, stream), 0) + g.lag
    streams = sorted({s for _, s, _, _ in FLOWS} | set(SIDE_STREAMS))
    nodes = [{"id": f"role:{x}", "kind": "role", "label": x} for x in ROLES]
    nodes += [{"id": f"topic:{s}", "kind": "topic", "label": s, "records": records.get(s, 0),
               "rate": round(rates.get(s, 0.0), 3)} for s in streams]
    edges = []
    for role, stream, direction, _ in FLOWS:
        src, dst = (f"role:{role}", f"topic:{stream}") if direction == "w" else (f"topic:{stream}", f"role:{role}")
        edge = {"from": src, "to": dst, "rate": round(rates.get(stream, 0.0), 3)}
        if direction == "r":
            edge["lag"] = lag.get((role, stream))
        edges.append(edge)
    return {"nodes": nodes, "edges": edges}


class DashboardState:
    """The latest snapshot of one experiment, refreshed in a thread; curves kept in memory."""

    def __init__(self, kafka: KafkaSettings, experiment: str, interval_s: float = 2.0, history: int = 600,
                 **status_kw: Any) -> None:
        self.kafka, self.experiment, self.interval_s, self.status_kw = kafka, experiment, interval_s, status_kw
        self.reward: deque[tuple[int, float]] = deque(maxlen=history)
        self.heldout: dict[int, float] = {}  # version -> eval_success
        self._snapshot: dict[str, Any] = {"experiment": experiment, "ok": False, "error": "starting"}
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._reader: OffsetReader | None = None

    def refresh(self) -> dict[str, Any]:
        try:
            if self._reader is None:  # kept: its record counts grow with the topics (astraflow.kafka.counts)
                self._reader = OffsetReader(self.kafka)
            r = collect_status(self.kafka, self.experiment, reader=self._reader, **self.status_kw)
        except AstraflowError as exc:  # Kafka away or no topics yet: the page says so and keeps polling
            with self._lock:
                self._snapshot = {**self._snapshot, "ok": False, "error": str(exc)}
            return self._snapshot
        if r.reward.mean is not None:
            self.reward.append((r.taken_at, round(r.reward.mean, 4)))
        for m in r.metrics:
            if m.component == "eval" and m.name == "eval_success" and m.labels.get("version", "").isdigit():
                self.heldout[int(m.labels["version"])] = round(m.value, 4)
        snap = {
            "experiment": self.experiment, "ok": True, "error": None, "taken_at": r.taken_at,
            "graph": graph(r),
            "nodes": [{"node_id": n.node_id, "region": n.region, "hardware": n.hardware, "versions": n.versions,
                       "rollouts_per_s": round(n.rollouts_per_s, 3), "last_seen_s": round(n.last_seen_s, 1)} for n in r.nodes],
            "policies": [{"policy": p.policy, "version": p.version, "trainer_step": p.trainer_step,
                          "loss": p.trainer.get("loss")} for p in r.policies],
            "reward": {"mean": r.reward.mean, "samples": r.reward.samples},
            "staleness": {"mean": r.staleness.mean, "max": r.staleness.max},
            "curves": {"reward": list(self.reward), "heldout": sorted(self.heldout.items())},
            "dlq": {"records": r.dlq.records, "recent": r.dlq.recent[:10]},
        }
        with self._lock:
            self._snapshot = snap
        return snap

    def snapshot(self) -> dict[str, Any]:
        with self._lock:
            return dict(self._snapshot)

    def start(self) -> DashboardState:
        self._thread = threading.Thread(target=self._run, name="astraflow-dashboard", daemon=True)
        self._thread.start()
        return self

    def _run(self) -> None:
        while not self._stop.is_set():
            t0 = time.monotonic()
            self.refresh()
            self._stop.wait(max(0.0, self.interval_s - (time.monotonic() - t0)))

    def stop(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=30)


PAGE = Path(__file__).resolve().parent / "dashboard.html"


class DashboardServer:
    """Serves the page at / and the state at /api/state from a daemon thread."""

    def __init__(self, state: Any, addr: str = "127.0.0.1", port: int = 0) -> None:
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
