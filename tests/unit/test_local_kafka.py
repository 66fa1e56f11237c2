"""Local Kafka manager errors that need no broker: missing tools, taken ports, foreign data dirs."""

from __future__ import annotations

import base64
import socket
from pathlib import Path

import pytest

from astraflow.config import LocalKafkaSettings
from astraflow.errors import ClusterIdMismatchError, LocalKafkaError, PortInUseError, ToolMissingError
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
        with pytest.raises(PortInUseError, match=f"port {port} \\(broker of node 1\\).*local_kafka.port"):
            k.up(echo=lambda *_: None)


def test_foreign_cluster_id_is_explained(tmp_path: Path) -> None:
    k = LocalKafka(LocalKafkaSettings(data_dir=tmp_path))
    (tmp_path / "data").mkdir(parents=True)
    (tmp_path / "data" / "meta.properties").write_text("cluster.id=someone-else\nnode.id=1\n")
    (tmp_path / "cluster.id").write_text("ours\n")
    with pytest.raises(ClusterIdMismatchError, match="someone-else.*delete"):
        k._format("java", k.nodes[0], "ours", echo=lambda *_: None)


def test_down_without_broker_touches_nothing(tmp_path: Path) -> None:
    k = LocalKafka(LocalKafkaSettings(data_dir=tmp_path))
    (tmp_path / "kafka.pid").write_text("1\n")  # pid 1 is not our broker: must not be signalled
    assert k.down(echo=lambda *_: None) is False
    assert not (tmp_path / "kafka.pid").exists()


def test_three_nodes_get_their_own_ports_dirs_and_a_static_quorum(tmp_path: Path) -> None:
    k = LocalKafka(LocalKafkaSettings(data_dir=tmp_path, port=29000, controller_port=29001, brokers=3))
    assert k.bootstrap == "127.0.0.1:29000,127.0.0.1:29002,127.0.0.1:29004"
    assert [(n.port, n.controller_port) for n in k.nodes] == [(29000, 29001), (29002, 29003), (29004, 29005)]
    assert len({n.root for n in k.nodes}) == 3
    k._write_configs(k.nodes[1])
    props = dict(line.split("=", 1) for line in k.nodes[1].properties.read_text().splitlines())
    assert props["node.id"] == "2"
    assert props["controller.quorum.voters"] == "1@127.0.0.1:29001,2@127.0.0.1:29003,3@127.0.0.1:29005"
    assert props["offsets.topic.replication.factor"] == props["transaction.state.log.replication.factor"] == "3"
    assert props["min.insync.replicas"] == props["transaction.state.log.min.isr"] == "2"


def test_a_data_dir_keeps_its_kind_of_cluster(tmp_path: Path) -> None:
    LocalKafka(LocalKafkaSettings(data_dir=tmp_path, brokers=3))._check_layout()
    with pytest.raises(LocalKafkaError, match="3 node.*not 1.*another --data-dir"):
        LocalKafka(LocalKafkaSettings(data_dir=tmp_path))._check_layout()
    with pytest.raises(LocalKafkaError, match="no node 4"):
        LocalKafka(LocalKafkaSettings(data_dir=tmp_path, brokers=3)).kill(4)


def test_secure_nodes_require_sasl_and_acls(tmp_path: Path) -> None:
    k = LocalKafka(LocalKafkaSettings(data_dir=tmp_path, port=29000, controller_port=29001, secure=True))
    k._write_configs(k.nodes[0])
    text = k.nodes[0].properties.read_text()
    props = dict(line.split("=", 1) for line in text.splitlines())
    assert props["listeners"].startswith("SASL_PLAINTEXT://127.0.0.1:29000")
    assert "PLAINTEXT://" not in props["listeners"].replace("SASL_PLAINTEXT://", "")
    assert props["authorizer.class.name"].endswith("StandardAuthorizer")
    assert props["allow.everyone.if.no.acl.found"] == "false"
    assert oct(k.nodes[0].properties.stat().st_mode & 0o777) == "0o600"
    assert oct((tmp_path / "credentials.json").stat().st_mode & 0o777) == "0o600"


def test_topic_durability_settings_are_checked_and_reach_every_topic() -> None:
    from pydantic import ValidationError

    from astraflow.config import TopicSettings
    from astraflow.kafka.topics import topic_specs

    with pytest.raises(ValidationError, match="min_insync_replicas=4 must be between 1 and topics.replication_factor=3"):
        TopicSettings(replication_factor=3, min_insync_replicas=4)
    specs = topic_specs("e", ["p"], TopicSettings(replication_factor=3, min_insync_replicas=2))
    assert {s.config["min.insync.replicas"] for s in specs} == {"2"} and len(specs) == 12
    assert all("min.insync.replicas" not in s.config for s in topic_specs("e", ["p"], TopicSettings()))
    assert TopicSettings().replication_factor is None  # the cluster's default.replication.factor


def test_a_new_cluster_id_never_starts_with_a_dash(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    import uuid

    # The first uuid encodes to "-5smaXaeQNKseIuhjQQX6g" (a CI run's id: the storage tool read it as an option).
    ids = iter([uuid.UUID(bytes=base64.urlsafe_b64decode("-5smaXaeQNKseIuhjQQX6g==")), uuid.UUID(int=7)])
    monkeypatch.setattr(uuid, "uuid4", lambda: next(ids))
    cid = LocalKafka(LocalKafkaSettings(data_dir=tmp_path))._cluster_id()
    assert not cid.startswith("-") and cid == base64.urlsafe_b64encode(uuid.UUID(int=7).bytes).decode().rstrip("=")
    assert (tmp_path / "cluster.id").read_text().strip() == cid
