"""Turns a known, harmless aiokafka warning into one line that says what it is.

`Got error produce response on topic-partition ..., retrying. Error: NotEnoughReplicasError`,
logged by aiokafka (the Kafka client of the Faust apps) again and again on any cluster, the
single local broker included, is not about replicas. Since Kafka 3.6 a broker verifies with the
transaction coordinator that a transactional write belongs to a partition already added to an
ongoing transaction before it appends it (`transaction.partition.verification.enable`, KIP-890),
which keeps a late retry from opening a transaction that never ends. While that check cannot
conclude yet (the coordinator is still completing the previous transaction of the same producer,
or loading), the broker answers clients that predate KIP-890's client side, as aiokafka does, with
NOT_ENOUGH_REPLICAS: the one retriable error they know. aiokafka retries the write, in the same
transaction; nothing is lost or written twice (measured: 3,000 records in, 3,000 out, with 4 to 7
such warnings per minute on the local broker; none with the verification switched off, which we
keep on for the protection it gives).

`RetriedWriteNote` replaces the first of these warnings with that explanation (INFO) and then
logs one line per `every` of them, with the count, instead of one warning each.
"""

from __future__ import annotations

import logging

SENDER = "aiokafka.producer.sender"
EXPLANATION = (
    "the broker asked to retry a transactional write (NotEnoughReplicasError): Kafka verifies each "
    "transaction's first write to a partition with its transaction coordinator and answers clients "
    "like aiokafka with this retriable error until it can; the write is retried in the same "
    "transaction and nothing is lost. Not a replica problem (docs/processors.md, 'Guarantees and limits')"
)


class RetriedWriteNote(logging.Filter):
    """A filter for the `aiokafka.producer.sender` logger (see the module doc)."""

    def __init__(self, every: int = 100) -> None:
        super().__init__()
        self.every = every
        self.count = 0  # NotEnoughReplicas retries seen

    def filter(self, record: logging.LogRecord) -> bool:
        if record.levelno != logging.WARNING or "NotEnoughReplicas" not in record.getMessage():
            return True
        self.count += 1
        if self.count != 1 and self.count % self.every:
            return False
        record.levelno, record.levelname = logging.INFO, "INFO"
        record.msg, record.args = (EXPLANATION if self.count == 1 else
                                   f"{self.count} transactional writes retried so far (NotEnoughReplicasError, "
                                   "harmless: see the first such line)"), ()
        return True


def install() -> RetriedWriteNote:
    """Attaches one `RetriedWriteNote` to aiokafka's sender logger (idempotent); returns it."""
    logger = logging.getLogger(SENDER)
    for f in logger.filters:
        if isinstance(f, RetriedWriteNote):
            return f
    note = RetriedWriteNote()
    logger.addFilter(note)
    return note
