"""Prometheus metrics: every role serves its own endpoint, and a bridge serves what Kafka knows.

Every AstraFlow component publishes `Metric` records to `af.<exp>.metrics`; that topic is the
source of truth and feeds `astraflow status`. Prometheus wants to scrape HTTP, so:

- **Each role's own endpoint** (`serve_role`): RaaS nodes, the trainer, the stream apps (curator,
  reward, curate, user processors), the archive and the evaluator serve the latest value of
  every `Metric` they produce, plus `astraflow_role_up` and the process' CPU, memory and GC.
  Opt-in: nothing listens unless `ASTRAFLOW_METRICS_PORT` is set; it binds to 127.0.0.1 unless
  `ASTRAFLOW_METRICS_ADDR` says otherwise (the endpoint has no authentication, so exposing it
  to a network is a deliberate choice; compose sets 0.0.0.0 inside its containers).
- **`MetricsBridge`** (`astraflow metrics serve`): what only Kafka knows, one per experiment:
  lag per consumer group, topic sizes and rates, published versions, staleness and reward of
  recent scored trajectories, the DLQ.

One naming rule for every role: the series of a `Metric` named `n` is `astraflow_<n>` (dots as
underscores) with labels `experiment`, `component` (the role), `process` (its instance) and the
record's own labels (volatile ones such as `step` dropped). The same counter has the same name
in every role: `astraflow_records_in_total{component="curate"}` and `{component="reward"}`.
docs/metrics.md has the table.
"""

from __future__ import annotations

import logging
import os
import re
import threading
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from typing import Any

from prometheus_client import REGISTRY, CollectorRegistry, start_http_server
from prometheus_client.core import GaugeMetricFamily
from prometheus_client.registry import Collector

from astraflow.config import KafkaSettings
from astraflow.errors import AstraflowError, ConfigError
from astraflow.ops.status import VOLATILE_LABELS, MetricSeries, StatusReport, collect_status
from astraflow.records import Metric

log = logging.getLogger("astraflow.metrics")

PORT_ENV = "ASTRAFLOW_METRICS_PORT"
ADDR_ENV = "ASTRAFLOW_METRICS_ADDR"
DEFAULT_ADDR = "127.0.0.1"  # loopback only unless configured otherwise
_BAD = re.compile(r"[^a-zA-Z0-9_]")
_RESERVED = frozenset({"experiment", "component", "process"})
# Labels that change with every record (a step, a version): a new Prometheus series each time, so
# dropped; the gauge keeps the latest value.
PROM_VOLATILE = VOLATILE_LABELS | {"version"}


def prom_name(name: str) -> str:
    """`astraflow_<name>` in Prometheus' alphabet (`trainer.loss` -> `astraflow_trainer_loss`)."""
    return re.sub(r"_+", "_", _BAD.sub("_", f"astraflow_{name}"))


def prom_label(key: str) -> str:
    key = _BAD.sub("_", key) or "label"
    if key[0].isdigit() or key.startswith("__") or key in _RESERVED:
        key = f"label_{key.lstrip('_')}"
    return key


def series_families(series: Iterable[MetricSeries], experiment: str = "") -> list[GaugeMetricFamily]:
    """One gauge family per metric name; label sets are unioned within a family (missing -> "")."""
    grouped: dict[str, list[tuple[dict[str, str], float]]] = {}
    for s in series:
        labels = {"experiment": experiment or s.labels.get("experiment", ""), "component": s.component, "process": s.instance}
        labels.update({prom_label(k): v for k, v in s.labels.items() if k not in PROM_VOLATILE and k != "experiment"})
        grouped.setdefault(prom_name(s.name), []).append((labels, s.value))
    out = []
    for name, samples in sorted(grouped.items()):
        keys = sorted({k for labels, _ in samples for k in labels})
        fam = GaugeMetricFamily(name, f"latest {name} reported by the role", labels=keys)
        seen: set[tuple[str, ...]] = set()
        for labels, value in samples:
            values = tuple(labels.get(k, "") for k in keys)
            if values not in seen:  # two series that only differed in characters Prometheus rejects
                seen.add(values)
                fam.add_metric(list(values), value)
        out.append(fam)
    return out


def _gauge(name: str, doc: str, labels: list[str], rows: Iterable[tuple[list[str], float | None]]) -> GaugeMetricFamily:
    fam = GaugeMetricFamily(name, doc, labels=labels)
    for values, value in rows:
        if value is not None:
            fam.add_metric(values, float(value))
    return fam


def report_families(r: StatusReport) -> list[GaugeMetricFamily]:
    """What `astraflow status` measures, as gauges."""
    e = r.experiment
    st, rw = r.staleness, r.reward
    return [
        _gauge("astraflow_topic_records", "committed records stored in the topic (what a consumer reads)", ["experiment", "stream"],
               (([e, t.stream], t.records) for t in r.topics)),
        _gauge("astraflow_topic_end_offset", "high watermarks summed: offsets, transaction markers included (not a record count)", ["experiment", "stream"],
               (([e, t.stream], t.end_offset) for t in r.topics)),
        _gauge("astraflow_topic_rate_per_second", "records written per second over the status window",
               ["experiment", "stream"], (([e, t.stream], t.rate_per_s) for t in r.topics)),
        _gauge("astraflow_consumer_lag", "records not yet committed by the group (transaction markers left out)", ["experiment", "group", "topic"],
               (([e, g.group, g.topic], g.lag) for g in r.lags)),
        _gauge("astraflow_consumer_group_members", "consumers in the group", ["experiment", "group"],
               (([e, g], m) for g, m in {g.group: g.members for g in r.lags}.items())),
        _gauge("astraflow_published_version", "latest published version (policies topic)", ["experiment", "policy"],
               (([e, p.policy], p.version) for p in r.policies)),
        _gauge("astraflow_published_step", "trainer step of the latest published version", ["experiment", "policy"],
               (([e, p.policy], p.trainer_step) for p in r.policies)),
        _gauge("astraflow_raas_nodes", "RaaS nodes that reported metrics recently", ["experiment"], [([e], len(r.nodes))]),
        _gauge("astraflow_scored_staleness_mean", "mean versions behind over recent scored trajectories", ["experiment"],
               [([e], st.mean)]),
        _gauge("astraflow_scored_staleness_max", "max versions behind over recent scored trajectories", ["experiment"],
               [([e], st.max)]),
        _gauge("astraflow_scored_reward_mean", "mean reward over recent scored trajectories", ["experiment"], [([e], rw.mean)]),
        _gauge("astraflow_dlq_records", "records in the dead-letter topic", ["experiment"], [([e], r.dlq.records)]),
        _gauge("astraflow_region_rollouts_per_second", "rollouts/s of the RaaS nodes of a region", ["experiment", "region"],
               (([e, g.region], g.rollouts_per_s) for g in r.regions)),
        _gauge("astraflow_region_version_lag", "newest published version minus the oldest a node of the region serves",
               ["experiment", "region"], (([e, g.region], g.version_lag) for g in r.regions)),
        *_autoscale(e, r),
    ]


def _autoscale(e: str, r: StatusReport) -> list[GaugeMetricFamily]:
    """The RaaS autoscaling signal (`astraflow.ops.scaling`: the rule is in its module doc)."""
    a = r.autoscale
    if a is None:
        return []
    return [
        _gauge("astraflow_autoscale_task_lag", "tasks issued and not yet finished by a RaaS node", ["experiment"],
               [([e], a.task_lag)]),
        _gauge("astraflow_autoscale_backlog_s", "task lag divided by the tasks written per second", ["experiment"],
               [([e], a.backlog_s)]),
        _gauge("astraflow_autoscale_desired_nodes_delta", "RaaS nodes to add (>0) or remove (<0) by the rule",
               ["experiment"], [([e], a.desired_delta)]),
    ]


class ProcessMetrics(Collector):
    """Latest value of each `Metric` a process observes; register it in the registry it serves.

    With a `component`, it also serves `astraflow_role_up{experiment,component,process} 1` from
    the start, so Prometheus sees the role before its first metrics interval ends."""

    def __init__(self, experiment: str = "", component: str = "", process: str = "") -> None:
        self.experiment, self.component, self.process = experiment, component, process
        self._latest: dict[tuple, MetricSeries] = {}
        self._lock = threading.Lock()

    def observe(self, *metrics: Metric) -> None:
        with self._lock:
            for m in metrics:
                key = (m.component, m.instance, m.name, tuple(sorted((k, v) for k, v in m.labels.items() if k not in PROM_VOLATILE)))
                old = self._latest.get(key)
                if old is None or m.ts >= old.ts:
                    self._latest[key] = MetricSeries(m.component, m.instance, m.name, m.value, dict(m.labels), m.ts)

    def collect(self) -> Iterator[GaugeMetricFamily]:
        with self._lock:
            series = list(self._latest.values())
        if self.component:
            yield _gauge("astraflow_role_up", "1 while the role's process runs", ["experiment", "component", "process"],
                         [([self.experiment, self.component, self.process], 1.0)])
        yield from series_families(series, self.experiment)


@dataclass
class MetricsServer:
    """A running /metrics endpoint; `port` is the bound one (useful when asked for port 0)."""

    addr: str
    port: int
    _httpd: object
    _thread: threading.Thread

    def close(self) -> None:
        self._httpd.shutdown()  # type: ignore[attr-defined]
        self._httpd.server_close()  # type: ignore[attr-defined]
        self._thread.join(timeout=5)


def start_metrics_server(port: int, addr: str = DEFAULT_ADDR, registry: CollectorRegistry = REGISTRY) -> MetricsServer:
    """Serves `registry` on http://addr:port/metrics from a daemon thread. Port 0 picks a free port."""
    try:
        httpd, thread = start_http_server(port, addr=addr, registry=registry)
    except OSError as exc:
        raise ConfigError(f"cannot serve Prometheus metrics on {addr}:{port}: {exc} (choose another port)") from exc
    return MetricsServer(addr, httpd.server_port, httpd, thread)


def start_from_env(env: dict[str, str] | None = None, registry: CollectorRegistry = REGISTRY) -> MetricsServer | None:
    """Starts the endpoint when `ASTRAFLOW_METRICS_PORT` is set (the opt-in for any process), on
    `ASTRAFLOW_METRICS_ADDR` (default 127.0.0.1; `0.0.0.0` exposes it to every network)."""
    env = os.environ if env is None else env
    value = env.get(PORT_ENV, "").strip()
    if not value:
        return None
    if not value.isdigit():
        raise ConfigError(f"{PORT_ENV}={value!r} must be a port number (or unset, to expose no metrics)")
    return start_metrics_server(int(value), env.get(ADDR_ENV, "").strip() or DEFAULT_ADDR, registry)


@dataclass(eq=False)
class RoleMetrics:
    """A role's own /metrics endpoint (`serve_role`): `observe` the Metrics it produces."""

    server: MetricsServer
    collector: ProcessMetrics

    @property
    def port(self) -> int:
        return self.server.port

    def observe(self, *metrics: Metric) -> None:
        self.collector.observe(*metrics)

    def close(self) -> None:
        self.server.close()


def serve_role(experiment: str, component: str, process: str, env: dict[str, str] | None = None) -> RoleMetrics | None:
    """The hook every role calls at start: when `ASTRAFLOW_METRICS_PORT` is set, serves the role's
    metrics (its `Metric`s, `astraflow_role_up`, process CPU/memory/GC) from a registry of its own."""
    from prometheus_client import GCCollector, PlatformCollector, ProcessCollector

    env = os.environ if env is None else env
    if not env.get(PORT_ENV, "").strip():
        return None
    registry = CollectorRegistry(auto_describe=True)
    ProcessCollector(registry=registry)
    PlatformCollector(registry=registry)
    GCCollector(registry=registry)
    collector = ProcessMetrics(experiment, component, process)
    registry.register(collector)
    server = start_from_env(env, registry)
    assert server is not None
    log.info("%s %s: Prometheus metrics on http://%s:%d/metrics", component, process, server.addr, server.port)
    return RoleMetrics(server, collector)


class MetricsBridge(Collector):
    """Refreshes a StatusReport of one experiment every `interval_s` and serves what Kafka knows as
    gauges (the roles' own series come from their own endpoints, `serve_role`)."""

    def __init__(self, kafka: KafkaSettings, experiment: str, interval_s: float = 15.0, **status_kw: object) -> None:
        self.kafka, self.experiment, self.interval_s, self.status_kw = kafka, experiment, interval_s, status_kw
        self._reader: Any = None
        self.report: StatusReport | None = None
        self.refreshes = 0
        self.last_error: str | None = None
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def refresh(self) -> StatusReport | None:
        try:
            if self._reader is None:  # kept: its record counts grow with the topics (astraflow.kafka.counts)
                from astraflow.ops.cluster_offsets import OffsetReader

                self._reader = OffsetReader(self.kafka)
            self.report = collect_status(self.kafka, self.experiment, reader=self._reader,  # type: ignore[arg-type]
                                         **self.status_kw)
            self.last_error = None
        except AstraflowError as exc:  # Kafka away or topics not created yet: keep serving, say why
            self.last_error = str(exc)
            log.warning("metrics bridge: %s", exc)
        self.refreshes += 1
        return self.report

    def start(self) -> MetricsBridge:
        self.refresh()
        self._thread = threading.Thread(target=self._run, name="astraflow-metrics-bridge", daemon=True)
        self._thread.start()
        return self

    def _run(self) -> None:
        while not self._stop.wait(self.interval_s):
            self.refresh()

    def stop(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=self.interval_s + 30)
        if self._reader is not None:  # its record counter's consumer
            self._reader.close()

    def collect(self) -> Iterator[GaugeMetricFamily]:
        yield _gauge("astraflow_status_up", "1 if the last refresh of the experiment's status succeeded",
                     ["experiment"], [([self.experiment], 0.0 if self.last_error else 1.0)])
        r = self.report
        if r is None:
            return
        yield from report_families(r)
