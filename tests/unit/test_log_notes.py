"""aiokafka's NotEnoughReplicas retry warnings become one explained line and a periodic count."""

from __future__ import annotations

import logging

import pytest

from stream_apps.log_notes import EXPLANATION, SENDER, RetriedWriteNote, install

pytestmark = pytest.mark.unit

WARNING = ("Got error produce response on topic-partition %s, retrying. Error: %s",
           ("TopicPartition(topic='af.e.scored', partition=3)", "<class 'aiokafka.errors.NotEnoughReplicasError'>"))


def _record(msg: str, args: tuple, level: int = logging.WARNING) -> logging.LogRecord:
    return logging.LogRecord(SENDER, level, __file__, 1, msg, args, None)


def test_the_first_is_explained_then_one_line_per_hundred() -> None:
    note = RetriedWriteNote(every=100)
    shown = []
    for _ in range(250):
        rec = _record(*WARNING)
        if note.filter(rec):
            shown.append(rec)
    assert len(shown) == 3 and note.count == 250
    assert shown[0].getMessage() == EXPLANATION and shown[0].levelname == "INFO"
    assert shown[1].getMessage().startswith("100 transactional writes retried") and shown[2].getMessage().startswith("200 ")


def test_other_warnings_pass_untouched() -> None:
    note = RetriedWriteNote()
    rec = _record("Got error produce response on %s, retrying. Error: %s", ("tp", "NotLeaderForPartitionError"))
    assert note.filter(rec) and rec.levelname == "WARNING" and note.count == 0


def test_install_is_idempotent() -> None:
    logger = logging.getLogger(SENDER)
    before = list(logger.filters)
    try:
        assert install() is install()
        assert sum(isinstance(f, RetriedWriteNote) for f in logger.filters) == 1
    finally:
        logger.filters = before
