"""Stream apps throughput: records/s through reward + curate, against a plain consume-produce loop.

Same run, same broker, same records: N trajectories of 4,096 tokens (groups of 8, half the
answers right so no group is filtered) go through

* ours: the `reward` app (decode, exact-match reward, lineage, encode) then the `curate` app
  (decode, group assembly, filters, GRPO, one TrainSample per trajectory, feedback), each a
  `StreamWorker` with its commit-after-processing, DLQ and metrics;
* plain: two confluent-kafka loops that copy the bytes unchanged (consume -> produce, same
  producer settings as ours: idempotent, acks=all, zstd), the floor any Kafka app pays.

Stages run one after another on an otherwise idle pipeline; a stage's time runs from its first
record consumed until the broker holds all its outputs (end offsets polled every 20 ms).
Records/s through the pipeline = N / (stage 1 time + stage 2 time), with each stage's best
time over `--repeats` fresh experiments (shared machines are noisy).

Usage: python bench/apps.py [--quick] [--json OUT] [--records N] [--tokens 4096]
"""

from __future__ import annotations

import argparse
import threading
import time
import uuid
from typing import Any

import _common
from confluent_kafka import Consumer, Producer

from astraflow.config import KafkaSettings, TopicSettings
from astraflow.kafka.clients import (
    RecordProducer,
    producer_config,
    watermarks,
)
from astraflow.kafka.topics import TopicAdmin, Topics, TopicSpec, topic_specs
from astraflow.serde import AvroSerde
from stream_apps.launch import AppOptions, build_worker
from stream_apps.runtime import WorkerSettings

write_json = _common.write_json

PARTITIONS = 2


class Finish:
    """Polls a topic's end offsets until they sum to `n`; records when that happened."""

    def __init__(self, kafka: KafkaSettings, topic: str, n: int) -> None:
        self.kafka, self.topic, self.n = kafka, topic, n
        self.at: float | None = None
        self._thread = threading.Thread(target=self._watch, daemon=True)
        self._thread.start()

    def _watch(self) -> None:
        c = Consumer({**self.kafka.client_config(), "group.id": f"bench-watch-{uuid.uuid4().hex}"})
        try:
            while sum(watermarks(c, self.topic, p)[1] for p in range(PARTITIONS)) < self.n:
                time.sleep(0.02)
            self.at = time.monotonic()
        finally:
            c.close()

    def wait(self, timeout_s: float) -> float:
        self._thread.join(timeout_s)
        if self.at is None:
            raise SystemExit(f"{self.topic} did not reach {self.n} records within {timeout_s:.0f}s")
        return self.at


def plain_stage(kafka: KafkaSettings, src: str, dst: str, n: int, serde: AvroSerde) -> float:
    """Copies n records src -> dst with a bare confluent-kafka loop; returns seconds."""
    done = Finish(kafka, dst, n)
    producer = Producer(producer_config(kafka, serde.max_record_bytes))
    consumer = Consumer({
        **kafka.client_config(), "group.id": f"bench-plain-{uuid.uuid4().hex}", "enable.auto.commit": False,
        "auto.offset.reset": "earliest", "isolation.level": "read_committed",
        "fetch.message.max.bytes": serde.max_record_bytes + 64 * 1024,
    })
    consumer.subscribe([src])
    first, copied, last_commit = None, 0, time.monotonic()
    while copied < n:
        msgs = consumer.consume(256, 0.2)
        for m in msgs:
            if m.error() is not None:
                continue
            if first is None:
                first = time.monotonic()
            _common.produce_blocking(producer, dst, m.value(), m.key())
            copied += 1
        producer.poll(0)
        if time.monotonic() - last_commit >= 1.0:  # same commit rule as ours: flush, then commit
            producer.flush()
            consumer.commit(asynchronous=False)
            last_commit = time.monotonic()
    producer.flush()
    consumer.commit(asynchronous=False)
    consumer.close()
    assert first is not None
    return done.wait(120) - first


def our_stage(kafka: KafkaSettings, app: str, experiment: str, out_topic: str, n: int, options: AppOptions | None) -> float:
    """Runs one app worker until its outputs reached the broker; returns seconds from its first record."""
    done = Finish(kafka, out_topic, n)
    worker = build_worker(app, WorkerSettings(experiment, kafka, metrics_interval_s=5.0), options)
    thread = worker.start_thread()
    try:
        end = done.wait(120)
    finally:
        worker.stop()
        thread.join(60)
    if worker.error is not None:
        raise SystemExit(f"{app} failed: {worker.error!r}")
    assert worker.stats.first_in_at is not None
    return end - worker.stats.first_in_at


def fill(kafka: KafkaSettings, topic: str, n: int, tokens: int, group_size: int) -> int:
    """Produces `_common.trajectories` to `topic`; returns the encoded size of one."""
    producer = RecordProducer(kafka)
    size = 0
    for t in _common.trajectories(n, tokens, group_size):
        data = producer.serde.dumps(t)
        size = len(data)
        producer.send_raw(topic, data, key=t.group_id)
    producer.flush(120)
    return size


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    args, n, repeats, kafka = _common.stream_args(ap, "stream_apps", "records")
    serde = AvroSerde()
    times: dict[str, list[float]] = {"p1": [], "o1": [], "p2": [], "o2": []}
    size = 0
    for r in range(repeats):  # a fresh experiment each time; the best time of each stage counts
        exp = f"bench-{uuid.uuid4().hex[:8]}"
        topics = Topics(exp)
        plain1, plain2 = topics.stream("plain1"), topics.stream("plain2")
        specs = [*topic_specs(exp, ["policy"], TopicSettings(partitions=PARTITIONS)),
                 TopicSpec(plain1, PARTITIONS), TopicSpec(plain2, PARTITIONS)]
        admin = TopicAdmin(kafka)
        admin.create(specs)
        try:
            print(f"[{r + 1}/{repeats}] producing {n:,} trajectories of {args.tokens:,} tokens ...", flush=True)
            size = fill(kafka, topics.rollouts, n, args.tokens, args.group_size)
            # Interleaved so that machine noise hits both sides alike.
            times["p1"].append(plain_stage(kafka, topics.rollouts, plain1, n, serde))
            times["o1"].append(our_stage(kafka, "reward", exp, topics.scored, n, None))
            times["p2"].append(plain_stage(kafka, plain1, plain2, n, serde))
            times["o2"].append(our_stage(kafka, "curate", exp, topics.train("policy"), n, AppOptions(policies=["policy"])))
        finally:
            admin.delete([s.name for s in specs])
    p1, o1, p2, o2 = (min(times[k]) for k in ("p1", "o1", "p2", "o2"))
    plain_rate, ours_rate = n / (p1 + p2), n / (o1 + o2)
    rows: list[tuple[str, Any]] = [
        ("records", f"{n:,} trajectories, {args.tokens:,} tokens, {size:,} bytes each, {PARTITIONS} partitions, "
                    f"best of {repeats}"),
        ("plain copy loop, stage 1 /s", f"{n / p1:,.0f}"),
        ("plain copy loop, stage 2 /s", f"{n / p2:,.0f}"),
        ("reward app /s", f"{n / o1:,.0f}"),
        ("curate app /s", f"{n / o2:,.0f}"),
        ("plain loop, 2 stages /s", f"{plain_rate:,.0f}"),
        ("reward + curate /s", f"{ours_rate:,.0f}"),
        ("reward + curate vs plain loop (1.0 = as fast)", f"{ours_rate / plain_rate:.2f}x"),
    ]
    _common.print_rows(rows)
    write_json(args.json, "stream_apps", {
        "records": n, "tokens": args.tokens, "bytes": size, "partitions": PARTITIONS, "repeats": repeats,
        "stage_seconds": times,
        "plain_stage1_per_s": n / p1, "plain_stage2_per_s": n / p2, "reward_per_s": n / o1, "curate_per_s": n / o2,
        "plain_pipeline_per_s": plain_rate, "ours_pipeline_per_s": ours_rate, "ratio_vs_plain": ours_rate / plain_rate,
    })


if __name__ == "__main__":
    main()
