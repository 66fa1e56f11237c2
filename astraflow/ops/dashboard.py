"""The live page of one experiment (`astraflow dashboard -e EXP`): what it shows, as JSON.

`DashboardState` refreshes an `astraflow status` report every `interval_s` and turns it into the
page's model (`snapshot()`):

- **graph**: roles, user processors and topics as nodes; an edge role -> topic for what a role
  writes (the topic's write rate) and topic -> role for what it reads (the rate, and the lag of
  its consumer group), drawn only where it exists (`graph`); counts are records, not offsets;
- **nodes**: every RaaS node with the version of each policy it serves;
- **policies**: published version, trainer step, loss;
- **curves**: mean reward of recent scored trajectories per refresh, and held-out success per
  evaluated version (the evaluator's `eval_success` metric);
- **apps**: stream apps and user processors: records in, out, dead-lettered, their streams;
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
from astraflow.processor import COMPONENT_PREFIX

ROLES = ("curator", "raas", "reward", "curate", "trainer", "archive")
# (role, stream, direction, consumer group suffix): direction "w" = role writes, "r" = role reads.
FLOWS = (
    ("curator", "tasks", "w", None), ("raas", "tasks", "r", "raas"), ("raas", "rollouts", "w", None),
    ("reward", "rollouts", "r", "reward"), ("reward", "scored", "w", None), ("curate", "scored", "r", "curate"),
    ("curate", "train", "w", None), ("trainer", "train", "r", "trainer"), ("trainer", "policies", "w", None),
    ("archive", "rollouts", "r", "archive"), ("archive", "scored", "r", "archive"),
)
SIDE_STREAMS = ("dlq", "lineage", "metrics")
BUILTIN_STREAMS = frozenset({s for _, s, _, _ in FLOWS} | set(SIDE_STREAMS) | {"feedback", "control", "weights"})


def _stream_of(stream: str) -> str:
    """`solver.train` -> `train`: the graph draws one train node for every policy."""
    return stream.rsplit(".", 1)[-1] if stream.endswith((".train", ".weights")) else stream


def _role_of(group_suffix: str) -> str:
    """The role a consumer group `af.<experiment>.<suffix>` belongs to."""
    if group_suffix.endswith(".trainer"):
        return "trainer"
    return "archive" if group_suffix.startswith("archive") else group_suffix


def graph(r: StatusReport) -> dict[str, Any]:
    """Nodes and edges with rates (records/s) and lags (records): only what exists. A read edge is a
    consumer group of the experiment on the topic; a write edge a role that reported metrics (or
    whose topic holds records); user processors (`proc.<name>`) are drawn between their source
    (their group) and their sink (their metrics' labels), with the topics they made."""
    pre = Topics(r.experiment).prefix
    rates: dict[str, float] = {}
    records: dict[str, int] = {}
    for t in r.topics:
        if t.stream.endswith("-changelog") or "__" in t.stream or t.stream.startswith("tasks."):
            continue  # Faust's own topics and a region's tasks are not streams of the graph
        s = _stream_of(t.stream)
        rates[s] = rates.get(s, 0.0) + t.rate_per_s
        records[s] = records.get(s, 0) + t.records
    lag: dict[tuple[str, str], int] = {}
    for g in r.lags:
        role, stream = _role_of(g.group.removeprefix(pre)), _stream_of(g.topic.removeprefix(pre))
        lag[(role, stream)] = lag.get((role, stream), 0) + g.lag
    reporting = {s.component for s in r.metrics} | ({"raas"} if r.nodes else set())
    edges: list[dict[str, Any]] = []
    for role, stream, direction, _ in FLOWS:
        if direction == "r" and (role, stream) not in lag:
            continue
        if direction == "w" and role not in reporting and not records.get(stream):
            continue
        src, dst = (f"role:{role}", f"topic:{stream}") if direction == "w" else (f"topic:{stream}", f"role:{role}")
        edge: dict[str, Any] = {"from": src, "to": dst, "rate": round(rates.get(stream, 0.0), 3)}
        if direction == "r":
            edge["lag"] = lag[(role, stream)]
        edges.append(edge)
    processors = sorted({a.component for a in r.apps if a.component.startswith(COMPONENT_PREFIX)}
                        | {role for role, _ in lag if role.startswith(COMPONENT_PREFIX)})
    by_name = {a.component: a for a in r.apps}
    for proc in processors:
        for (role, stream), n in sorted(lag.items()):
            if role == proc:
                edges.append({"from": f"topic:{stream}", "to": f"role:{proc}", "rate": round(rates.get(stream, 0.0), 3),
                              "lag": n})
        sink = by_name[proc].sink.removeprefix(pre) if proc in by_name else ""
        if sink and sink in records:
            edges.append({"from": f"role:{proc}", "to": f"topic:{sink}", "rate": round(rates.get(sink, 0.0), 3)})
    used = {e["from"] for e in edges} | {e["to"] for e in edges}
    nodes = [{"id": f"role:{x}", "kind": "role", "label": x} for x in (*ROLES, *processors) if f"role:{x}" in used]
    for proc in processors:
        if f"role:{proc}" not in used:  # reported, but neither its group nor its sink is known yet
            nodes.append({"id": f"role:{proc}", "kind": "role", "label": proc})
    custom = sorted(s for s in records if s not in BUILTIN_STREAMS)
    streams = [s for s in sorted(BUILTIN_STREAMS) if f"topic:{s}" in used or s in SIDE_STREAMS] + custom
    nodes += [{"id": f"topic:{s}", "kind": "topic", "label": s, "records": records.get(s, 0),
               "rate": round(rates.get(s, 0.0), 3), "custom": s in custom} for s in streams if s in records]
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
            "unverified": [{"component": m.component, "instance": m.instance, "name": m.name, "value": m.value}
                           for m in r.unverified],
            "policies": [{"policy": p.policy, "version": p.version, "trainer_step": p.trainer_step,
                          "loss": p.trainer.get("loss")} for p in r.policies],
            "reward": {"mean": r.reward.mean, "samples": r.reward.samples},
            "staleness": {"mean": r.staleness.mean, "max": r.staleness.max},
            "curves": {"reward": list(self.reward), "heldout": sorted(self.heldout.items())},
            "dlq": {"records": r.dlq.records, "recent": r.dlq.recent[:10]},
            "apps": [{"component": a.component, "workers": a.workers, "in": a.records_in, "out": a.records_out,
                      "dead_lettered": a.dead_lettered, "dropped": a.dropped, "in_per_s": a.in_per_s,
                      "source": a.source, "sink": a.sink, "last_seen_s": round(a.last_seen_s, 1)} for a in r.apps],
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
        if self._reader is not None:  # its record counter's consumer
            self._reader.close()


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
