"""Consumer-group sessions: every group member (RaaS nodes through librdkafka, stream apps through
aiokafka) gets `kafka.group_session_timeout_s` and a heartbeat of a third of it, at most 1 s, so a
killed member's partitions move within seconds instead of librdkafka's default 45 s."""

from __future__ import annotations

import pytest

from astraflow.config import KafkaSettings, load_config
from astraflow.kafka.clients import consumer_config, reader_config

pytestmark = pytest.mark.unit


def test_consumers_get_the_configured_session_and_a_heartbeat_within_a_third_of_it() -> None:
    conf = consumer_config(KafkaSettings(), "g", 1024)
    assert conf["session.timeout.ms"] == 6000 and conf["heartbeat.interval.ms"] == 1000
    short = consumer_config(KafkaSettings(group_session_timeout_s=2.4), "g", 1024)
    assert short["session.timeout.ms"] == 2400 and short["heartbeat.interval.ms"] == 800


def test_the_session_is_set_from_the_environment_and_bounded() -> None:
    cfg = load_config(env={"ASTRAFLOW__KAFKA__GROUP_SESSION_TIMEOUT_S": "10"})
    assert cfg.kafka.group_session_timeout_s == 10.0 and cfg.kafka.heartbeat_interval_s == 1.0
    with pytest.raises(ValueError):
        KafkaSettings(group_session_timeout_s=0.1)


def test_a_reader_never_commits_reads_committed_records_and_is_not_a_group_member_by_default() -> None:
    conf = reader_config(KafkaSettings(security_protocol="SSL"), "af-read-x", 1000, **{"enable.partition.eof": True})
    assert conf["group.id"] == "af-read-x" and conf["enable.auto.commit"] is False
    assert conf["isolation.level"] == "read_committed" and conf["enable.partition.eof"] is True
    assert conf["fetch.message.max.bytes"] == 1000 + 64 * 1024 and conf["security.protocol"] == "SSL"
    assert "session.timeout.ms" not in conf and "partition.assignment.strategy" not in conf  # no group settings
    assert "fetch.message.max.bytes" not in reader_config(KafkaSettings(), "g")  # librdkafka's default
