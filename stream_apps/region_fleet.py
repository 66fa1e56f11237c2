"""The curator's view of its regions (`--region-share`): live nodes, speeds, tasks outstanding.

`RegionFleet` applies the policy of `astraflow.dataflow.region_shares` to what it reads from
region A's cluster, where every region's metrics and trajectories come back (MirrorMaker 2
mirrors B's `metrics` and `rollouts` to A):

* the nodes' metrics (`metrics`, component `raas`): node, region (the label `tasks_region`
  names the tasks topic a node reads; a node without it counts for its `region` label when that
  is a region of `--region-share`, else for region A), `busy_tasks_per_s` (its speed), and when
  each was written (its `ts`: how long the way back to the curator takes, the region's transit);
* the keys of the trajectories (`rollouts`, keyed by group id): a task is outstanding from its
  issue until `n_samples` trajectories of its group came back (read from the end of the topic
  as of the curator's start: tasks issued before it are not tracked, see below).

Both are read by one reader that never commits (assign only), polled from the curator's
measuring thread. Values of `rollouts` are not decoded (only keys count), metrics are decoded and
anything that is not a raas Metric signed by the experiment's `raas` key is skipped (and
counted in `bad_metrics`): the records are untrusted; a RaaS node holding the key can still
make the curator send a region more or fewer new tasks (by the speed it claims, or by its clock,
which sets the region's transit, bounded), never lose one (a task given back is re-issued, not
dropped), nor make a region hold more than its limit (its reserve, itself at most a share of
half the window, and its share of the window).

Tasks this process issued to a region that went dark (`dead_regions`) are **given back**:
written again, the same Task (same task and group ids, `metadata.given_back_from` added) to a
live region's topic. Curate assembles groups by group id and drops a trajectory id it already
holds or emitted (`Trajectory.make_id(task, sample)`: the same for both copies), so whichever
copy finishes first is trained and the other's trajectories are dropped: nothing is trained
twice, and the group counts once in the curator's `issued` (a given-back task is not counted
again) and once in `curated`. Tasks issued by an earlier curator process are not tracked: after
a restart while a region is dark, its old tasks stay there (the operator's steps in
docs/deploy-regions.md).
"""

from __future__ import annotations

import dataclasses
import logging
from collections import Counter
from typing import Any

from astraflow.dataflow.region_shares import (
    NodeSeen,
    capacities,
    choose,
    dead_regions,
    limits,
    reserves,
    shares,
    transits,
)
from astraflow.ops.provenance import Provenance
from astraflow.records import Metric, Task

log = logging.getLogger("astraflow.stream.curator")


class RegionFleet:
    """Shares of new tasks among tasks topics, and tasks to give back (see the module doc)."""

    def __init__(self, topic_of_region: dict[str, str], prior: dict[str, float], n_samples: int,
                 dead_after_s: float, now: float, *, window: int) -> None:
        """`topic_of_region`: region name ('' for region A) -> its tasks topic; `prior`: topic ->
        configured share; `window`: the most tasks outstanding in all (`--max-ahead`)."""
        self.topic_of_region = topic_of_region
        self.topics = list(dict.fromkeys(topic_of_region.values()))
        self.prior = prior
        self.n_samples = max(1, n_samples)
        self.dead_after_s = dead_after_s
        self.window = window
        self.started = now
        self.nodes: dict[str, NodeSeen] = {}
        self.outstanding: dict[str, dict[str, Task]] = {t: {} for t in self.topics}  # topic -> group -> task
        self.where: dict[str, str] = {}  # group -> topic it is outstanding in
        self.back: Counter[str] = Counter()  # group -> trajectories come back
        self.given_back = 0  # tasks re-issued elsewhere
        self.dead: set[str] = set()
        self.share: dict[str, float] = dict(prior)
        self.transit: dict[str, float] = dict.fromkeys(self.topics, 0.0)  # s, a task's way there and back
        self.reserve: dict[str, float] = dict.fromkeys(self.topics, 0.0)  # tasks held on the way
        self.limit: dict[str, float] = {}  # most tasks outstanding per topic (none: no limit)
        self.bad_metrics = 0
        self.unread: dict[int, int] = {}  # metrics partition -> end offset at start, not read up to yet
        self.refreshed = False

    def expect_metrics(self, unread: dict[int, int]) -> None:
        """The metrics that were on the topic when the reader started (partition -> end offset).
        Until they are read no region is taken for dark: an old metric read before its node's
        newer ones would make a live region look dead, and a region whose metrics simply were not
        fetched yet would look like one without nodes. The grace of `dead_after_s` for regions
        never seen starts once they are read."""
        self.unread = {p: end for p, end in unread.items() if end > 0}

    def read_metric_at(self, partition: int, offset: int, now: float) -> bool:
        """A metric at `offset` of `partition` was read; True when it was there at the start (it
        says nothing of how long a metric takes to arrive)."""
        end = self.unread.get(partition)
        if end is not None and offset + 1 >= end:
            del self.unread[partition]
            if not self.unread:
                self.started = now
        return end is not None and offset < end

    def topic_of(self, labels: dict[str, str]) -> str:
        """The tasks topic a node reads, from its metric's labels."""
        a = self.topic_of_region[""]
        if "tasks_region" in labels:
            return self.topic_of_region.get(labels["tasks_region"], a)
        return self.topic_of_region.get(labels.get("region", ""), a)

    def on_metric(self, m: Metric, now: float, delay_s: float | None = None) -> None:
        """A node's metric (others are ignored), written at `now`, that took `delay_s` to arrive."""
        if m.component != "raas" or m.name not in ("busy_tasks_per_s", "rollouts_per_s", "inflight", "policy_version"):
            return
        node = self.nodes.get(m.instance)
        topic = self.topic_of(dict(m.labels))
        if node is None:
            node = self.nodes[m.instance] = NodeSeen(topic, now)
            log.info("regions: node %s reads %s", m.instance, topic)
        node.region = topic
        node.observe(now, m.value if m.name == "busy_tasks_per_s" else None, delay_s)

    def on_trajectory(self, group: str) -> None:
        """A trajectory of `group` came back."""
        if group not in self.where:
            return
        self.back[group] += 1
        if self.back[group] >= self.n_samples:
            self.outstanding[self.where.pop(group)].pop(group, None)
            del self.back[group]

    def refresh(self, now: float) -> None:
        """Shares and dead regions as of `now`. The grace for regions never seen starts at the
        latest of the fleet's start, its first refresh (the curator reads no metric before its
        tables are recovered) and the moment the metrics there at the start were read."""
        if not self.refreshed:
            self.refreshed, self.started = True, max(self.started, now)
        cap = capacities(self.nodes.values(), self.topics, now, self.dead_after_s)
        seen = {n.region for n in self.nodes.values()}
        dead = dead_regions(self.nodes.values(), self.topics, now, self.started, self.dead_after_s)
        if self.unread:  # still reading the metrics that were there at the start: nothing known to be dark
            dead = set()
        if dead == set(self.topics):  # no node heard from anywhere (none started yet, or metrics unreadable):
            self.dead, self.share = set(), dict(self.prior)  # issue as configured, give nothing back
            self.reserve, self.limit = dict.fromkeys(self.topics, 0.0), {}  # and hold back nothing
            return
        for t in dead - self.dead:
            log.warning("regions: no live node reads %s for %.0f s: it gets no new tasks, and its %d outstanding "
                        "tasks are given back", t, self.dead_after_s, len(self.outstanding[t]))
        for t in self.dead - dead:
            log.info("regions: %s has live nodes again: its share returns", t)
        self.dead = dead
        self.share = shares(cap, seen | dead, self.prior)
        self.transit = transits(self.nodes.values(), self.topics, now, self.dead_after_s)
        self.reserve = reserves(cap, self.transit, self.window)
        self.limit = limits(self.share, self.reserve, self.window)

    def next_topic(self) -> str | None:
        """Where the next task goes (None: no region may take one now)."""
        return choose(self.share, {t: len(q) for t, q in self.outstanding.items()}, self.reserve, self.limit)

    def sent(self, topic: str, task: Task) -> None:
        """`task` was written to `topic`."""
        old = self.where.get(task.group_id)
        if old is not None:
            self.outstanding[old].pop(task.group_id, None)
        self.where[task.group_id] = topic
        self.outstanding[topic][task.group_id] = task

    def to_give_back(self) -> list[tuple[Task, str]]:
        """Outstanding tasks of dead regions, each with the live topic to re-issue it to (in
        the order they were issued; the limits do not hold them back: each already holds its slot
        of the window); none while no region is live."""
        out: list[tuple[Task, str]] = []
        pending = {t: len(q) for t, q in self.outstanding.items()}
        for dead in sorted(self.dead):
            for task in list(self.outstanding[dead].values()):
                topic = choose(self.share, pending, self.reserve)
                if topic is None or topic == dead:
                    return out
                pending[topic] += 1
                pending[dead] -= 1
                metadata = {**task.metadata, "given_back_from": dead}
                out.append((dataclasses.replace(task, metadata=metadata), topic))
        return out

    def gauges(self) -> dict[str, float]:
        """Per region, named by its topic's last part (`tasks`: region A; `b`: `tasks.b`)."""
        name = {t: t.rsplit(".", 1)[-1] for t in self.topics}
        return {"tasks_given_back_total": float(self.given_back),
                **{f"region_share.{name[t]}": float(self.share.get(t, 0.0)) for t in self.topics},
                **{f"tasks_outstanding.{name[t]}": float(len(q)) for t, q in self.outstanding.items()},
                **{f"region_transit_s.{name[t]}": float(self.transit.get(t, 0.0)) for t in self.topics},
                **{f"tasks_reserve.{name[t]}": float(self.reserve.get(t, 0.0)) for t in self.topics},
                **{f"region_dead.{name[t]}": float(t in self.dead) for t in self.topics}}


def feed_fleet(fleet: RegionFleet, msgs: list[Any], serde: Any, metrics_topic: str, now: float,
               wall_now: float, provenance: Provenance | None = None) -> None:
    """Feeds `fleet` the messages a reader of the metrics and rollouts topics returned (the
    curator reads them in its measuring thread and applies them in its event loop). A metric
    counts as seen when it was written (its `ts`, at most `now`: read late, it is no younger),
    its delay (read time minus `ts`) measures the region's way back unless it was on the topic
    at the start, and, with `provenance`, it counts only when the `raas` key signed it: a forged
    node's metrics could otherwise keep a dark region "live" and its outstanding tasks would
    never be given back."""
    for msg in msgs:
        if msg.topic() == metrics_topic:
            old = fleet.read_metric_at(msg.partition(), msg.offset(), now)
            try:
                m = serde.loads(msg.value(), Metric)
            except Exception:  # untrusted bytes: skipped, counted
                fleet.bad_metrics += 1
                continue
            if m.component == "raas" and provenance is not None and not provenance.metric(
                    m, msg.key(), msg.value(), list(msg.headers() or [])):
                fleet.bad_metrics += 1  # no valid signature of the raas key: not a node we know
                continue
            delay = max(0.0, wall_now - m.ts / 1000.0)
            fleet.on_metric(m, now - delay, None if old else delay)
        elif msg.key() is not None:
            fleet.on_trajectory(msg.key().decode(errors="replace"))
    fleet.refresh(now)


def fleet_reader(kafka: Any, group: str, metrics_topic: str, rollouts_topic: str,
                 since_s: float) -> tuple[Any, dict[int, int]]:
    """A reader assigned to every partition of the metrics topic from `since_s` seconds ago (nodes
    live now are seen at once) and of the rollouts topic from its end (tasks issued from now on),
    and the metrics it has to read to be caught up (partition -> end offset, for
    `RegionFleet.expect_metrics`)."""
    import time

    from confluent_kafka import TopicPartition

    from astraflow.kafka.clients import offsets_at, reader, watermarks

    consumer = reader(kafka, group)
    parts = {t: list(consumer.list_topics(t, timeout=10.0).topics[t].partitions) for t in (metrics_topic, rollouts_topic)}
    since_ms = int((time.time() - since_s) * 1000)
    # (the lookups retry while the topics, new with the experiment, still elect their leaders)
    at = offsets_at(consumer, [TopicPartition(metrics_topic, p, since_ms) for p in parts[metrics_topic]], 30.0)
    unread, start = {}, []
    for tp in at:  # numeric offsets: a logical end is resolved at the first fetch, and what came before it is lost
        end = watermarks(consumer, metrics_topic, tp.partition, 30.0)[1]
        if tp.offset >= 0:  # metrics written since then: read up to the end as it is now
            unread[tp.partition] = end
        start.append(TopicPartition(metrics_topic, tp.partition, tp.offset if tp.offset >= 0 else end))
    for p in parts[rollouts_topic]:
        start.append(TopicPartition(rollouts_topic, p, watermarks(consumer, rollouts_topic, p, 30.0)[1]))
    consumer.assign(start)
    return consumer, unread
