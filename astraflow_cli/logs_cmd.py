"""`astraflow logs show`: read trajectories (or any record) from a topic or an archive."""

from __future__ import annotations

import typer

from astraflow_cli.common import console, err_console, handle_errors, load

app = typer.Typer(help="Inspect an experiment's records: trajectories, train samples, dead letters.", no_args_is_help=True)


@app.command()
@handle_errors
def show(
    ctx: typer.Context,
    experiment: str | None = typer.Option(None, "--experiment", "-e", help="Experiment whose stream --topic names."),
    topic: str = typer.Option("rollouts", "--topic", "-t", help="Stream name (rollouts, scored, solver.train) or full topic name."),
    archive: str | None = typer.Option(None, "--archive", help="Read this archive (directory or URI) instead of Kafka."),
    ident: str | None = typer.Option(None, "--id", help="Only records with this trajectory, task, group, sample or prompt id (or key)."),
    filter_: str | None = typer.Option(None, "--filter", help="Only records matching, e.g. \"reward > 0.5\" (see docs/archive.md)."),
    since: str | None = typer.Option(None, "--since", help="From this time (ISO, epoch, or 2h / 30m ago)."),
    until: str | None = typer.Option(None, "--until", help="Up to this time."),
    follow: bool = typer.Option(False, "--follow", "-f", help="Keep printing new records as they arrive (Kafka only)."),
    as_json: bool = typer.Option(False, "--json", help="One JSON object per line, packed arrays as lists."),
    limit: int = typer.Option(20, "--limit", "-n", help="Show the most recent N matches (0: all)."),
    max_text: int = typer.Option(2000, "--max-text", help="Clip each text to this many characters (0: never)."),
    skip_corrupt: bool = typer.Option(False, "--skip-corrupt", help="Skip and report corrupted archive blocks."),
) -> None:
    """Print records as a person reads them: turns, tool calls, rewards, versions, node, timings."""
    import json
    import sys
    from collections import deque
    from collections.abc import Iterator

    from astraflow.archive.errors import ArchiveError
    from astraflow.archive.filter import RecordFilter, parse_time, record_env
    from astraflow.archive.format import ArchivedRecord
    from astraflow.archive.render import matches_id, record_json, render_record
    from astraflow.errors import SerdeError
    from astraflow.kafka.topics import Topics
    from astraflow.serde import AvroSerde

    cfg = load(ctx)
    since_ms = parse_time(since) if since else None
    until_ms = parse_time(until) if until else None
    name = Topics(experiment).stream(topic) if experiment else topic
    rfilter = RecordFilter(filter_) if filter_ else None
    serde = AvroSerde()
    close = lambda: None  # noqa: E731
    records: Iterator[ArchivedRecord]
    if archive is not None:
        if follow:
            raise ArchiveError("--follow reads Kafka; an archive does not grow while you read it (drop --archive)")
        from astraflow.archive.reader import ArchiveReader

        reader = ArchiveReader(archive, skip_corrupt=skip_corrupt,
                               on_corrupt=lambda c: err_console.print(f"[yellow]skipped corrupt block:[/] {c}"))
        name = reader.resolve_topic(name)
        records = reader.read_topic(name, since_ms, until_ms)
    else:
        from astraflow.kafka.topics import PREFIX

        if not experiment and not name.startswith(PREFIX):
            raise ArchiveError(f"pass --experiment to read its {topic!r} stream, or a full topic name, or --archive DIR")
        from astraflow.kafka.topics import TopicAdmin, experiment_of

        exp = experiment or experiment_of(name)
        existing = TopicAdmin(cfg.kafka).experiment(exp) if exp else {}  # one line naming a missing experiment
        if exp and name not in existing:
            streams = ", ".join(t.removeprefix(Topics(exp).prefix) for t in existing if not t.endswith("-changelog"))
            raise ArchiveError(f"experiment {exp} has no stream {name.removeprefix(Topics(exp).prefix)!r}; its streams: "
                               f"{streams} (`astraflow topics list -e {exp}`)")
        from astraflow.archive.kafka_source import TopicSource

        tail = limit if limit and ident is None and rfilter is None else None
        src = TopicSource(cfg.kafka, name, since_ms=since_ms, until_ms=until_ms, follow=follow, tail=tail)
        records, close = src.records(on_caught_up=lambda: print_kept()), src.close

    def emit(rec: ArchivedRecord, fullname: str | None, datum: dict | None, error: str | None) -> None:
        if as_json:
            sys.stdout.write(json.dumps(record_json(rec, fullname, datum, error)) + "\n")
            sys.stdout.flush()
        else:
            console.print(render_record(rec, fullname, datum, error, max_text))

    kept: dict[int, deque] = {}
    state = {"live": False, "shown": 0}

    def print_kept() -> None:
        """Prints the most recent `limit` matches read so far, in time order."""
        matched = sorted((x for d in kept.values() for x in d), key=lambda x: (x[0].timestamp_ms, x[0].partition, x[0].offset))
        for item in matched[-limit:] if limit else matched:
            emit(*item)
            state["shown"] += 1
        kept.clear()
        state["live"] = follow  # from now on, print each match as it arrives

    try:
        for rec in records:
            error = None
            try:
                fullname, datum = serde.decode(rec.value)
            except SerdeError as exc:
                fullname, datum, error = None, None, str(exc)
            if ident is not None and not matches_id(rec, datum, ident):
                continue
            if rfilter is not None and (datum is None or not rfilter(
                    record_env(fullname, datum, rec.topic, rec.partition, rec.offset, rec.timestamp_ms, rec.key))):
                continue
            if state["live"]:
                emit(rec, fullname, datum, error)
                state["shown"] += 1
            else:
                kept.setdefault(rec.partition, deque(maxlen=limit or None)).append((rec, fullname, datum, error))
    except KeyboardInterrupt:
        pass
    finally:
        close()
    print_kept()
    if not state["shown"] and not as_json:
        console.print(f"[dim]no matching records in {archive or name}[/]")
