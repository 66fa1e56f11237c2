"""Hot swap on a real broker: `astraflow control set` mid-stream, two reward workers, counted.

Trajectories flow continuously through two reward workers (one consumer group, a partition
each) while the reward strategy is switched from exact_match to numeric with the CLI. Every
worker applies the change within a second of the record being written; on every partition the
strategy changes exactly once (records before the switch keep the old one, later ones get the
new one), and the scored topic holds each trajectory exactly once: nothing lost or duplicated.
"""

from __future__ import annotations

import json
import threading
import time
import uuid

from confluent_kafka import Consumer
from typer.testing import CliRunner

from astraflow.config import KafkaSettings
from astraflow.kafka.clients import RecordProducer
from astraflow.kafka.topics import Topics
from astraflow.records import Trajectory
from astraflow.serde import AvroSerde
from astraflow.testing import make_trajectory
from astraflow_cli.main import app as cli
from stream_apps.engine import EngineSettings
from stream_apps.launch import build_worker

N = 400


def produce_steadily(kafka: KafkaSettings, topic: str, where: dict[str, tuple[int, int]], produced: list[int]) -> None:
    """N trajectories at ~200/s; records each one's (partition, offset) as Kafka acknowledges it."""
    producer = RecordProducer(kafka)
    t = make_trajectory(64)
    t.final_answer, t.reference = "4.2", '{"answer": "4"}'  # exact_match: 0, numeric(abs_tol=0.5): 1
    for i in range(N):
        t.trajectory_id, t.group_id = f"t-{i}", f"g-{i % 16}"

        def delivered(err, msg, tid=t.trajectory_id) -> None:
            assert err is None, err
            where[tid] = (msg.partition(), msg.offset())

        producer.send(topic, t, key=t.group_id, on_delivery=delivered)
        produced[0] = i + 1
        time.sleep(0.005)
    producer.flush()


def test_strategy_swapped_mid_stream_applies_to_later_records_only(kafka: KafkaSettings, experiment: str) -> None:
    topics = Topics(experiment)
    env = {"ASTRAFLOW__KAFKA__BOOTSTRAP_SERVERS": kafka.bootstrap_servers}
    workers = [build_worker("reward", EngineSettings(experiment, kafka, metrics_interval_s=60)) for _ in range(2)]
    threads = [w.start_thread() for w in workers]
    where: dict[str, tuple[int, int]] = {}
    produced = [0]
    feeder = threading.Thread(target=produce_steadily, args=(kafka, topics.rollouts, where, produced))
    try:
        deadline = time.monotonic() + 30
        while not all(len(w.assigned()) == 1 for w in workers):  # one partition each
            assert time.monotonic() < deadline, "the two workers should share the partitions by now"
            time.sleep(0.05)
        feeder.start()
        while not (all(w.stats.records_in > 0 for w in workers) and produced[0] >= 150):
            assert time.monotonic() < deadline, "both workers should be consuming by now"
            time.sleep(0.05)
        assert produced[0] < N - 50, "the producer must still be running during the swap"
        result = CliRunner().invoke(cli, ["control", "set", "-e", experiment, "reward", "reward", "numeric",
                                          "--param", "abs_tol=0.5"], env=env)
        assert result.exit_code == 0, result.output
        written_at = time.time()  # the command returned: the record is in the log
        feeder.join(60)
        serde = AvroSerde()
        # read_committed (the default): what a downstream consumer sees of the transactions
        c = Consumer({**kafka.client_config(), "group.id": f"check-{uuid.uuid4().hex}", "auto.offset.reset": "earliest"})
        c.subscribe([topics.scored])
        deadline = time.monotonic() + 40
        scored: list[Trajectory] = []
        quiet_until = None
        while time.monotonic() < deadline:
            got = [serde.loads(m.value(), Trajectory) for m in c.consume(500, 0.5) if m.error() is None]
            scored += got
            if len(scored) >= N and not got:
                quiet_until = quiet_until or time.monotonic() + 2.0  # anything extra (a duplicate) would show now
                if time.monotonic() >= quiet_until:
                    break
        c.close()
        total = len(scored)
    finally:
        for w in workers:
            w.stop()
        for t in threads:
            t.join(30)
    assert all(w.error is None for w in workers)

    # Counted: every trajectory exactly once.
    assert total == N
    assert sorted(t.trajectory_id for t in scored) == sorted(f"t-{i}" for i in range(N))

    # Every worker applied the swap within a second of the control record being written.
    for w in workers:
        control = w.control.get("reward")
        assert control is not None and control.strategy == "numeric" and control.version == 1
        assert w.control.last_change_at - written_at < 1.0

    # Per input partition, in input order: the old strategy, then the new one, switching once.
    by_partition: dict[int, list[tuple[int, str, float]]] = {}
    for t in scored:
        partition, offset = where[t.trajectory_id]
        by_partition.setdefault(partition, []).append((offset, t.lineage[-1].name, t.reward))
    names = []
    for partition, rows in sorted(by_partition.items()):
        seq = [name for _, name, _ in sorted(rows)]
        switch = seq.index("numeric") if "numeric" in seq else len(seq)
        assert seq == ["exact_match"] * switch + ["numeric"] * (len(seq) - switch), f"partition {partition} switched twice"
        names += seq
        assert all(r == (1.0 if n == "numeric" else 0.0) for _, n, r in rows)
    assert 0 < names.count("numeric") < N and len(by_partition) == 2

    # The CLI shows the selection, and unset goes back to the default.
    shown = CliRunner().invoke(cli, ["control", "show", "-e", experiment, "--json"], env=env)
    assert shown.exit_code == 0 and json.loads(shown.output)[0]["strategy"] == "numeric"
    assert CliRunner().invoke(cli, ["control", "unset", "-e", experiment, "reward", "reward"], env=env).exit_code == 0
    assert json.loads(CliRunner().invoke(cli, ["control", "show", "-e", experiment, "--json"], env=env).output) == []
    bad = CliRunner().invoke(cli, ["control", "set", "-e", experiment, "reward", "reward", "no_such_reward"], env=env)
    assert bad.exit_code == 1 and "no reward strategy named" in bad.output and "exact_match" in bad.output
