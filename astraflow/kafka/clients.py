"""Producer and consumer helpers with AstraFlow's defaults and dead-lettering built in.

`RecordProducer`: idempotent, acks=all, zstd, small linger; `flush()` raises if any record was
rejected. `RecordConsumer`: offsets are committed only when the caller says a record
was processed (`commit`), partitions can be paused for backpressure while polling continues,
and every record that cannot be decoded goes to the DLQ with the reason, without stopping.

Outages. Every client here survives a cluster that is away for any length of time:

- librdkafka gives up on a queued record after `message.timeout.ms`, 300,000 ms by default (exactly
  five minutes), and the record is lost to the caller. `producer_config` sets it to 0, which
  librdkafka reads as "never": a record waits, retried with backoff, until the cluster is back.
  Idempotence keeps those retries free of duplicates and in order. A transactional producer
  cannot wait forever (its records must land before `transaction.timeout.ms`), so there the
  timeout follows the transaction's; its caller aborts and retries the transaction.
- `flush()` without a timeout waits for every acknowledgement, however long, and logs every 30 s
  how many records are still waiting; a given timeout still raises.
- Consumers reconnect by themselves; `commit` retries a commit that failed because the
  coordinator was unreachable (`commit_offsets`) instead of raising, and only raises errors a
  retry cannot fix (the partition was revoked: another member re-reads those records).
- Reconnect backoff is capped at 5 s (librdkafka's default is 10 s), so a role resumes within
  seconds of the cluster's return; TCP keepalive notices dead connections through NAT.
"""

from __future__ import annotations

import logging
import socket
import time
from collections.abc import Callable, Iterable, Iterator
from typing import Any, Generic, TypeVar

from confluent_kafka import Consumer, KafkaError, KafkaException, Message, Producer, TopicPartition

from astraflow.config import KafkaSettings
from astraflow.errors import KafkaLayerError, ProduceError, SerdeError
from astraflow.kafka.received import DeadLetterWriter, Received
from astraflow.kafka.signing import MetricSigner
from astraflow.records import Metric, Record
from astraflow.serde import AvroSerde

R = TypeVar("R", bound=Record)

log = logging.getLogger("astraflow.kafka")

# Room for Kafka's record overhead on top of the encoded value.
_OVERHEAD = 64 * 1024

# What every client needs to ride out an outage (see the module docstring).
OUTAGE_CONFIG: dict[str, Any] = {"reconnect.backoff.max.ms": 5000, "socket.keepalive.enable": True}
# librdkafka's default message.timeout.ms (5 minutes); 0 means "never give up".
LIBRDKAFKA_DEFAULT_MESSAGE_TIMEOUT_MS = 300_000
_TXN_TIMEOUT_MS = 60_000


def producer_config(kafka: KafkaSettings, max_record_bytes: int, **overrides: Any) -> dict[str, Any]:
    """librdkafka producer properties: idempotent, acks=all, zstd, and no delivery deadline."""
    conf: dict[str, Any] = {
        **kafka.client_config(),
        **OUTAGE_CONFIG,
        "enable.idempotence": True,
        "acks": "all",
        "compression.type": "zstd",
        "linger.ms": 5,
        "message.max.bytes": max_record_bytes + _OVERHEAD,
        "client.id": f"astraflow-{socket.gethostname()}",
        "message.timeout.ms": 0,
    }
    if "transactional.id" in overrides and "message.timeout.ms" not in overrides:
        conf["message.timeout.ms"] = overrides.get("transaction.timeout.ms", _TXN_TIMEOUT_MS)
    conf.update(overrides)
    return conf


def consumer_config(kafka: KafkaSettings, group_id: str, max_record_bytes: int, **overrides: Any) -> dict[str, Any]:
    """librdkafka consumer properties: manual commits, read_committed, cooperative rebalancing."""
    conf: dict[str, Any] = {
        **kafka.client_config(),
        **OUTAGE_CONFIG,
        "group.id": group_id,
        "enable.auto.commit": False,
        "auto.offset.reset": "earliest",
        "isolation.level": "read_committed",
        "partition.assignment.strategy": "cooperative-sticky",
        "fetch.message.max.bytes": max_record_bytes + _OVERHEAD,
        "max.poll.interval.ms": 300000,
        # A killed member's partitions move after the session, not librdkafka's default 45 s.
        "session.timeout.ms": round(kafka.group_session_timeout_s * 1000),
        "heartbeat.interval.ms": round(kafka.heartbeat_interval_s * 1000),
    }
    conf.update(overrides)
    return conf



def reader_config(kafka: KafkaSettings, group_id: str, max_record_bytes: int | None = None, **overrides: Any) -> dict[str, Any]:
    """librdkafka properties of a reader that never commits: assign()-only readers of a range, a
    compacted topic or watermarks (`group_id` names it to the broker; `committed()` reads that
    group's offsets) and watchers that subscribe without committing. read_committed, from the
    earliest offset where none is given, fetches as large as `max_record_bytes` (when given)."""
    conf: dict[str, Any] = {
        **kafka.client_config(),
        "group.id": group_id,
        "enable.auto.commit": False,
        "auto.offset.reset": "earliest",
        "isolation.level": "read_committed",
    }
    if max_record_bytes is not None:
        conf["fetch.message.max.bytes"] = max_record_bytes + _OVERHEAD
    conf.update(overrides)
    return conf


def reader(kafka: KafkaSettings, group_id: str, max_record_bytes: int | None = None, **overrides: Any) -> Consumer:
    """A librdkafka consumer that never commits (`reader_config`): the one way to make one."""
    return Consumer(reader_config(kafka, group_id, max_record_bytes, **overrides))


def group_member(kafka: KafkaSettings, group_id: str, max_record_bytes: int, **overrides: Any) -> Consumer:
    """A librdkafka member of a consumer group (`consumer_config`) for a caller that handles raw
    messages and its commits itself; `RecordConsumer` wraps one with decoding and dead letters."""
    return Consumer(consumer_config(kafka, group_id, max_record_bytes, **overrides))


def data_messages(msgs: Iterable[Message], where: str,
                  fatal: Callable[[str], Exception] = KafkaLayerError) -> Iterator[Message]:
    """The messages of a `consume()` that carry records. End-of-partition events are skipped;
    other errors are logged and skipped (librdkafka retries them by itself); a fatal one raises
    `fatal(message)` (KafkaLayerError by default), naming `where`."""
    for msg in msgs:
        err = msg.error()
        if err is None:
            yield msg
        elif err.fatal():
            raise fatal(f"fatal Kafka error on {where}: {err.str()}")
        elif err.code() != KafkaError._PARTITION_EOF:
            log.warning("Kafka error on %s: %s", where, err.str())

def consume_ready(consumer: Consumer, max_records: int, timeout_s: float) -> list[Message]:
    """Up to `max_records` messages, returned as soon as there is one: waits at most `timeout_s`
    for the first, then takes what the client already holds. `Consumer.consume(n, t)` itself
    returns only once it has n messages or t has passed, so a reader of small batches (a train
    batch, a weights version, a few tasks) would wait out t after every record."""
    msgs = consumer.consume(max_records, 0)
    if msgs or timeout_s <= 0:
        return msgs
    first = consumer.poll(timeout_s)
    if first is None:
        return []
    return [first, *consumer.consume(max_records - 1, 0)] if max_records > 1 else [first]


# Commit errors that mean "the coordinator is away or moving", not "you lost the partition".
_RETRIABLE_COMMIT = frozenset(
    {
        KafkaError._TRANSPORT,
        KafkaError._TIMED_OUT,
        KafkaError._WAIT_COORD,
        KafkaError._ALL_BROKERS_DOWN,
        KafkaError.COORDINATOR_NOT_AVAILABLE,
        KafkaError.NOT_COORDINATOR,
        KafkaError.COORDINATOR_LOAD_IN_PROGRESS,
        KafkaError.REQUEST_TIMED_OUT,
        KafkaError.NETWORK_EXCEPTION,
    }
)


def commit_offsets(consumer: Consumer, offsets: list[TopicPartition], backoff_max_s: float = 5.0) -> None:
    """Synchronous commit that waits out an unreachable coordinator (an outage of any length).

    Raises KafkaLayerError for errors a retry cannot fix, e.g. the partitions were revoked in a
    rebalance (their records will be delivered again to the new owner).
    """
    delay, waited, warned = 0.2, 0.0, 0.0
    while True:
        try:
            consumer.commit(offsets=offsets, asynchronous=False)
            return
        except KafkaException as exc:
            err = exc.args[0]
            if not isinstance(err, KafkaError) or not (err.retriable() or err.code() in _RETRIABLE_COMMIT):
                raise KafkaLayerError(f"commit failed: {exc}") from exc
            if waited - warned >= 30.0:
                log.warning("commit still waiting for the group coordinator after %.0f s: %s", waited, err.str())
                warned = waited
        time.sleep(delay)
        waited += delay
        delay = min(delay * 2, backoff_max_s)


_METRIC_SIGNER = MetricSigner()  # one per process: keys are read once per experiment and role


class RecordProducer:
    """Produces typed records (or raw bytes) and tracks their acknowledgements."""

    def __init__(self, kafka: KafkaSettings, serde: AvroSerde | None = None, **overrides: Any) -> None:
        self.serde = serde or AvroSerde.for_kafka(kafka)
        self._producer = Producer(producer_config(kafka, self.serde.max_record_bytes, **overrides))
        self._failures: list[str] = []
        self.delivered = 0

    def send(
        self,
        topic: str,
        record: Record,
        key: str | bytes | None = None,
        headers: dict[str, str] | None = None,
        on_delivery: Callable[[KafkaError | None, Message], None] | None = None,
        partition: int | None = None,
    ) -> None:
        """Encodes and queues one record (raises SerdeError before anything is sent); to
        `partition` when given, else where its key hashes. A `Metric` is signed with the key of
        its component's role where this host holds it (`astraflow.kafka.signing.MetricSigner`)."""
        value = self.serde.dumps(record)
        if isinstance(record, Metric) and headers is None:
            headers = _METRIC_SIGNER.headers(topic, key, value, record.component)
        self.send_raw(topic, value, key, headers, on_delivery, partition)

    def send_raw(
        self,
        topic: str,
        value: bytes | None,
        key: str | bytes | None = None,
        headers: dict[str, str] | None = None,
        on_delivery: Callable[[KafkaError | None, Message], None] | None = None,
        partition: int | None = None,
    ) -> None:
        where = {} if partition is None else {"partition": partition}

        def _cb(err: KafkaError | None, msg: Message) -> None:
            if err is not None:
                self._failures.append(f"{msg.topic()}: {err.str()}")
            else:
                self.delivered += 1
            if on_delivery is not None:
                on_delivery(err, msg)

        while True:
            try:
                self._producer.produce(topic, value=value, key=key, headers=headers, on_delivery=_cb, **where)
                break
            except BufferError:  # local queue full: serve delivery reports, then retry
                self._producer.poll(0.1)
        self._producer.poll(0)

    def poll(self, timeout_s: float = 0.0) -> int:
        return self._producer.poll(timeout_s)

    def flush(self, timeout_s: float | None = None) -> None:
        """Waits for every queued record's acknowledgement; raises ProduceError on any failure.

        Without a timeout it waits as long as the cluster is away (logging every 30 s); with one,
        records still unacknowledged then raise ProduceError (they stay queued).
        """
        if timeout_s is None:
            waited = 0.0
            while remaining := self._producer.flush(30.0):
                waited += 30.0
                log.warning("%d records still waiting for Kafka after %.0f s (is the cluster away?)", remaining, waited)
        elif remaining := self._producer.flush(timeout_s):
            raise ProduceError(f"{remaining} records not acknowledged within {timeout_s:.0f}s; is Kafka reachable?")
        if self._failures:
            failures, self._failures = self._failures, []
            raise ProduceError(f"{len(failures)} records were rejected by Kafka, first: {failures[0]}")

    @property
    def raw(self) -> Producer:
        """The underlying confluent-kafka producer (for transactions)."""
        return self._producer


class RecordConsumer(Generic[R]):
    """Consumes typed records; commit after processing; undecodable records go to the DLQ."""

    def __init__(
        self,
        kafka: KafkaSettings,
        group_id: str,
        topics: Iterable[str],
        *,
        component: str,
        dlq: DeadLetterWriter | None,
        expect: type[R] | None = None,
        serde: AvroSerde | None = None,
        on_assign: Callable[[Consumer, list[TopicPartition]], None] | None = None,
        on_revoke: Callable[[Consumer, list[TopicPartition]], None] | None = None,
        **overrides: Any,
    ) -> None:
        self.serde = serde or AvroSerde.for_kafka(kafka)
        self.expect = expect
        self.component = component
        self.dlq = dlq
        self._consumer = Consumer(consumer_config(kafka, group_id, self.serde.max_record_bytes, **overrides))
        kwargs = {k: v for k, v in (("on_assign", on_assign), ("on_revoke", on_revoke)) if v is not None}
        self.topics = list(topics)
        self._consumer.subscribe(self.topics, **kwargs)
        self.dead_lettered = 0
        self._last_seen: dict[tuple[str, int], int] = {}  # highest offset handed out or dead-lettered

    def poll_batch(self, max_records: int = 500, timeout_s: float = 1.0) -> list[Received[R]]:
        """Polls up to `max_records`; records that fail to decode are dead-lettered and skipped.

        A dead-lettered record counts as processed: its offset is committed with the next commit
        of its partition (the DLQ write is flushed before that commit).
        """
        msgs = consume_ready(self._consumer, max_records, timeout_s)
        out: list[Received[R]] = []
        for msg in data_messages(msgs, ", ".join(self.topics)):
            try:
                rec = self.serde.loads(msg.value(), self.expect)
            except SerdeError as exc:
                self._dead_letter(msg, exc)
                continue
            out.append(Received.of(msg, rec))
            self._last_seen[(msg.topic(), msg.partition())] = msg.offset()
        return out

    def _dead_letter(self, msg: Message, exc: BaseException) -> None:
        self.dead_letter(Received.of(msg), exc)

    def dead_letter(self, received: Received[Any], exc: BaseException, strategy: str | None = None) -> None:
        """Dead-letters a record whose processing failed (e.g. a strategy raised); it counts as processed."""
        if self.dlq is None:
            raise exc
        self.dlq.send(received, exc, strategy)
        self.dead_lettered += 1
        self._last_seen[received.tp] = received.offset

    def commit(self, processed: Iterable[Received[Any]] | None = None, asynchronous: bool = False) -> None:
        """Commits offsets through the given records (or everything polled so far), per partition.

        Flushes the DLQ producer first, so a dead-lettered record is durable before it is skipped.
        """
        if self.dlq is not None and self.dlq.count:
            self.dlq.producer.flush()
        if processed is None:
            high = dict(self._last_seen)
        else:
            high = {}
            for r in processed:
                k = (r.topic, r.partition)
                high[k] = max(high.get(k, -1), r.offset)
        if not high:
            return
        offsets = [TopicPartition(t, p, off + 1) for (t, p), off in high.items()]
        if asynchronous:
            self._consumer.commit(offsets=offsets, asynchronous=True)
        else:
            commit_offsets(self._consumer, offsets)

    def pause_all(self) -> None:
        """Stops fetching (backpressure) but keeps group membership: keep calling poll_batch."""
        self._consumer.pause(self._consumer.assignment())

    def resume_all(self) -> None:
        self._consumer.resume(self._consumer.assignment())

    def assignment(self) -> list[TopicPartition]:
        return self._consumer.assignment()

    def close(self) -> None:
        self._consumer.close()

    @property
    def raw(self) -> Consumer:
        return self._consumer


def offsets_at(consumer: Consumer, partitions: list[TopicPartition], timeout_s: float = 10.0) -> list[TopicPartition]:
    """`offsets_for_times` (each partition's offset holds a timestamp in ms), retrying while a new
    topic still elects its leaders."""
    deadline = time.monotonic() + timeout_s
    while True:
        try:
            return consumer.offsets_for_times(partitions, timeout=max(1.0, timeout_s / 4))
        except KafkaException as exc:
            if time.monotonic() >= deadline:
                raise KafkaLayerError(f"cannot look up offsets by time of {partitions[:1]}...: {exc}") from exc
            time.sleep(0.2)


def watermarks(consumer: Consumer, topic: str, partition: int = 0, timeout_s: float = 10.0) -> tuple[int, int]:
    """(low, high) offsets of a partition, retrying while a new topic still elects its leader."""
    deadline = time.monotonic() + timeout_s
    while True:
        try:
            return consumer.get_watermark_offsets(TopicPartition(topic, partition), timeout=max(1.0, timeout_s / 4))
        except KafkaException as exc:
            if time.monotonic() >= deadline:
                raise KafkaLayerError(f"cannot read the offsets of {topic}[{partition}] (does it exist?): {exc}") from exc
            time.sleep(0.2)


def admin(kafka: KafkaSettings) -> Any:
    """A librdkafka admin client (its own connections: see `stable_ends`)."""
    from confluent_kafka.admin import AdminClient

    return AdminClient({**kafka.client_config(), **OUTAGE_CONFIG})


def stable_ends(admin_client: Any, topic: str, partitions: list[int], timeout_s: float = 10.0) -> dict[int, tuple[int, int]]:
    """partition -> (first offset, last stable offset) of `topic`, in one request of each kind for
    all `partitions`, retrying while a new topic still elects its leaders. The last stable offset
    is where a read_committed reader ends (the high watermark where no transaction is open).

    Asked through an admin client, not a reader's consumer: a consumer's `get_watermark_offsets`
    goes over the connection its fetches use, the broker answers one request per connection at a
    time, and a fetch of a topic with nothing new is held `fetch.wait.max.ms` (librdkafka: 500 ms),
    so each partition's ends cost up to half a second (`bench/end_offsets.py`: 12 partitions of an
    idle reader, 4.5-6 s through its consumer; in one request through an admin client, 2-3 ms)."""
    from confluent_kafka import IsolationLevel
    from confluent_kafka.admin import OffsetSpec

    deadline = time.monotonic() + timeout_s
    while True:
        try:
            ends: dict[int, list[int]] = {p: [0, 0] for p in partitions}
            for i, spec in enumerate((OffsetSpec.earliest(), OffsetSpec.latest())):
                asked = admin_client.list_offsets({TopicPartition(topic, p): spec for p in partitions},
                                                  isolation_level=IsolationLevel.READ_COMMITTED,
                                                  request_timeout=max(1.0, timeout_s / 4))
                for tp, fut in asked.items():
                    ends[tp.partition][i] = fut.result().offset
            return {p: (low, high) for p, (low, high) in ends.items()}
        except KafkaException as exc:
            if time.monotonic() >= deadline:
                raise KafkaLayerError(f"cannot read the offsets of {topic} (does it exist?): {exc}") from exc
            time.sleep(0.2)
