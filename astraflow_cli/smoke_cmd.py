"""`astraflow smoke`: proves a cluster works with AstraFlow end to end in a few seconds.

Creates a throwaway experiment's topics, produces typed records through the Avro serde,
consumes them back, dead-letters one corrupt record, and deletes the topics again.
"""

from __future__ import annotations

import time
import uuid

import typer

from astraflow_cli.common import console, handle_errors, load


@handle_errors
def smoke(ctx: typer.Context, records: int = typer.Option(100, help="Trajectories to round-trip.")) -> None:
    """Round-trip trajectories through the configured Kafka (and the DLQ), then clean up."""
    from astraflow.kafka.clients import RecordConsumer, RecordProducer
    from astraflow.kafka.received import DeadLetterWriter
    from astraflow.kafka.topics import TopicAdmin, Topics, topic_specs
    from astraflow.records import DeadLetter, Trajectory
    from astraflow.testing import make_trajectory

    cfg = load(ctx)
    exp = f"smoke-{uuid.uuid4().hex[:8]}"
    topics = Topics(exp)
    admin = TopicAdmin(cfg.kafka)
    specs = topic_specs(exp, ["policy"], cfg.topics)
    t0 = time.monotonic()
    admin.create(specs, cfg.topics.replication_factor)
    try:
        producer = RecordProducer(cfg.kafka)
        for i in range(records):
            producer.send(topics.rollouts, make_trajectory(1024, task_id=f"task-{i}", seed=i), key=f"g-{i}")
        producer.send_raw(topics.rollouts, b"\x00\x01 corrupt", key=b"bad")
        producer.flush()
        dlq = DeadLetterWriter(producer, topics.dlq, component="smoke")
        consumer = RecordConsumer(cfg.kafka, topics.group("smoke"), [topics.rollouts], component="smoke", dlq=dlq, expect=Trajectory)
        got: set[str] = set()
        deadline = time.monotonic() + 30
        while (len(got) < records or consumer.dead_lettered < 1) and time.monotonic() < deadline:
            got.update(r.record.trajectory_id for r in consumer.poll_batch(500, 0.5))
        consumer.commit()
        consumer.close()
        dl_consumer = RecordConsumer(cfg.kafka, topics.group("smoke-dlq"), [topics.dlq], component="smoke", dlq=None, expect=DeadLetter)
        letters = []
        while not letters and time.monotonic() < deadline:
            letters = dl_consumer.poll_batch(10, 0.5)
        dl_consumer.close()
    finally:
        admin.delete([s.name for s in specs])
        admin.delete_groups([topics.group("smoke"), topics.group("smoke-dlq")])
    ok = len(got) == records and len(letters) == 1
    console.print(
        f"{'[green]OK[/]' if ok else '[red]FAILED[/]'} {len(got)}/{records} trajectories round-tripped through "
        f"{cfg.kafka.bootstrap_servers}; corrupt record dead-lettered: "
        f"{letters[0].record.error_class if letters else 'no'} ({time.monotonic() - t0:.1f}s)"
    )
    if not ok:
        raise typer.Exit(1)
