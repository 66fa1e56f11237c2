"""Counts a person sees are records, not offsets: transaction markers and aborted records left out.

Every hop of the dataflow writes in Kafka transactions, and each commit spends one offset per
partition on a marker no consumer receives. Here a transactional topic gets 30 committed records
in 10 transactions and 2 aborted ones: its offsets span 43, a read_committed consumer reads 30,
and `astraflow status` (topics, lag, JSON), the record counter, the demo's lag and replay's
progress total must all say 30.
"""

from __future__ import annotations

import json
import uuid
from collections.abc import Callable

import pytest
from confluent_kafka import Consumer, Producer, TopicPartition
from typer.testing import CliRunner

from astraflow.config import KafkaSettings
from astraflow.kafka.clients import producer_config, reader_config
from astraflow.kafka.topics import Topics

pytestmark = pytest.mark.integration

COMMITTED, PER_TXN = 30, 3


def _write_transactions(kafka: KafkaSettings, topic: str) -> None:
    p = Producer(producer_config(kafka, 1 << 20, **{"transactional.id": f"counts-{uuid.uuid4().hex[:8]}"}))
    p.init_transactions(30)
    for i in range(COMMITTED // PER_TXN):
        p.begin_transaction()
        for j in range(PER_TXN):
            p.produce(topic, f"v{i}-{j}".encode(), key=b"k", partition=0)
        p.commit_transaction(30)
    p.begin_transaction()
    p.produce(topic, b"aborted-1", key=b"k", partition=0)
    p.produce(topic, b"aborted-2", key=b"k", partition=0)
    p.flush(30)
    p.abort_transaction(30)


def _read_committed(kafka: KafkaSettings, topic: str) -> int:
    c = Consumer(reader_config(kafka, f"af-status-test-{uuid.uuid4().hex[:6]}", **{"enable.partition.eof": True}))
    c.assign([TopicPartition(topic, 0, 0)])
    n = 0
    try:
        while True:
            msgs = c.consume(100, 5.0)
            if not msgs:
                raise AssertionError("no end of partition within 5 s")
            for m in msgs:
                if m.error() is None:
                    n += 1
                elif m.error().code() == m.error()._PARTITION_EOF:
                    return n
    finally:
        c.close()


def test_transactional_topic_counts_records_not_offsets(kafka: KafkaSettings, make_experiment: Callable[..., str]) -> None:
    from astraflow.archive.kafka_source import TopicSource
    from astraflow.demo.monitor import Monitor
    from astraflow.kafka.counts import count_records
    from astraflow.ops.cluster_offsets import OffsetReader
    from astraflow.ops.status import collect_status
    from astraflow_cli.main import app

    exp = make_experiment("counts")
    scored = Topics(exp).scored
    _write_transactions(kafka, scored)
    reader = OffsetReader(kafka)
    try:
        offsets = reader.partition_offsets({scored: 2}, 60.0)
        spanned = offsets[(scored, 0)].high - offsets[(scored, 0)].low
        assert spanned == COMMITTED + 2 + COMMITTED // PER_TXN + 1  # records + aborted + one marker per transaction
        assert _read_committed(kafka, scored) == COMMITTED  # what a consumer reads

        assert count_records(kafka, {(scored, 0): (offsets[(scored, 0)].low, offsets[(scored, 0)].high)}) == {
            (scored, 0): COMMITTED}

        # A group that committed nothing on `scored` yet, but is there: its lag is the whole topic, in records.
        group = f"af.{exp}.curate"
        c = Consumer(reader_config(kafka, group))
        c.commit(offsets=[TopicPartition(scored, 0, 0)], asynchronous=False)
        c.close()

        r = collect_status(kafka, exp, reader=reader)
        topics = {t.stream: t for t in r.topics}
        assert topics["scored"].records == COMMITTED and topics["scored"].exact
        assert topics["scored"].offsets == spanned
        assert topics["scored"].rate_per_s == pytest.approx(COMMITTED / 60.0)
        lag = {(g.group, g.topic): g.lag for g in r.lags}
        assert lag[(group, scored)] == COMMITTED

        again = collect_status(kafka, exp, reader=reader)  # the reader counts incrementally: same answer
        assert {t.stream: t.records for t in again.topics}["scored"] == COMMITTED

        monitor = Monitor(kafka, exp, "policy", groups={scored: group})  # the demo's live view and summary
        try:
            assert monitor._lags() == {"scored": COMMITTED}
        finally:
            monitor._counter.close()
            if monitor._probe is not None:
                monitor._probe.close()
    finally:
        reader.close()

    res = CliRunner().invoke(app, ["--set", f"kafka.bootstrap_servers={kafka.bootstrap_servers}", "status", "-e", exp,
                                   "--json"])
    assert res.exit_code == 0, res.output
    data = json.loads(res.output)
    assert {t["stream"]: t["records"] for t in data["topics"]}["scored"] == COMMITTED

    src = TopicSource(kafka, scored)  # replay's progress bar ends at its total
    try:
        assert src.total == COMMITTED
        assert sum(1 for _ in src) == COMMITTED
    finally:
        src.close()
