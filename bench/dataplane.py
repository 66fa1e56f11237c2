"""Data plane throughput: trajectories/s from rollout to a collated training batch, against raw Kafka.

Same run, same broker, the same N distinct trajectories of 4,096 tokens (groups of 8, half the
answers right so curate keeps every group), the whole path running concurrently as it does in
a real run:

* ours: encode each Trajectory (AvroSerde) and produce it to `rollouts`; the `reward` app and
  the `curate` app (in-process Faust workers, `StreamEngine`s, built by `stream_apps.launch.build_worker`) turn
  them into TrainSamples on the train topic; the trainer's `trainers.data.TrainStream` reads
  them and collates padded batches of 32 (the tensors Lightning gets). Timed from the first
  encode until the batch holding the N-th sample is collated.
* raw: the very same encoded bytes (encoded before the clock starts) produced to a topic, copied
  by two bare confluent-kafka consume-produce loops (same hops: rollouts -> scored -> train),
  and consumed by a bare consumer. Timed from the first produce until the N-th record is read.
  Producer settings are ours (idempotent, acks=all, zstd), so the floor is what Kafka costs.

What ours adds over raw: serde (decode + encode at every hop), rewards, group assembly, GRPO,
lineage, commit-after-processing, and the trainer's decode + checks + padding into tensors.
Best of `--repeats` fresh experiments for each side; sides alternate so noise hits both alike.

Usage: python bench/dataplane.py [--quick] [--json OUT] [--records N] [--tokens 4096]
"""

from __future__ import annotations

import argparse
import threading
import time
import uuid
from typing import Any

import _common
from confluent_kafka import Consumer, KafkaError, KafkaException, Producer

from astraflow.config import KafkaSettings, TopicSettings
from astraflow.kafka.clients import RecordProducer, producer_config, reader
from astraflow.kafka.topics import TopicAdmin, Topics, TopicSpec, topic_specs
from astraflow.records import Trajectory
from astraflow.serde import AvroSerde
from stream_apps.engine import EngineSettings
from stream_apps.launch import AppOptions, build_worker
from trainers.batching import BatchLimits
from trainers.data import TrainStream

machine, write_json, trajectories = _common.machine, _common.write_json, _common.trajectories

TERMS = {  # what the figures compare (written into the results JSON)
    "ours": "encode + produce, reward and curate apps (exactly-once), the trainer's TrainStream collating batches of 32",
    "against": "the same bytes through two bare confluent-kafka copy loops to a bare consumer (same producer settings)",
    "settings": "2,048 distinct 4,096-token trajectories (quick 512), one broker, best of 3 (quick 1) per side",
}


PARTITIONS = 2
BATCH = 32


def consumer(kafka: KafkaSettings, topic: str, serde: AvroSerde, joined: threading.Event | None = None) -> Consumer:
    """A bare consumer of `topic`; sets `joined` once the group gave it its partitions."""
    c = reader(kafka, f"bench-raw-{uuid.uuid4().hex}", serde.max_record_bytes)
    c.subscribe([topic], on_assign=lambda cons, parts: joined.set() if joined is not None and parts else None)
    return c


def produce_all(producer: Producer, topic: str, items: list[tuple[bytes, str]]) -> None:
    for value, key in items:
        _common.produce_blocking(producer, topic, value, key)
        producer.poll(0)
    producer.flush()


def commit(c: Consumer) -> None:
    """Synchronous commit of what was consumed; nothing new since the last one is fine."""
    try:
        c.commit(asynchronous=False)
    except KafkaException as exc:
        if exc.args[0].code() != KafkaError._NO_OFFSET:
            raise


def copy_loop(kafka: KafkaSettings, src: str, dst: str, n: int, serde: AvroSerde, errors: list[BaseException],
              joined: threading.Event) -> None:
    """Bare consume -> produce of n records, committing every second after a flush (as ours does)."""
    try:
        producer = Producer(producer_config(kafka, serde.max_record_bytes))
        c = consumer(kafka, src, serde, joined)
        copied, last_commit = 0, time.monotonic()
        while copied < n:
            for m in c.consume(256, 0.05):
                if m.error() is not None:
                    continue
                _common.produce_blocking(producer, dst, m.value(), m.key())
                copied += 1
            producer.poll(0)
            if time.monotonic() - last_commit >= 1.0:
                producer.flush()
                commit(c)
                last_commit = time.monotonic()
        producer.flush()
        commit(c)
        c.close()
    except BaseException as exc:  # reported by the main thread
        errors.append(exc)


def wait_joined(done: Any, step: Any, timeout_s: float = 60.0) -> None:
    """Group joins are start-up, not throughput: the clock starts once every consumer has partitions."""
    deadline = time.monotonic() + timeout_s
    while not done():
        if time.monotonic() > deadline:
            raise SystemExit("consumers did not join their groups within 60 s")
        step()


def raw_run(kafka: KafkaSettings, encoded: list[tuple[bytes, str]], serde: AvroSerde, timeout_s: float) -> float:
    """Seconds for the encoded bytes to cross 3 topics through 2 bare copy loops to a bare consumer."""
    n = len(encoded)
    names = [f"bench-raw-{uuid.uuid4().hex[:8]}.{k}" for k in ("a", "b", "c")]
    admin = TopicAdmin(kafka)
    admin.create([TopicSpec(t, PARTITIONS) for t in names])
    try:
        errors: list[BaseException] = []
        joined = [threading.Event() for _ in range(3)]
        sink = consumer(kafka, names[2], serde, joined[2])
        loops = [threading.Thread(target=copy_loop, args=(kafka, names[i], names[i + 1], n, serde, errors, joined[i]),
                                  daemon=True) for i in range(2)]
        for t in loops:
            t.start()
        wait_joined(lambda: all(e.is_set() for e in joined), lambda: sink.consume(1, 0.1) and None)
        producer = Producer(producer_config(kafka, serde.max_record_bytes))
        t0 = time.monotonic()
        feeder = threading.Thread(target=produce_all, args=(producer, names[0], encoded), daemon=True)
        feeder.start()
        got, deadline = 0, t0 + timeout_s
        while got < n:
            got += sum(m.error() is None for m in sink.consume(500, 0.05))
            if got < n and (errors or time.monotonic() > deadline):
                raise SystemExit(f"raw side stalled at {got}/{n}: {errors!r}")
        elapsed = time.monotonic() - t0
        sink.close()
        feeder.join(30)
        for t in loops:
            t.join(30)
        return elapsed
    finally:
        admin.delete(names)


def ours_run(kafka: KafkaSettings, trajs: list[Trajectory], timeout_s: float) -> tuple[float, int]:
    """Seconds from the first encode to the collated batch holding the N-th TrainSample; batches."""
    n = len(trajs)
    exp = f"bench-dp-{uuid.uuid4().hex[:8]}"
    topics = Topics(exp)
    specs = topic_specs(exp, ["policy"], TopicSettings(partitions=PARTITIONS))
    admin = TopicAdmin(kafka)
    admin.create(specs)
    from astraflow.testing import issue_tasks

    issue_tasks(kafka, exp, trajs)  # curate takes each group from its task, as the curator signed it
    workers = [build_worker("reward", EngineSettings(exp, kafka, metrics_interval_s=60.0)),
               build_worker("curate", EngineSettings(exp, kafka, metrics_interval_s=60.0), AppOptions(policies=["policy"]))]
    threads = [w.start_thread() for w in workers]
    stream = TrainStream(kafka, topics.train("policy"), "policy", limits=BatchLimits(batch_size=BATCH), max_wait_s=0.5,
                         deadline=time.monotonic() + timeout_s)
    try:
        stream._open()  # assignment before the clock, as a running trainer has it
        wait_joined(lambda: all(w.assigned for w in workers), lambda: time.sleep(0.05))
        producer = RecordProducer(kafka)

        def feed() -> None:
            for t in trajs:
                producer.send_raw(topics.rollouts, producer.serde.dumps(t), key=t.group_id)
            producer.flush(120)

        t0 = time.monotonic()
        feeder = threading.Thread(target=feed, daemon=True)
        feeder.start()
        seen = batches = 0
        for batch in stream:
            seen += int(batch["input_ids"].shape[0])
            batches += 1
            if seen >= n:
                break
        elapsed = time.monotonic() - t0
        if seen < n:
            errs = [repr(w.error) for w in workers if w.error is not None]
            raise SystemExit(f"the trainer got {seen}/{n} samples within {timeout_s:.0f}s {errs}")
        feeder.join(30)
        return elapsed, batches
    finally:
        stream.close()
        for w in workers:
            w.stop()
        for t in threads:
            t.join(60)
        admin.delete([s.name for s in specs])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    args, n, repeats, kafka = _common.stream_args(ap, "dataplane", "trajectories")
    serde = AvroSerde()
    print(f"making {n:,} trajectories of {args.tokens:,} tokens ...", flush=True)
    trajs = trajectories(n, args.tokens, args.group_size)
    encoded = [(serde.dumps(t), t.group_id) for t in trajs]
    size = len(encoded[0][0])
    timeout = 60 + n * 0.2
    raw_s: list[float] = []
    ours_s: list[float] = []
    batches = 0
    for r in range(repeats):
        raw_s.append(raw_run(kafka, encoded, serde, timeout))
        print(f"[{r + 1}/{repeats}] raw {n / raw_s[-1]:,.0f}/s", flush=True)
        elapsed, batches = ours_run(kafka, trajs, timeout)
        ours_s.append(elapsed)
        print(f"[{r + 1}/{repeats}] ours {n / ours_s[-1]:,.0f}/s", flush=True)
    raw_rate, ours_rate = n / min(raw_s), n / min(ours_s)
    m = machine()
    rows: list[tuple[str, Any]] = [
        ("machine", f"{m['cpu']}, {m['cores']} cores"),
        ("records", f"{n:,} trajectories, {args.tokens:,} tokens, {size:,} bytes each, {PARTITIONS} partitions, "
                    f"best of {repeats}"),
        ("raw confluent-kafka, 3 topics, 2 copy loops /s", f"{raw_rate:,.0f}  ({raw_rate * size / 1e6:,.0f} MB/s)"),
        ("ours: serde + reward + curate + TrainStream /s", f"{ours_rate:,.0f}  ({batches} batches of {BATCH})"),
        ("ours vs raw Kafka (1.0 = as fast)", f"{ours_rate / raw_rate:.2f}x"),
    ]
    _common.print_rows(rows)
    write_json(args.json, "dataplane", {
        "records": n, "tokens": args.tokens, "bytes": size, "partitions": PARTITIONS, "repeats": repeats,
        "batch_size": BATCH, "raw_seconds": raw_s, "ours_seconds": ours_s,
        "raw_per_s": raw_rate, "ours_per_s": ours_rate, "ratio_vs_raw": ours_rate / raw_rate,
    }, terms=TERMS, quick=args.quick)


if __name__ == "__main__":
    main()
