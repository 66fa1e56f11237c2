"""`astraflow trace ID`: every hop of one task, group, trajectory or sample, from the topics or an archive."""

from __future__ import annotations

import json
import time
from collections.abc import Iterator
from typing import Any

import typer

from astraflow_cli.common import console, handle_errors, load

EXPERIMENT = typer.Option(..., "--experiment", "-e", help="Experiment name (topics are af.<experiment>.*).")


@handle_errors
def trace(
    ctx: typer.Context,
    ident: str = typer.Argument(..., help="A task, group, trajectory or sample id (`astraflow logs show -e EXP -t "
                                "POLICY.train` prints sample ids, `-t rollouts` trajectory ids)."),
    experiment: str = EXPERIMENT,
    archive: str | None = typer.Option(None, "--archive", help="Read this archive (directory or URI) instead of Kafka."),
    as_json: bool = typer.Option(False, "--json", help="One JSON object: the id's kind, its group and every hop."),
) -> None:
    """Print every hop of ID in order, with times: curated, rolled out, scored, turned into samples
    or dropped (filter, reason), trained (step, version), processed by a user processor (its
    output topic), or dead-lettered (who, why)."""
    from astraflow.archive.format import ArchivedRecord
    from astraflow.ops.trace import trace as run_trace

    if archive is not None:
        from astraflow.archive.reader import ArchiveReader

        reader = ArchiveReader(archive)
        topics = reader.topics()

        def source(topic: str) -> Iterator[ArchivedRecord]:
            yield from reader.read_topic(topic)
    else:
        from astraflow.archive.kafka_source import TopicSource
        from astraflow.kafka.topics import TopicAdmin

        cfg = load(ctx)
        topics = list(TopicAdmin(cfg.kafka).experiment(experiment))  # one line naming it when it has no topics

        def source(topic: str) -> Iterator[ArchivedRecord]:
            with TopicSource(cfg.kafka, topic) as src:
                yield from src

    result = run_trace(experiment, ident, source, topics)
    if as_json:
        print(json.dumps(result.to_json()))
        return
    console.print(f"[bold]{result.kind} {ident}[/] (group {result.group_id}): {len(result.hops)} hops")
    start = result.hops[0].at_ms if result.hops else 0
    for h in result.hops:
        when = time.strftime("%H:%M:%S", time.localtime(h.at_ms / 1000)) + f".{h.at_ms % 1000:03d}"
        what = h.ids.get("sample_id") or h.ids.get("trajectory_id") or h.ids.get("group_id", "")
        delta = f"+{(h.at_ms - start) / 1000:.2f}s"
        console.print(f"{when} {delta:<9} [cyan]{h.stage:<13}[/] {h.component:<8} {what}  "
                      f"[dim]{h.topic}[{h.partition}]@{h.offset}[/]", highlight=False)
        console.print(f"    {summary(h.stage, h.detail)}", highlight=False, markup=False)


def summary(stage: str, d: dict[str, Any]) -> str:
    """One line of the details a person looks at first."""
    if stage == "curated":
        return f"prompt {d['prompt_id']} ({d['dataset']}), workflow {d['workflow']}, {d['n_samples']} samples, " \
               f"policies {','.join(d['policies'])}; {' '.join(d['strategy']) or 'no strategy recorded'}"
    if stage == "rolled_out":
        turns = "; ".join(f"turn {i}: {t['policy']} v{','.join(map(str, t['versions'])) or '-'} ({t['tokens']} tok)"
                          for i, t in enumerate(d["turns"]))
        tools = ", ".join(f"{c['name']} {c['latency_s'] * 1000:.0f}ms" + (f" ({c['error']})" if c["error"] else "")
                          for c in d["tool_calls"])
        return (f"node {d['node']} ({d['region']}, {d['hardware']}, {d['backend']}), {d['status']}; {turns}"
                + (f"; tools: {tools}" if tools else "") + f"; generate {d['generate_s']:.2f}s, tools {d['tool_s']:.2f}s"
                + (f"; error: {d['error']}" if d["error"] else ""))
    if stage == "scored":
        comps = ", ".join(f"{k}={v:g}" for k, v in sorted(d["components"].items()))
        return f"reward {d['reward']}" + (f" ({comps})" if comps else "") + f"; {' '.join(d['strategy'])}"
    if stage == "sample":
        return (f"policy {d['policy']}, advantage {d['advantage']:+.4f}, reward {d['reward']:g}, min version "
                f"{d['min_version']}; {' '.join(d['strategy'])}")
    if stage == "dropped":
        return f"by {d['filter']} ({d['strategy']}): {d['reason']} [{', '.join(d['trajectory_ids'])}]"
    if stage == "trained":
        return f"policy {d['policy']}: trainer step {d['step']}, first in version {d['version']} " \
               f"(published at step {d['published_at_step']}, trainer {d['trainer']})"
    if stage == "processed":
        return f"by processor {d['processor']} (v{d['version']}, {d['function']}) into {d['stream']}"
    if stage == "dead_lettered":
        error = d["error"].split("\n\n")[0]  # the traceback that may follow is for `--json` / `logs show`
        return f"{d['error_class']}: {error}" + (f" (strategy {d['strategy']})" if d["strategy"] else "") + f"; from {d['from']}"
    return json.dumps(d)


def register(app: typer.Typer) -> None:
    app.command("trace")(trace)
