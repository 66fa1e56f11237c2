"""The pieces of a local KRaft node: where its files live, its server.properties, its process.

`astraflow.kafka.local.LocalKafka` runs one or several of these nodes; this module holds what
does not depend on how many (paths, configuration, status records, process checks).
"""

from __future__ import annotations

import contextlib
import os
import shutil
import signal
import sys
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from astraflow.errors import ToolMissingError

LOG4J2 = """\
status = warn
appender.file.type = File
appender.file.name = FILE
appender.file.fileName = {log}
appender.file.layout.type = PatternLayout
appender.file.layout.pattern = [%d] %p %m (%c)%n
rootLogger.level = INFO
rootLogger.appenderRef.file.ref = FILE
logger.kafka.name = kafka
logger.kafka.level = WARN
logger.apache.name = org.apache.kafka
logger.apache.level = WARN
logger.started.name = kafka.server.KafkaRaftServer
logger.started.level = INFO
"""


@dataclass(frozen=True)
class Node:
    """One KRaft node (broker and controller in one JVM) and where its files live."""

    node_id: int
    port: int  # client (and inter-broker) listener
    controller_port: int
    root: Path
    wan_port: int | None = None  # second client listener, advertised through a WAN proxy (region B)
    wan_proxy_port: int | None = None  # where that proxy listens: what the WAN listener advertises

    @property
    def bootstrap(self) -> str:
        return f"127.0.0.1:{self.port}"

    @property
    def storage(self) -> Path:
        return self.root / "data"

    @property
    def logs(self) -> Path:
        return self.root / "logs"

    @property
    def pid_file(self) -> Path:
        return self.root / "kafka.pid"

    @property
    def properties(self) -> Path:
        return self.root / "server.properties"

    @property
    def log4j(self) -> Path:
        return self.root / "log4j2.properties"


@dataclass(frozen=True)
class NodeStatus:
    """One node as `status` sees it."""

    node_id: int
    running: bool  # our process for this node is alive
    answering: bool  # registered and unfenced in the cluster's metadata
    pid: int | None
    bootstrap: str


@dataclass(frozen=True)
class KafkaStatus:
    """What `status` reports: the cluster as a whole, then each node."""

    running: bool  # every node's process is alive
    answering: bool  # every node is registered in the cluster's metadata
    pid: int | None  # node 1's process
    bootstrap: str  # comma-separated, every node
    data_dir: Path
    nodes: tuple[NodeStatus, ...] = ()

    def to_json(self) -> dict[str, Any]:
        return {**asdict(self), "data_dir": str(self.data_dir)}


def server_properties(nodes: list[Node], node: Node) -> dict[str, str]:
    """server.properties of `node` in a cluster of `nodes` (plaintext; secure mode adds its own)."""
    n = len(nodes)
    rf, isr = str(min(3, n)), str(2 if n >= 3 else 1)
    props = {
        "process.roles": "broker,controller",
        "node.id": str(node.node_id),
        "listeners": f"PLAINTEXT://{node.bootstrap},CONTROLLER://127.0.0.1:{node.controller_port}",
        "advertised.listeners": f"PLAINTEXT://{node.bootstrap}",
        "controller.listener.names": "CONTROLLER",
        "inter.broker.listener.name": "PLAINTEXT",
        "listener.security.protocol.map": "PLAINTEXT:PLAINTEXT,CONTROLLER:PLAINTEXT",
        "log.dirs": str(node.storage),
        "num.network.threads": "2",
        "num.io.threads": "2",
        "num.partitions": "4",
        "default.replication.factor": rf,
        "min.insync.replicas": isr,
        "offsets.topic.num.partitions": "8",
        "offsets.topic.replication.factor": rf,
        "transaction.state.log.num.partitions": "4",
        "transaction.state.log.replication.factor": rf,
        "transaction.state.log.min.isr": isr,
        "share.coordinator.state.topic.replication.factor": rf,
        "share.coordinator.state.topic.min.isr": isr,
        "unclean.leader.election.enable": "false",
        "group.initial.rebalance.delay.ms": "0",
        # RaaS nodes may ask for a short session (raas.group_session_timeout_s): a killed node's
        # tasks move after it; the broker's default floor is 6 s.
        "group.min.session.timeout.ms": "1000",
        "auto.create.topics.enable": "false",
        "log.cleaner.dedupe.buffer.size": str(16 * 1024 * 1024),
        "message.max.bytes": str(64 * 1024 * 1024),
        "replica.fetch.max.bytes": str(64 * 1024 * 1024),
        "log.retention.check.interval.ms": "60000",
    }
    if node.wan_port is not None and node.wan_proxy_port is not None:
        # Region-B clients bootstrap through the proxy and reach the WAN listener; the broker then
        # advertises the proxy's address for that listener, so they never connect around it.
        props["listeners"] += f",WAN://127.0.0.1:{node.wan_port}"
        props["advertised.listeners"] += f",WAN://127.0.0.1:{node.wan_proxy_port}"
        props["listener.security.protocol.map"] += ",WAN:PLAINTEXT"
    if n == 1:
        props["controller.quorum.bootstrap.servers"] = f"127.0.0.1:{node.controller_port}"
    else:
        props["controller.quorum.voters"] = ",".join(f"{m.node_id}@127.0.0.1:{m.controller_port}" for m in nodes)
    return props


def pid_of(node: Node) -> int | None:
    """The pid in the node's pid file, if that process is alive and is our broker."""
    try:
        pid = int(node.pid_file.read_text().strip())
    except (FileNotFoundError, ValueError):
        return None
    for _ in range(20):
        if not alive(pid):
            return None
        try:
            raw = Path(f"/proc/{pid}/cmdline").read_bytes()
        except OSError:
            return pid if sys.platform != "linux" else None
        if raw:  # empty while the process is being exec'ed or reaped: look again
            cmdline = raw.split(b"\0")
            return pid if b"kafka.Kafka" in cmdline and str(node.properties).encode() in cmdline else None
        time.sleep(0.05)
    return None


def require(tool: str, hint: str) -> str:
    path = shutil.which(tool)
    if path is None:
        raise ToolMissingError(f"`{tool}` is not on PATH; the local Kafka needs it: {hint}")
    return path


def alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    with contextlib.suppress(OSError):  # a zombie child counts as gone
        if Path(f"/proc/{pid}/stat").read_text().split(") ", 1)[1].startswith("Z"):
            with contextlib.suppress(ChildProcessError):
                os.waitpid(pid, os.WNOHANG)
            return False
    return True


def stop_pid(pid: int, timeout_s: float) -> None:
    """SIGTERM to `pid`, up to `timeout_s` for it to exit, then SIGKILL; returns once it is gone."""
    os.kill(pid, signal.SIGTERM)
    deadline = time.monotonic() + timeout_s
    while alive(pid) and time.monotonic() < deadline:
        time.sleep(0.1)
    if alive(pid):
        os.kill(pid, signal.SIGKILL)
        while alive(pid):
            time.sleep(0.1)


def read_props(path: Path) -> dict[str, str]:
    out = {}
    for line in path.read_text().splitlines():
        if "=" in line and not line.lstrip().startswith("#"):
            k, v = line.split("=", 1)
            out[k.strip()] = v.strip()
    return out
