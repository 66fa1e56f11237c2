"""`CompactedReader.catch_up` reads to the ends a read_committed reader can reach, asked in one
request for every partition, not over the reader's own connection partition by partition.

Curate's `TaskBook` catches up on the tasks topics (12 partitions each) whenever a trajectory's
task is not known yet, inside curate's event loop: through the reader's consumer each
partition's ends waited out the fetch the broker held for it (about 0.45 s), 11 s for `tasks`
and `tasks.b`, during which curate emitted nothing (`docs/deploy-regions.md`, *Region B dark*).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from confluent_kafka import Producer

from astraflow.config import KafkaSettings
from astraflow.control import CompactedReader
from astraflow.records import PromptStats
from astraflow.serde import AvroSerde


class CountingConsumer:
    """The reader's consumer, counting the end-offset requests made over its connection."""

    def __init__(self, consumer: Any) -> None:
        self.consumer = consumer
        self.watermark_calls = 0

    def get_watermark_offsets(self, *args: Any, **kwargs: Any) -> Any:
        self.watermark_calls += 1
        return self.consumer.get_watermark_offsets(*args, **kwargs)

    def __getattr__(self, name: str) -> Any:
        return getattr(self.consumer, name)


def _stats(prompt_id: str, groups: int) -> PromptStats:
    return PromptStats(prompt_id, "arith", "policy", groups, 2 * groups, 0.5, 0.5, 0.5, 0.5, 10.0, 0, 0)


def test_catch_up_reads_every_partition_to_its_stable_end_past_an_open_transaction(
        kafka: KafkaSettings, topic_factory: Callable[..., str]) -> None:
    topic = topic_factory("compacted-ends", partitions=12)
    serde = AvroSerde.for_kafka(kafka)
    plain = Producer(kafka.client_config())
    for p in range(12):
        for i in range(3):
            plain.produce(topic, serde.dumps(_stats(f"p{p}-{i}", 1)), f"p{p}-{i}".encode(), partition=p)
    plain.flush(30)
    # A transaction left open at the end of partition 5: a read_committed reader cannot pass its
    # first record, so the end to catch up to is the last stable offset, not the high watermark.
    txn = Producer({**kafka.client_config(), "transactional.id": topic_factory("tx")})
    txn.init_transactions(30)
    txn.begin_transaction()
    txn.produce(topic, serde.dumps(_stats("open", 9)), b"open", partition=5)
    txn.flush(30)
    seen: dict[str, Any] = {}
    reader = CompactedReader(kafka, topic, serde=serde, expect=PromptStats, on_record=lambda k, r: seen.__setitem__(k, r))
    counting = CountingConsumer(reader._consumer)
    reader._consumer = counting
    try:
        reader.catch_up(timeout_s=20.0)  # ends before the open transaction: nothing waits for it
        assert set(seen) == {f"p{p}-{i}" for p in range(12) for i in range(3)}
        assert counting.watermark_calls == 0  # the ends came in one request, not over the reader's connection
        txn.commit_transaction(30)
        reader.catch_up(timeout_s=20.0)
        assert seen["open"].groups == 9
    finally:
        reader.close()
        plain.flush(10)
