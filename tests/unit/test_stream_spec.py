"""Specs of single streams (`astraflow topics create --stream`, `replay --create-target`) and the
experiment a topic name belongs to (`astraflow experiments list`)."""

from __future__ import annotations

import pytest

from astraflow.config import TopicSettings
from astraflow.errors import ConfigError
from astraflow.kafka.topics import experiment_of, stream_spec, topic_specs

pytestmark = pytest.mark.unit


def test_a_builtin_stream_is_made_as_topics_create_makes_it() -> None:
    settings = TopicSettings(partitions=3)
    every = {s.name: s for s in topic_specs("e1", ["solver"], settings)}
    for stream in ("rollouts", "dlq", "policies", "solver.train", "solver.weights"):
        spec = stream_spec("e1", stream, settings)
        assert spec == every[f"af.e1.{stream}"], stream
    assert stream_spec("e1", "rollouts", settings, partitions=7).partitions == 7


def test_a_custom_stream_is_a_work_topic_with_the_experiments_partitions() -> None:
    settings = TopicSettings(partitions=3, min_insync_replicas=1)
    spec = stream_spec("e1", "tool-errors", settings)
    assert spec.name == "af.e1.tool-errors" and spec.partitions == 3
    assert spec.config == {"cleanup.policy": "delete", "retention.ms": str(settings.work_retention_ms),
                           "min.insync.replicas": "1"}
    for bad in ("a/b", "", "x" * 101, "a..b"):
        with pytest.raises(ConfigError, match="stream name"):
            stream_spec("e1", bad, settings)


def test_experiment_of_a_topic_name() -> None:
    assert experiment_of("af.demo-1.rollouts") == "demo-1"
    assert experiment_of("af.demo-1.solver.train") == "demo-1"
    assert experiment_of("af.demo-1.curate-groups-changelog") == "demo-1"
    assert experiment_of("__consumer_offsets") is None and experiment_of("af.x") is None
    assert experiment_of("other.demo.rollouts") is None
