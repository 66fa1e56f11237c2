"""Rich rendering of a StatusReport for people (`astraflow status`; `--json` is for machines)."""

from __future__ import annotations

import time

from rich.console import Group, RenderableType
from rich.table import Table
from rich.text import Text

from astraflow.kafka.topics import Topics
from astraflow.ops.status import StatusReport


def _num(x: float | None, fmt: str = "{:.2f}") -> str:
    return "-" if x is None else fmt.format(x)


def _age(s: float | None) -> str:
    if s is None:
        return "-"
    return f"{s:.0f}s" if s < 120 else f"{s / 60:.0f}m"


def render_status(r: StatusReport) -> RenderableType:
    """Tables: topics, lag, RaaS nodes, policies; a line each for staleness, reward and the DLQ."""
    when = time.strftime("%H:%M:%S", time.localtime(r.taken_at / 1000))
    header = Text.assemble(("experiment ", "dim"), (r.experiment, "bold"), ("  on ", "dim"), r.bootstrap_servers,
                           ("  at ", "dim"), when, ("  rates over the last ", "dim"), f"{r.window_s:.0f}s")

    topics = Table("stream", "partitions", "records", "written", "rate/s", title="topics", title_justify="left")
    for t in r.topics:
        topics.add_row(t.stream, str(t.partitions), f"{t.records:,}", f"{t.end_offset:,}", f"{t.rate_per_s:.2f}")

    lags = Table("group", "topic", "lag", "partitions", "members", "state", title="consumer lag", title_justify="left")
    prefix = Topics(r.experiment).prefix
    for g in r.lags:
        style = "yellow" if g.lag > 0 and g.members == 0 else ""
        lags.add_row(g.group.removeprefix(prefix), g.topic.removeprefix(prefix), f"{g.lag:,}", str(g.partitions),
                     str(g.members), g.state.lower(), style=style)
    if not r.lags:
        lags.add_row("(no consumer group has committed yet)", "", "", "", "", "")

    nodes = Table("node", "hardware", "region", "backend", "serves", "rollouts/s", "tokens/s", "inflight", "rollouts",
                  "seen", title=f"RaaS nodes ({len(r.nodes)})", title_justify="left")
    for n in r.nodes:
        serves = ", ".join(f"{p}@v{v}" for p, v in n.versions.items()) or "-"
        style = "dim" if n.last_seen_s > 60 else ""
        nodes.add_row(n.node_id, n.hardware, n.region, n.backend, serves, f"{n.rollouts_per_s:.2f}",
                      f"{n.tokens_per_s:,.0f}", f"{n.inflight:.0f}", f"{n.rollouts_total:,.0f}", _age(n.last_seen_s) + " ago",
                      style=style)

    regions = Table("region", "nodes", "rollouts/s", "inflight", "version lag", title="regions", title_justify="left")
    for g in r.regions:
        regions.add_row(g.region, str(g.nodes), f"{g.rollouts_per_s:.2f}", f"{g.inflight:.0f}", _num(g.version_lag, "{}"))
    a = r.autoscale
    scale = Text.assemble(("autoscale ", "bold"), "-" if a is None else (
        f"{a.nodes} nodes, task lag {a.task_lag}, backlog {_num(a.backlog_s, '{:.0f}s')} (target {a.target_s:.0f}s): "
        f"{'add ' + str(a.desired_delta) if a.desired_delta > 0 else 'remove 1' if a.desired_delta < 0 else 'hold'} ({a.reason})"))

    pol = Table("policy", "version", "kind", "published", "trainer step", "samples", "loss", "reward", "trainer tokens/s",
                title="policies and trainers", title_justify="left")
    for p in r.policies:
        pol.add_row(p.policy, _num(p.version, "v{}"), p.kind or "-", _age(p.published_s_ago) + (" ago" if p.published_s_ago is not None else ""),
                    _num(p.trainer_step, "{}"), _num(p.trained_samples, "{:,}"), _num(p.trainer.get("loss"), "{:.4f}"),
                    _num(p.trainer.get("reward")), _num(p.trainer.get("tokens_per_s"), "{:,.0f}"))

    s = r.staleness
    hist = " ".join(f"{k}:{v}" for k, v in s.histogram.items()) or "-"
    staleness = Text.assemble(("staleness ", "bold"), f"(versions behind, last {s.samples} scored): mean {_num(s.mean)}  "
                              f"p50 {_num(s.p50, '{:.0f}')}  p90 {_num(s.p90, '{:.0f}')}  max {_num(s.max, '{}')}  histogram {hist}")
    w = r.reward
    reward = Text.assemble(("reward ", "bold"), f"(last {w.samples} scored): mean {_num(w.mean, '{:.3f}')}  "
                           f"positive {_num(w.positive_fraction, '{:.1%}')}")
    d = r.dlq
    dlq = Text.assemble(("dlq ", "bold"), (f"{d.records:,} records", "red" if d.records else "green"),
                        f"  ({d.rate_per_s:.2f}/s)")
    for item in d.recent[:3]:
        dlq.append(f"\n  {item['component']}: {item['error_class']}: {item['error'][:100]} (from {item['topic']}@{item['offset']})",
                   style="dim")
    parts: list[RenderableType] = [header, topics, lags, nodes, regions, scale, pol, staleness, reward, dlq]
    if r.undecodable:
        parts.append(Text(f"{r.undecodable} records could not be decoded by status (see the dlq)", style="yellow"))
    return Group(*parts)
