"""What an idle reader's end-offset look-up costs: per partition through its own consumer, in one
request through it, and in one request through an admin client (`astraflow.kafka.clients.stable_ends`,
what `CompactedReader.catch_up` uses).

A reader assigned to a topic with nothing new has a fetch held by the broker (`fetch.wait.max.ms`,
500 ms); the broker answers one request per connection at a time, so a `get_watermark_offsets`
over the reader's own connection waits for that fetch. Curate's task look-up did that for the 24
partitions of `tasks` and `tasks.b` (docs/deploy-regions.md, *Region B dark*).

    python bench/end_offsets.py                       # the broker of astraflow.yaml / ASTRAFLOW__KAFKA__*
    python bench/end_offsets.py --partitions 12 --rounds 3
"""

from __future__ import annotations

import argparse
import time
import uuid

from confluent_kafka import Producer, TopicPartition

from astraflow.config import load_config
from astraflow.kafka.clients import admin, reader, stable_ends, watermarks
from astraflow.kafka.topics import TopicAdmin, TopicSpec


def main(argv: list[str] | None = None) -> dict[str, list[float]]:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--partitions", type=int, default=12)
    ap.add_argument("--rounds", type=int, default=3)
    a = ap.parse_args(argv)
    kafka = load_config().kafka
    topic = f"bench-end-offsets-{uuid.uuid4().hex[:8]}"
    topics = TopicAdmin(kafka)
    topics.create([TopicSpec(topic, a.partitions, {})])
    out: dict[str, list[float]] = {"per_partition_via_consumer": [], "one_request_via_consumer": [],
                                   "one_request_via_admin": []}
    consumer = reader(kafka, f"bench-end-offsets-{uuid.uuid4().hex[:6]}")
    try:
        producer = Producer(kafka.client_config())
        for p in range(a.partitions):
            producer.produce(topic, b"x", partition=p)
        producer.flush(30)
        consumer.assign([TopicPartition(topic, p, 0) for p in range(a.partitions)])
        for _ in range(10):  # read to the end: from here on its fetches are held by the broker
            consumer.consume(100, 0.2)
        client = admin(kafka)
        stable_ends(client, topic, list(range(a.partitions)))  # metadata and connections, once
        for _ in range(a.rounds):
            t = time.monotonic()
            for p in range(a.partitions):
                watermarks(consumer, topic, p)
            out["per_partition_via_consumer"].append(time.monotonic() - t)
            t = time.monotonic()
            consumer.offsets_for_times([TopicPartition(topic, p, -1) for p in range(a.partitions)], timeout=10)
            out["one_request_via_consumer"].append(time.monotonic() - t)
            t = time.monotonic()
            stable_ends(client, topic, list(range(a.partitions)))
            out["one_request_via_admin"].append(time.monotonic() - t)
    finally:
        consumer.close()
        topics.delete([topic])
    for name, secs in out.items():
        print(f"{name:28s} {a.partitions} partitions: " + ", ".join(f"{s:.3f} s" for s in secs))
    return out


if __name__ == "__main__":
    main()
