"""Local Kafka manager errors that need no broker: missing tools, taken ports, foreign data dirs."""

from __future__ import annotations

import socket
from pathlib import Path

import pytest

from astraflow.config import LocalKafkaSettings
from astraflow.errors import ClusterIdMismatchError, PortInUseError, ToolMissingError
from astraflow.kafka.local import LocalKafka


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_missing_java_is_explained(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("PATH", str(tmp_path))
    with pytest.raises(ToolMissingError, match="`java` is not on PATH"):
        LocalKafka(LocalKafkaSettings(data_dir=tmp_path, port=_free_port(), controller_port=_free_port())).up(echo=lambda *_: None)


def test_taken_port_is_explained(tmp_path: Path) -> None:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        s.listen()
        port = s.getsockname()[1]
        k = LocalKafka(LocalKafkaSettings(data_dir=tmp_path, port=port, controller_port=_free_port()))
        with pytest.raises(PortInUseError, match=f"port {port} \\(broker\\).*local_kafka.port"):
            k.up(echo=lambda *_: None)


def test_foreign_cluster_id_is_explained(tmp_path: Path) -> None:
    k = LocalKafka(LocalKafkaSettings(data_dir=tmp_path))
    (tmp_path / "data").mkdir(parents=True)
    (tmp_path / "data" / "meta.properties").write_text("cluster.id=someone-else\nnode.id=1\n")
    (tmp_path / "cluster.id").write_text("ours\n")
    with pytest.raises(ClusterIdMismatchError, match="someone-else.*delete"):
        k._format("java", echo=lambda *_: None)


def test_down_without_broker_touches_nothing(tmp_path: Path) -> None:
    k = LocalKafka(LocalKafkaSettings(data_dir=tmp_path))
    (tmp_path / "kafka.pid").write_text("1\n")  # pid 1 is not our broker: must not be signalled
    assert k.down(echo=lambda *_: None) is False
    assert not (tmp_path / "kafka.pid").exists()
