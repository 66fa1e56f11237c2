"""Counters every stream worker keeps, and their publication as `Metric` records.

Every `interval` seconds a worker publishes to the experiment's `metrics` topic (component =
the app name, instance = the worker's id): `records_in_per_s`, `records_out_per_s` (rates
over the interval), `records_in_total`, `records_out_total`, `dead_lettered_total` (label
`reason` = error class), `dropped_total` (label `reason`: which filter or rule dropped it), and
whatever gauges the app reports (`inflight`, `groups_pending`, `tasks_ahead`, ...).
"""

from __future__ import annotations

import time
from collections import Counter
from dataclasses import dataclass, field

from astraflow.records import Metric


@dataclass
class WorkerStats:
    """What a worker did so far (monotonic counters) and when."""

    records_in: int = 0  # records taken from the source topics (decodable or not)
    records_out: int = 0  # records queued to sink topics (not counting DLQ and metrics)
    dead_lettered: Counter[str] = field(default_factory=Counter)  # error class -> records sent to the DLQ
    dropped: Counter[str] = field(default_factory=Counter)  # reason -> records dropped on purpose
    first_in_at: float | None = None  # monotonic time of the first record taken
    last_out_at: float | None = None  # monotonic time of the latest output queued
    commits: int = 0  # successful offset commits
    inflight_peak: int = 0  # most awaitables (slow records) that ran at once

    @property
    def dead_lettered_total(self) -> int:
        return sum(self.dead_lettered.values())

    @property
    def dropped_total(self) -> int:
        return sum(self.dropped.values())


class MetricsReporter:
    """Turns `WorkerStats` (and app gauges) into Metric records, with rates since the last report."""

    def __init__(self, component: str, instance: str, labels: dict[str, str] | None = None) -> None:
        self.component = component
        self.instance = instance
        self.labels = dict(labels or {})
        self._last_at = time.monotonic()
        self._last_in = 0
        self._last_out = 0

    def report(self, stats: WorkerStats, gauges: dict[str, float] | None = None) -> list[Metric]:
        now = time.monotonic()
        dt = max(now - self._last_at, 1e-6)
        out = [
            self._m("records_in_per_s", (stats.records_in - self._last_in) / dt),
            self._m("records_out_per_s", (stats.records_out - self._last_out) / dt),
            self._m("records_in_total", stats.records_in),
            self._m("records_out_total", stats.records_out),
            self._m("dead_lettered_total", stats.dead_lettered_total),
            self._m("dropped_total", stats.dropped_total),
        ]
        out += [self._m("dead_lettered_total", n, reason=r) for r, n in sorted(stats.dead_lettered.items())]
        out += [self._m("dropped_total", n, reason=r) for r, n in sorted(stats.dropped.items())]
        out += [self._m(name, value) for name, value in sorted((gauges or {}).items())]
        self._last_at, self._last_in, self._last_out = now, stats.records_in, stats.records_out
        return out

    def _m(self, name: str, value: float, **labels: str) -> Metric:
        return Metric(name, float(value), self.component, self.instance, {**self.labels, **labels})
