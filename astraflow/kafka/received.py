"""A record read from Kafka (`Received`), and the dead-letter queue of those that cannot be handled.

`Received` is what `astraflow.kafka.clients.RecordConsumer.poll_batch` returns and what the stream
engine hands a stream app (`stream_apps.handler`): the decoded record with its coordinates, its
original bytes and headers. `dead_letter_bytes` builds the DLQ entry of one (the stream engine
queues it in the record's transaction); `DeadLetterWriter` sends it with a `RecordProducer`.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Generic, TypeVar

from astraflow.config import TopicSettings
from astraflow.errors import RecordTooLargeError
from astraflow.kafka.offsets import TP
from astraflow.records import DeadLetter, Record
from astraflow.serde import AvroSerde

if TYPE_CHECKING:
    from confluent_kafka import Message

    from astraflow.kafka.clients import RecordProducer

R = TypeVar("R", bound=Record)


def decode_headers(raw: Iterable[tuple[str, Any]] | None) -> dict[str, str]:
    """A record's headers as text, decoded leniently (they are untrusted too)."""
    return {k: (v.decode(errors="replace") if isinstance(v, bytes) else str(v)) for k, v in (raw or [])}


@dataclass(slots=True, eq=False)
class Received(Generic[R]):
    """A record read from Kafka with where it came from: what `RecordConsumer.poll_batch` returns
    and what a stream app's handler is handed (`stream_apps.handler.AppHandler.handle`).

    `value` keeps the original bytes, so a record that cannot be handled is dead-lettered untouched.
    """

    record: R  # the typed record (astraflow.records); None until decoded (a stream app decodes it late)
    topic: str
    partition: int
    offset: int
    key: bytes | None
    timestamp_ms: int
    value: bytes | None  # the original bytes, kept for dead-lettering
    headers: dict[str, str]  # the record's headers, decoded leniently
    epoch: int = 0  # assignment epoch of its partition (OffsetTracker), where the reader keeps one

    @classmethod
    def of(cls, msg: Message, record: Any = None) -> Received[Any]:
        """The coordinates, bytes and headers of a confluent-kafka message (and its decoded record)."""
        return cls(record, msg.topic() or "", msg.partition() or 0, msg.offset() or 0, msg.key(),
                   msg.timestamp()[1], msg.value(), decode_headers(msg.headers()))

    @property
    def tp(self) -> TP:
        return (self.topic, self.partition)

    @property
    def key_str(self) -> str | None:
        return self.key.decode(errors="replace") if isinstance(self.key, bytes) else self.key


def dead_letter_bytes(serde: AvroSerde, received: Received[Any], error: BaseException | str, component: str,
                      strategy: str | None = None, detail: str | None = None) -> tuple[DeadLetter, bytes]:
    """The DLQ record for `received` (original bytes untouched) and its encoding; `detail` (a
    traceback) follows the reason in `error`, after a blank line.

    An original too large for the DLQ is left out; the entry keeps its coordinates and reason (the
    original stays in its topic).
    """
    dl = DeadLetter(
        original=received.value,
        original_key=received.key,
        topic=received.topic,
        partition=received.partition,
        offset=received.offset,
        error_class=type(error).__name__ if isinstance(error, BaseException) else "Error",
        error=str(error) + (f"\n\n{detail}" if detail else ""),
        component=component,
        strategy=strategy,
        headers=dict(received.headers),
    )
    try:
        return dl, serde.dumps(dl)
    except RecordTooLargeError:
        dl.original = None
        dl.error += f" [original of {len(received.value or b''):,} bytes too large for the DLQ; read it at its offset]"
        return dl, serde.dumps(dl)


# The DLQ topic is created with `topics.max_message_bytes` (astraflow.kafka.topics); its default here.
DLQ_MAX_BYTES = TopicSettings().max_message_bytes


class DeadLetterWriter:
    """Writes records a component could not handle to the DLQ, original bytes untouched."""

    def __init__(self, producer: RecordProducer, dlq_topic: str, component: str, dlq_max_bytes: int = DLQ_MAX_BYTES):
        self.producer = producer
        self.topic = dlq_topic
        self.component = component
        # No larger than the producer can send: an original over it is left out of its letter
        # (a 10 MB record must not make the dead-lettering itself fail).
        self._serde = AvroSerde(producer.serde.catalog, max_record_bytes=min(dlq_max_bytes, producer.serde.max_record_bytes))
        self.count = 0

    def send(self, received: Received[Any], error: BaseException | str, strategy: str | None = None) -> None:
        """Dead-letters `received` (a raw message: `Received.of(msg)`)."""
        _, data = dead_letter_bytes(self._serde, received, error, self.component, strategy)
        self.producer.send_raw(self.topic, data, key=received.key)
        self.count += 1
