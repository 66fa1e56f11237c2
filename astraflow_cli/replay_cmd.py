"""`astraflow replay`: re-publish an archive or a topic's time range into a topic."""

from __future__ import annotations

from typing import Any

import typer

from astraflow_cli.common import console, err_console, handle_errors, load


@handle_errors
def replay(
    ctx: typer.Context,
    source: str = typer.Option(..., "--from", help="Archive (a directory, <archive>/<topic>, or a URI) or a Kafka topic."),
    target: str = typer.Option(..., "--to", help="Topic to publish into (a stream name with --experiment, or a full name)."),
    experiment: str | None = typer.Option(None, "--experiment", "-e", help="Resolve stream names (rollouts, solver.train) in this experiment."),
    topic: str | None = typer.Option(None, "--topic", help="Which archived topic, when the archive holds several."),
    since: str | None = typer.Option(None, "--since", help="From this time: ISO datetime (UTC if no zone), epoch s/ms, or 2h / 30m ago."),
    until: str | None = typer.Option(None, "--until", help="Up to this time (same forms as --since)."),
    filter_: str | None = typer.Option(None, "--filter", help="e.g. \"reward > 0.5 and workflow == 'tool_use'\" (see docs/archive.md)."),
    rate: float | None = typer.Option(None, "--rate", help="Records per second."),
    speed: float | None = typer.Option(None, "--speed", help="Multiple of the original pace (2 = twice as fast)."),
    limit: int | None = typer.Option(None, "--limit", help="Stop after publishing this many records."),
    reencode: bool = typer.Option(False, "--reencode", help="Write values in the current schema version (default: archived bytes)."),
    keep_timestamps: bool = typer.Option(False, "--keep-timestamps", help="Publish with the original timestamps (mind retention)."),
    no_provenance: bool = typer.Option(False, "--no-provenance", help="Do not add the af-replay-from header."),
    skip_corrupt: bool = typer.Option(False, "--skip-corrupt", help="Skip and report corrupted archive blocks instead of stopping."),
    create_target: bool = typer.Option(False, "--create-target", help="Create the target topic if it does not exist "
                                       "(as many partitions as the source; a built-in stream as `topics create` makes it)."),
) -> None:
    """Re-publish records in their original per-partition order, filtered and paced. The target
    topic must exist, or be made with --create-target."""
    from rich.progress import (
        BarColumn,
        MofNCompleteColumn,
        Progress,
        SpinnerColumn,
        TextColumn,
        TimeElapsedColumn,
    )

    from astraflow.archive.filter import parse_time
    from astraflow.archive.reader import CorruptBlock
    from astraflow.archive.replay import Replayer, ReplayOptions, ReplayStats, open_source
    from astraflow.kafka.topics import Topics

    cfg = load(ctx)
    options = ReplayOptions(
        since_ms=parse_time(since) if since else None,
        until_ms=parse_time(until) if until else None,
        filter=filter_, rate=rate, speed=speed, limit=limit, reencode=reencode,
        keep_timestamps=keep_timestamps, provenance=not no_provenance,
    )
    resolve = Topics(experiment).stream if experiment else (lambda n: n)
    corrupt: list[CorruptBlock] = []

    def on_corrupt(c: CorruptBlock) -> None:
        corrupt.append(c)
        err_console.print(f"[yellow]skipped corrupt block:[/] {c}")

    src = open_source(source, cfg.kafka, topic=topic, since_ms=options.since_ms, until_ms=options.until_ms,
                      skip_corrupt=skip_corrupt, on_corrupt=on_corrupt, resolve_topic=resolve)
    target_topic = resolve(target)
    try:
        if create_target:
            _create_target(cfg, target_topic, src.partitions)
        replayer = Replayer(cfg.kafka, target_topic, options)
        total = src.total if options.limit is None or src.total is None else min(src.total, options.limit)
        columns = (
            SpinnerColumn(), TextColumn("[bold]{task.description}"), BarColumn(), MofNCompleteColumn(),
            TextColumn("{task.fields[detail]}"), TimeElapsedColumn(),
        )
        with Progress(*columns, console=err_console) as progress:
            progress.console.print(f"replaying {src.description} → {target_topic}")
            task = progress.add_task("replay", total=total, detail="")

            def on_progress(s: ReplayStats) -> None:
                detail = f"published {s.published:,} · filtered {s.filtered_out:,} · {s.rate:,.1f}/s"
                progress.update(task, completed=s.read if options.limit is None else s.sent, detail=detail)

            try:
                stats = replayer.run(src.records, on_progress)
            except KeyboardInterrupt:
                stats = replayer.stats
                err_console.print("[yellow]interrupted[/]: records sent so far were flushed")
    finally:
        src.close()
    console.print(
        f"read {stats.read:,} · published {stats.published:,} · filtered out {stats.filtered_out:,} · "
        f"undecodable {stats.undecodable:,} · re-encoded {stats.reencoded:,} · corrupt blocks {len(corrupt)} · "
        f"{stats.elapsed_s:.1f} s · {stats.rate:,.1f} records/s"
    )


def _create_target(cfg: object, topic: str, partitions: int | None) -> None:
    """Creates `topic` if it is missing: an experiment's stream as `astraflow topics create --stream`
    makes it, with the source's partition count."""
    from astraflow.archive.errors import ReplayError
    from astraflow.kafka.topics import TopicAdmin, Topics, TopicSpec, experiment_of, stream_spec

    c: Any = cfg
    admin = TopicAdmin(c.kafka)
    if topic in admin.list(topic):
        return
    exp = experiment_of(topic)
    if exp is not None:
        spec = stream_spec(exp, topic.removeprefix(Topics(exp).prefix), c.topics, partitions)
    elif partitions is None:
        raise ReplayError(f"cannot tell how many partitions {topic} needs; create it first")
    else:
        spec = TopicSpec(topic, partitions, {"cleanup.policy": "delete"})
    admin.create([spec], c.topics.replication_factor)
    err_console.print(f"created {topic} ({spec.partitions} partitions)")
