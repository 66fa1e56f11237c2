"""Rich rendering of a StatusReport for people (`astraflow status`; `--json` is for machines)."""

from __future__ import annotations

import time

from rich import box
from rich.console import Group, RenderableType
from rich.table import Table
from rich.text import Text

from astraflow.kafka.topics import Topics
from astraflow.ops.status import RUNNING_WITHIN_S, StatusReport


def _num(x: float | None, fmt: str = "{:.2f}") -> str:
    return "-" if x is None else fmt.format(x)


def _age(s: float | None) -> str:
    if s is None:
        return "-"
    return f"{s:.0f}s" if s < 120 else f"{s / 60:.0f}m"


def _internal(stream: str) -> bool:
    """Faust's own topics of a stream app (table changelogs, its leader topic): in `--json`, not on screen."""
    return stream.endswith("-changelog") or "__" in stream


def _table(*columns: str, title: str) -> Table:
    """A table that fits 80 columns: names fold onto a second line instead of being cut to 'raas…'."""
    table = Table(title=title, title_justify="left", box=box.SIMPLE_HEAD, pad_edge=False, padding=(0, 1))
    for i, c in enumerate(columns):
        table.add_column(c, overflow="fold", justify="left" if i == 0 else "right")
    return table


def render_status(r: StatusReport) -> RenderableType:
    """Tables: topics, lag, stream apps and processors, RaaS nodes, policies; a line each for
    staleness, reward and the DLQ. Every count is of records (transaction markers left out)."""
    when = time.strftime("%H:%M:%S", time.localtime(r.taken_at / 1000))
    header = Text.assemble(("experiment ", "dim"), (r.experiment, "bold"), ("  on ", "dim"), r.bootstrap_servers,
                           ("  at ", "dim"), when, ("  rates over ", "dim"), f"{r.window_s:.0f}s")
    if not r.running:
        header.append(f"\nnot running: no role reported in the last {RUNNING_WITHIN_S:.0f}s", style="yellow")

    topics = _table("stream", "parts", "records", "rate/s", title="topics (records a consumer reads)")
    for t in r.topics:
        if _internal(t.stream):
            continue
        topics.add_row(t.stream, str(t.partitions), ("" if t.exact else "≤") + f"{t.records:,}", f"{t.rate_per_s:.2f}")

    lags = _table("group", "topic", "lag", "members", "state", title="consumer lag (records)")
    prefix = Topics(r.experiment).prefix
    for g in r.lags:
        if _internal(g.topic.removeprefix(prefix)):
            continue
        style = "yellow" if g.lag > 0 and g.members == 0 and r.running else ""
        lags.add_row(g.group.removeprefix(prefix), g.topic.removeprefix(prefix), f"{g.lag:,}", str(g.members),
                     g.state.lower(), style=style)
    if not r.lags:
        lags.add_row("(no consumer group has committed yet)", "", "", "", "")

    apps = _table("app / processor", "workers", "in", "out", "dead-lettered", "in/s",
                  title="stream apps and processors")
    for a in r.apps:
        style = "red" if a.dead_lettered and a.dead_lettered * 2 > a.records_in else "dim" if a.last_seen_s > 60 else ""
        apps.add_row(a.component, str(a.workers), f"{a.records_in:,}", f"{a.records_out:,}", f"{a.dead_lettered:,}",
                     f"{a.in_per_s:.2f}", style=style)

    nodes = _table("node", "region", "serves", "rollouts/s", "inflight", "rollouts", "seen",
                   title=f"RaaS nodes ({len(r.nodes)})")
    for n in r.nodes:
        serves = ", ".join(f"{p}@v{v}" for p, v in n.versions.items()) or "-"
        style = "dim" if n.last_seen_s > 60 else ""
        nodes.add_row(f"{n.node_id} ({n.hardware}, {n.backend})", n.region, serves, f"{n.rollouts_per_s:.2f}",
                      f"{n.inflight:.0f}", f"{n.rollouts_total:,.0f}", _age(n.last_seen_s) + " ago", style=style)

    regions = _table("region", "nodes", "rollouts/s", "inflight", "version lag", title="regions")
    for g in r.regions:
        regions.add_row(g.region, str(g.nodes), f"{g.rollouts_per_s:.2f}", f"{g.inflight:.0f}", _num(g.version_lag, "{}"))
    a = r.autoscale
    scale = Text.assemble(("autoscale ", "bold"), "- (not running)" if a is None else (
        f"{a.nodes} nodes, task lag {a.task_lag}, backlog {_num(a.backlog_s, '{:.0f}s')} (target {a.target_s:.0f}s): "
        f"{'add ' + str(a.desired_delta) if a.desired_delta > 0 else 'remove 1' if a.desired_delta < 0 else 'hold'} ({a.reason})"))

    pol = _table("policy", "version", "published", "step", "samples", "loss", "reward", "tok/s",
                 title="policies and trainers")
    for p in r.policies:
        pol.add_row(p.policy, _num(p.version, "v{}") + (f" {p.kind.lower()}" if p.kind else ""),
                    _age(p.published_s_ago) + (" ago" if p.published_s_ago is not None else ""),
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
        dlq.append(f"\n  {item['component']}: {item['error_class']}: {item['error'].splitlines()[0][:100] if item['error'] else ''} "
                   f"(from {item['topic']}@{item['offset']})", style="dim")
    parts: list[RenderableType] = [header, topics, lags]
    if r.apps:
        parts.append(apps)
    parts += [nodes]
    if r.regions:
        parts.append(regions)
    parts += [scale, pol, staleness, reward, dlq]
    if r.unverified or r.refused_versions:
        claims = sorted({f"{m.component}/{m.instance}" for m in r.unverified})
        parts.append(Text(f"unverified (not counted above: no valid signature of the role they name): "
                          f"{len(r.unverified)} metric series from {', '.join(claims[:8]) or '-'}"
                          f"{' ...' if len(claims) > 8 else ''}; {r.refused_versions} unsigned policy versions",
                          style="yellow"))
    if r.undecodable:
        parts.append(Text(f"{r.undecodable} records could not be decoded by status (see the dlq)", style="yellow"))
    return Group(*parts)
