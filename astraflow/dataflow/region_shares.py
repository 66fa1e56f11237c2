"""Which region's tasks topic the curator writes the next task to: shares that follow the fleet.

Pure policy (no Kafka; `stream_apps.curator` feeds it). Each region with a tasks topic of its
own (`--region-share`, a cluster fed by MirrorMaker 2) and region A (the experiment's `tasks`)
has nodes that publish their metrics every few seconds (`raas` metrics: `rollouts_per_s`,
`inflight`, labelled with the node's region), which come back to region A's cluster.

* **Live nodes.** A node is live while its last metric is at most `dead_after_s` old (default
  15 s: three of the node's 5 s metric intervals).
* **Speed.** A node's speed is an exponentially weighted mean (weight `SPEED_WEIGHT` per sample)
  of its `rollouts_per_s` over the samples where it was working (`inflight` > 0 or rollouts
  done): a node starved of tasks keeps the speed it showed when fed (its throughput would fall
  with its feed and the share with it: a fixed point). A node never seen working counts at the
  mean speed of the nodes that were; when none was, every live node counts as one.
* **Capacity** of a region: the sum of its live nodes' speeds; **share**: its capacity over the
  sum. No live node: share 0. Before any node of a region was seen, the configured share holds
  (`prior`, from `--region-share`), rescaled against the measured regions, so that a start
  where metrics have not arrived yet issues as configured.
* **Backlog.** The next task goes to the region where it would wait least relative to its
  share: the smallest (outstanding + 1) / share, outstanding being the tasks issued to the
  region whose trajectories have not all come back. A slow or lagging region so holds no more
  than its share of the outstanding tasks (which `--max-ahead` bounds), where a fixed share let
  its queue grow until it filled the window.
* **Dead region.** A region that had live nodes and has none, or has had none for `dead_after_s`
  since the curator started, is dead: its outstanding tasks are given back (re-issued to the
  live regions by the same rule, with the same group ids), as long as some region is live.
  While no region is live (no node started yet, or the metrics cannot be read), the configured
  shares hold and nothing is given back (`stream_apps.region_fleet`): the fleet's view can only
  move tasks between live regions, never stop the curator on its own.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass

SPEED_WEIGHT = 0.3  # weight of a new working sample in a node's speed


@dataclass
class NodeSeen:
    """What the curator knows of one node, from its metrics."""

    region: str
    last_seen: float  # monotonic seconds of its last metric
    speed: float | None = None  # rollouts/s while working (None: never seen working)

    def observe(self, now: float, rollouts_per_s: float | None, inflight: float | None) -> None:
        """A metric of this node: `rollouts_per_s` / `inflight` when the record carried them."""
        self.last_seen = max(self.last_seen, now)
        if rollouts_per_s is None or not 0.0 <= rollouts_per_s < 1e6:  # untrusted: ignore what no node reports
            return
        if rollouts_per_s > 0 or (inflight or 0) > 0:
            self.speed = rollouts_per_s if self.speed is None else (
                (1 - SPEED_WEIGHT) * self.speed + SPEED_WEIGHT * rollouts_per_s)


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


def choose(share: Mapping[str, float], outstanding: Mapping[str, int]) -> str | None:
    """The region for the next task: the smallest (outstanding + 1) / share among regions with a
    share (ties: the first); None when no region has one."""
    live = [r for r, s in share.items() if s > 0]
    if not live:
        return None
    return min(live, key=lambda r: (outstanding.get(r, 0) + 1) / share[r])


def dead_regions(nodes: Iterable[NodeSeen], regions: Iterable[str], now: float, started: float,
                 dead_after_s: float) -> set[str]:
    """Regions with no live node that either had nodes seen or have had none since `started`
    for longer than `dead_after_s` (their outstanding tasks are to be given back)."""
    nodes = list(nodes)
    live = {n.region for n in live_nodes(nodes, now, dead_after_s)}
    ever = {n.region for n in nodes}
    return {r for r in regions if r not in live and (r in ever or now - started > dead_after_s)}
