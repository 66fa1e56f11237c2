"""`astraflow archive run | ls | verify`: archive topics into Avro files and look after the archive.

`archive run` starts the archive app (`stream_apps/archive.py`); its Kafka settings come from the
global `--config` / `--set` and `ASTRAFLOW__*` like every command's.
"""

from __future__ import annotations

import json
import logging
from typing import Any

import typer
from rich.table import Table

from astraflow_cli.common import console, err_console, handle_errors, load

app = typer.Typer(help="Archive topics into Avro container files; list and verify archives.", no_args_is_help=True)


@app.command("run")
@handle_errors
def run_(
    ctx: typer.Context,
    topics: list[str] = typer.Option(..., "--topics", "-t", help="Stream names (rollouts) or full topic names; comma-separated or repeated."),
    to: str = typer.Option(..., "--to", help="Archive root: a directory or an fsspec URI (s3://bucket/path)."),
    experiment: str | None = typer.Option(None, "--experiment", "-e", help="Experiment whose streams --topics names."),
    group: str | None = typer.Option(None, "--group", help="Consumer group (default: one per experiment and destination)."),
    instance_id: str | None = typer.Option(None, "--instance-id", help="Stable instance id (static membership: restarts resume at once)."),
    start: str = typer.Option("earliest", "--start", help="earliest | latest | committed: where to begin partitions the archive lacks."),
    max_file_mb: float = typer.Option(64.0, "--max-file-mb", help="Roll files at this size."),
    max_file_age: float = typer.Option(300.0, "--max-file-age", help="Roll files this many seconds after their first record."),
    max_file_records: int | None = typer.Option(None, "--max-file-records", help="Roll files after this many records."),
    block_kb: float = typer.Option(1024.0, "--block-kb", help="Uncompressed KiB per Avro block."),
    exit_when_idle: float | None = typer.Option(None, "--exit-when-idle", help="Exit once no record came for this many seconds."),
) -> None:
    """Archive topics until Ctrl-C / SIGTERM (files are sealed and committed before exit)."""
    from astraflow.errors import ConfigError
    from stream_apps.archive import policy_from, resolve_topics, serve

    if start not in ("earliest", "latest", "committed"):
        raise ConfigError(f"--start must be earliest, latest or committed, not {start!r}")
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(message)s")
    cfg = load(ctx)
    names = resolve_topics(experiment, topics)
    console.print(f"archiving {', '.join(names)} into {to}")
    endpoint, on_seal = _metrics(experiment, instance_id)
    try:
        stats = serve(cfg.kafka, names, to, group=group, experiment=experiment, start=start,  # type: ignore[arg-type]
                      policy=policy_from(max_file_mb, max_file_age, max_file_records, block_kb),
                      exit_when_idle_s=exit_when_idle, instance_id=instance_id, on_seal=on_seal)
    finally:
        if endpoint is not None:
            endpoint.close()
    console.print(f"archived {stats.records:,} records into {stats.files} files ({stats.bytes / 2**20:.1f} MiB); "
                  f"{stats.skipped:,} already archived were skipped")


def _metrics(experiment: str | None, instance_id: str | None) -> tuple[Any, Any]:
    """The archive's /metrics endpoint (opt-in: ASTRAFLOW_METRICS_PORT) and the seal callback feeding it."""
    import os
    import socket

    from astraflow.metrics_export import serve_role
    from astraflow.records import Metric

    process = instance_id or f"archive-{socket.gethostname()}-{os.getpid()}"
    endpoint = serve_role(experiment or "", "archive", process)
    if endpoint is None:
        return None, None
    totals = {"records_out_total": 0.0, "files_sealed_total": 0.0, "bytes_sealed_total": 0.0}
    endpoint.observe(*(Metric(name, 0.0, "archive", process, {}) for name in totals))

    def on_seal(m: Any) -> None:
        totals["records_out_total"] += m.records
        totals["files_sealed_total"] += 1
        totals["bytes_sealed_total"] += m.bytes
        endpoint.observe(*(Metric(name, value, "archive", process, {}) for name, value in totals.items()))

    return endpoint, on_seal


@app.command("ls")
@handle_errors
def ls(
    location: str = typer.Argument(..., help="Archive root: a directory or an fsspec URI."),
    as_json: bool = typer.Option(False, "--json", help="One JSON object per partition."),
) -> None:
    """Summarise an archive per topic and partition, from its manifests."""
    from astraflow.archive.reader import ArchiveReader

    reader = ArchiveReader(location)
    rows = []
    for topic in reader.topics():
        for p in reader.partitions(topic):
            files = reader.files(topic, p)
            ms = [f.manifest for f in files if f.manifest is not None]
            schemas: dict[str, int] = {}
            for m in ms:
                for tag, sc in m.schemas.items():
                    label = f"{sc.name} v{sc.version}" if sc.name else tag
                    schemas[label] = schemas.get(label, 0) + sc.records
            rows.append({
                "topic": topic, "partition": p, "files": len(files), "without_manifest": len(files) - len(ms),
                "records": sum(m.records for m in ms), "bytes": sum(m.bytes for m in ms),
                "first_offset": files[0].first_offset if files else None,
                "last_offset": files[-1].last_offset if files else None,
                "min_timestamp_ms": min((m.min_timestamp_ms for m in ms), default=None),
                "max_timestamp_ms": max((m.max_timestamp_ms for m in ms), default=None),
                "schemas": schemas,
            })
    if as_json:
        for r in rows:
            typer.echo(json.dumps(r))
        return
    tables: dict[str, Table] = {}
    for r in rows:
        table = tables.get(r["topic"])
        if table is None:
            table = tables[r["topic"]] = Table("part", "files", "records", "offsets", "first → last record (UTC)", "MiB",
                                               "schemas", title=r["topic"], title_justify="left")
        missing = f" ({r['without_manifest']} without manifest)" if r["without_manifest"] else ""
        table.add_row(
            str(r["partition"]), f"{r['files']}{missing}", f"{r['records']:,}", f"{r['first_offset']}..{r['last_offset']}",
            f"{_short_ts(r['min_timestamp_ms'])} → {_short_ts(r['max_timestamp_ms'])}", f"{r['bytes'] / 2**20:.2f}",
            ", ".join(f"{k.removeprefix('astraflow.')}: {v:,}" for k, v in sorted(r["schemas"].items())),
        )
    for topic, table in tables.items():
        mine = [r for r in rows if r["topic"] == topic]
        table.caption = (f"{topic}: {sum(r['records'] for r in mine):,} records in {len(mine)} partitions, "
                         f"{sum(r['files'] for r in mine)} files, {sum(r['bytes'] for r in mine) / 2**20:.2f} MiB")
        table.caption_justify = "left"
        console.print(table)
    if not tables:
        console.print(f"[dim]{location} holds no archived topics[/]")


def _short_ts(ms: int | None) -> str:
    from astraflow.archive.render import fmt_ts

    return fmt_ts(ms)[:19].replace("T", " ") if ms is not None else "-"


@app.command("verify")
@handle_errors
def verify(location: str = typer.Argument(..., help="Archive root: a directory or an fsspec URI.")) -> None:
    """Read every file, check every block (and each file's SHA-256); list what is corrupt."""
    import hashlib

    from rich.progress import Progress

    from astraflow.archive.reader import ArchiveReader, CorruptBlock, read_blocks

    reader = ArchiveReader(location, skip_corrupt=True)
    problems: list[CorruptBlock] = []
    files = [f for t in reader.topics() for p in reader.partitions(t) for f in reader.files(t, p)]
    problems.extend(reader.corrupt)  # unreadable manifests
    records = 0
    with Progress(console=err_console, transient=True) as progress:
        task = progress.add_task("verifying", total=len(files))
        for f in files:
            data = reader.store.read_bytes(f.path)
            before = len(problems)
            for _, recs in read_blocks(data, f.path, f.manifest, skip_corrupt=True, on_corrupt=problems.append):
                records += len(recs)
            # Blocks carry their own checks; the file hash catches damage between them (header, tail).
            sha_ok = f.manifest is None or hashlib.sha256(data).hexdigest() == f.manifest.sha256
            if len(problems) == before and not sha_ok:
                problems.append(CorruptBlock(f.path, None, None, "SHA-256 differs from the manifest (outside the blocks)"))
            progress.advance(task)
    for c in problems:
        err_console.print(f"[red]corrupt:[/] {c}")
    console.print(f"{len(files)} files, {records:,} readable records, {len(problems)} problems")
    if problems:
        raise typer.Exit(1)
