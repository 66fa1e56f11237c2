"""Which region's tasks topic the curator writes the next task to: shares that follow the fleet.

Pure policy (no Kafka; `stream_apps.curator` feeds it). Each region with a tasks topic of its
own (`--region-share`, a cluster fed by MirrorMaker 2) and region A (the experiment's `tasks`)
has nodes that publish their metrics every few seconds (`raas` metrics: `busy_tasks_per_s`,
`rollouts_per_s`, `inflight`, labelled with the node's region), which come back to region A's cluster.

* **Live nodes.** A node is live while its last metric is at most `dead_after_s` old (default
  15 s: three of the node's 5 s metric intervals).
* **Speed.** A node's speed is what it reports it does when busy: `busy_tasks_per_s`, tasks done
  per second of the time it had rollouts in flight (`astraflow.dataflow.placement.SpeedMeter`),
  an exponentially weighted mean (weight `SPEED_WEIGHT` per sample). A node fed less than it can
  do has idle time, which this speed leaves out: its share does not fall with its feed (a
  throughput would, and the share with it: a fixed point that starved a region whose tasks take
  longer to arrive). A node that never reported one counts at the mean speed of those that did;
  when none did, every live node counts as one task/s.
* **Capacity** of a region: the sum of its live nodes' speeds (tasks/s); **share**: its capacity
  over the sum. No live node: share 0. Before any node of a region was seen, the configured share
  holds (`prior`, from `--region-share`), rescaled against the measured regions, so that a start
  where metrics have not arrived yet issues as configured.
* **Transit.** A region's tasks spend time on the way that is no queue of its nodes: to its
  cluster (MirrorMaker 2) and, once done, their trajectories back. The curator sees the way back
  in every metric: read time minus the time the node wrote it (the median of a node's last
  `DELAY_SAMPLES`); a task's round trip is counted as twice that (both directions go through the
  same mirror), at most `TRANSIT_MAX_S`, averaged over the region's live nodes.
* **Reserve.** By Little's law a region needs capacity x transit tasks outstanding only for its
  nodes never to wait for the next one: its reserve. Together the reserves take at most
  `RESERVE_FRACTION` of the window (`--max-ahead`; scaled down alike beyond it), so the rest is
  shared by speed whatever a mirror's latency.
* **Next task** goes to the region where it would wait least beyond the way there and back: the
  smallest (outstanding + 1 - reserve) / share, outstanding being the tasks issued to the region
  whose trajectories have not all come back. Every region so first holds its reserve, and the
  rest of what is outstanding is split by speed: a region behind a mirror keeps its nodes fed,
  and a slow region holds no more than its share of the rest.
* **Limit.** A region never holds more than its reserve plus its share of the window: beyond the
  share of the rule above, so it only binds a region whose tasks stop coming back before it is
  known to be dark (or whose transit was misjudged), which so cannot soak up the window.
* **Dead region.** A region that had live nodes and has none, or has had none for `dead_after_s`
  since the curator started, is dead: its outstanding tasks are given back (re-issued to the
  live regions by the same rule, with the same group ids, not held by the limits: they already
  hold their slots), as long as some region is live. While no region is live (no node started
  yet, or the metrics cannot be read), the configured shares hold, without limits, and nothing is
  given back (`stream_apps.region_fleet`): the fleet's view can only move tasks between live
  regions, never stop the curator on its own.
"""

from __future__ import annotations

import math
import statistics
from collections import deque
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field

SPEED_WEIGHT = 0.3  # weight of a new sample in a node's speed
DELAY_SAMPLES = 5  # a node's way back is the median of its last metrics' delays (one late batch does not count)
TRANSIT_MAX_S = 30.0  # most round trip counted for a region (a stalled mirror does not make its reserve unbounded)
RESERVE_FRACTION = 0.5  # most of the window the regions' reserves take together


@dataclass
class NodeSeen:
    """What the curator knows of one node, from its metrics."""

    region: str
    last_seen: float  # monotonic seconds of its last metric (as written: a metric read late is no younger)
    speed: float | None = None  # tasks/s while busy, as it reports (None: never reported)
    delays: deque[float] = field(default_factory=lambda: deque(maxlen=DELAY_SAMPLES))  # s from write to read

    def observe(self, now: float, busy_tasks_per_s: float | None = None, delay_s: float | None = None) -> None:
        """A metric of this node: its `busy_tasks_per_s` when the record carried it, and how long
        the record took to reach the curator (None: not known, e.g. a record read at start)."""
        self.last_seen = max(self.last_seen, now)
        if delay_s is not None and math.isfinite(delay_s):  # untrusted (the node's clock): bounded
            self.delays.append(min(max(0.0, delay_s), TRANSIT_MAX_S / 2))
        if busy_tasks_per_s is None or not 0.0 < busy_tasks_per_s < 1e6:  # untrusted: ignore what no node reports
            return
        self.speed = busy_tasks_per_s if self.speed is None else (
            (1 - SPEED_WEIGHT) * self.speed + SPEED_WEIGHT * busy_tasks_per_s)

    @property
    def delay(self) -> float | None:
        """Its metrics' way to the curator (the median of the last ones), None before any."""
        return statistics.median(self.delays) if self.delays else None


def live_nodes(nodes: Iterable[NodeSeen], now: float, dead_after_s: float) -> list[NodeSeen]:
    """Nodes whose last metric is at most `dead_after_s` old."""
    return [n for n in nodes if now - n.last_seen <= dead_after_s]


def capacities(nodes: Iterable[NodeSeen], regions: Iterable[str], now: float, dead_after_s: float) -> dict[str, float]:
    """Each region's capacity: the sum of its live nodes' speeds (see the module doc)."""
    live = [n for n in live_nodes(nodes, now, dead_after_s)]
    known = [n.speed for n in live if n.speed is not None and n.speed > 0]
    default = sum(known) / len(known) if known else 1.0
    cap = dict.fromkeys(regions, 0.0)
    for n in live:
        if n.region in cap:
            cap[n.region] += n.speed if n.speed is not None and n.speed > 0 else default
    return cap


def shares(cap: Mapping[str, float], seen: Iterable[str], prior: Mapping[str, float]) -> dict[str, float]:
    """Fraction of new tasks per region: measured capacity where a region's nodes were seen, the
    prior share where none was yet (scaled to the measured ones); 0 for a region seen and dark.
    Sums to 1 unless no region may get tasks (all 0)."""
    seen = set(seen)
    measured = {r: c for r, c in cap.items() if r in seen}
    unseen = {r: prior.get(r, 0.0) for r in cap if r not in seen}
    total_measured = sum(measured.values())
    if total_measured <= 0:
        raw = {**dict.fromkeys(measured, 0.0), **unseen}
    else:
        seen_prior = sum(prior.get(r, 0.0) for r in measured if cap[r] > 0)
        scale = total_measured / seen_prior if seen_prior > 0 else total_measured
        raw = {**measured, **{r: p * scale for r, p in unseen.items()}}
    total = sum(raw.values())
    return {r: (v / total if total > 0 else 0.0) for r, v in raw.items()}


def transits(nodes: Iterable[NodeSeen], regions: Iterable[str], now: float, dead_after_s: float) -> dict[str, float]:
    """Each region's round trip for a task, in s: twice its live nodes' mean metric delay (0
    where none is known; see the module doc)."""
    by: dict[str, list[float]] = {r: [] for r in regions}
    for n in live_nodes(nodes, now, dead_after_s):
        if n.region in by and n.delay is not None:
            by[n.region].append(n.delay)
    return {r: min(TRANSIT_MAX_S, 2 * sum(d) / len(d)) if d else 0.0 for r, d in by.items()}


def reserves(cap: Mapping[str, float], transit: Mapping[str, float], window: float) -> dict[str, float]:
    """Tasks each region holds on the way, capacity x transit, scaled so that together they take
    at most `RESERVE_FRACTION` of `window`."""
    raw = {r: c * transit.get(r, 0.0) for r, c in cap.items()}
    total, room = sum(raw.values()), RESERVE_FRACTION * window
    scale = min(1.0, room / total) if total > 0 else 0.0
    return {r: v * scale for r, v in raw.items()}


def limits(share: Mapping[str, float], reserve: Mapping[str, float], window: float) -> dict[str, float]:
    """The most tasks a region may hold outstanding: its reserve and its share of `window`."""
    return {r: reserve.get(r, 0.0) + s * window for r, s in share.items()}


def choose(share: Mapping[str, float], outstanding: Mapping[str, int], reserve: Mapping[str, float] | None = None,
           limit: Mapping[str, float] | None = None) -> str | None:
    """The region for the next task: the smallest (outstanding + 1 - reserve) / share among
    regions with a share and below their limit (ties: the first); None when none is."""
    reserve, limit = reserve or {}, limit or {}
    ok = [r for r, s in share.items() if s > 0 and outstanding.get(r, 0) < limit.get(r, math.inf)]
    if not ok:
        return None
    return min(ok, key=lambda r: (outstanding.get(r, 0) + 1 - reserve.get(r, 0.0)) / share[r])


def dead_regions(nodes: Iterable[NodeSeen], regions: Iterable[str], now: float, started: float,
                 dead_after_s: float) -> set[str]:
    """Regions with no live node that either had nodes seen or have had none since `started`
    for longer than `dead_after_s` (their outstanding tasks are to be given back)."""
    nodes = list(nodes)
    live = {n.region for n in live_nodes(nodes, now, dead_after_s)}
    ever = {n.region for n in nodes}
    return {r for r in regions if r not in live and (r in ever or now - started > dead_after_s)}
