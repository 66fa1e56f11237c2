"""A data dir whose cluster id starts with "-" (1 in 64 of the ids made before the fix) formats and starts."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from astraflow.config import LocalKafkaSettings
from astraflow.kafka.local import LocalKafka

pytestmark = pytest.mark.slow

BASE = int(os.environ.get("ASTRAFLOW_TEST_PORT_BASE", "29100")) + 30


def test_a_cluster_id_starting_with_a_dash_formats_and_starts(tmp_path: Path) -> None:
    (tmp_path / "cluster.id").write_text("-5smaXaeQNKseIuhjQQX6g\n")  # made by an older version: kept as it is
    local = LocalKafka(LocalKafkaSettings(data_dir=tmp_path, port=BASE, controller_port=BASE + 1, heap_mb=256))
    try:
        assert local.up(echo=lambda *_: None).answering
        meta = next(tmp_path.rglob("meta.properties")).read_text()
        assert "cluster.id=-5smaXaeQNKseIuhjQQX6g" in meta
    finally:
        local.down(echo=lambda *_: None)
