"""A real Apache Kafka (KRaft) on this machine, without Docker: one node, or a cluster of several.

`LocalKafka.up()` resolves the broker's jars from Maven Central with `docker/kafka/pom.xml`
(Maven caches them in ~/.m2; the classpath folder is shared by every data directory), formats
KRaft storage once, starts `kafka.Kafka` per node on 127.0.0.1 with a small heap, waits until
every node is registered in the cluster's metadata and writes a pid file per node. `down()` stops
only the processes those pid files name, after checking each is our broker.

With `brokers=3` every node is broker and controller at once (a static three-voter quorum): three
JVMs are the fewest that survive the loss of any one node, for data (replication factor 3,
min.insync.replicas 2) and for metadata (a quorum of 2 of 3). Node i listens on
`port + 2*(i-1)` and `controller_port + 2*(i-1)`. `kill(i)` / `start(i)` serve fault tests.

With `secure=True` clients must authenticate with SASL/SCRAM-SHA-512 and every request is
checked against ACLs (`astraflow.kafka.secure`, `astraflow.kafka.acl`).
"""

from __future__ import annotations

import base64
import hashlib
import json
import os
import shutil
import signal
import socket
import subprocess
import time
import uuid
from collections.abc import Callable
from pathlib import Path
from typing import Any

from astraflow.config import KafkaSettings, LocalKafkaSettings
from astraflow.errors import ClusterIdMismatchError, LocalKafkaError, PortInUseError
from astraflow.kafka.nodes import (
    LOG4J2,
    KafkaStatus,
    Node,
    NodeStatus,
    alive,
    pid_of,
    read_props,
    require,
    server_properties,
)

__all__ = ["KafkaStatus", "LocalKafka", "Node", "NodeStatus"]

POM = Path(__file__).resolve().parents[2] / "docker" / "kafka" / "pom.xml"
Echo = Callable[..., Any]
_SETTING = {"broker": "port", "controller": "controller_port", "WAN listener": "wan_port"}

class LocalKafka:
    """Manages the local node(s) rooted at `settings.data_dir`."""

    def __init__(self, settings: LocalKafkaSettings | None = None) -> None:
        self.settings = s = settings or LocalKafkaSettings()
        self.root = s.data_dir.expanduser().resolve()
        self.cluster_file = self.root / "cluster.id"
        self.layout_file = self.root / "layout.json"
        if s.wan_proxy_port is not None and s.secure:
            raise LocalKafkaError("local_kafka.wan_proxy_port works with a plaintext cluster only; drop --secure or the WAN")
        wan = (s.wan_port or s.wan_proxy_port + 1) if s.wan_proxy_port is not None else None
        self.nodes = [
            Node(i, s.port + 2 * (i - 1), s.controller_port + 2 * (i - 1), self.root if s.brokers == 1 else self.root / f"node-{i}",
                 None if wan is None else wan + 2 * (i - 1),
                 None if s.wan_proxy_port is None else s.wan_proxy_port + 2 * (i - 1))
            for i in range(1, s.brokers + 1)
        ]
        digest = hashlib.sha256(POM.read_bytes()).hexdigest()[:16] if POM.exists() else "missing"
        self.libs = s.jars_dir.expanduser().resolve() / digest

    @property
    def bootstrap(self) -> str:
        return ",".join(n.bootstrap for n in self.nodes)

    @property
    def wan_bootstrap(self) -> str | None:
        """Region B's bootstrap servers (the WAN proxy's ports), or None without a WAN listener."""
        if self.settings.wan_proxy_port is None:
            return None
        return ",".join(f"127.0.0.1:{n.wan_proxy_port}" for n in self.nodes)

    def node(self, node_id: int) -> Node:
        if not 1 <= node_id <= len(self.nodes):
            raise LocalKafkaError(f"no node {node_id}: this cluster has nodes 1..{len(self.nodes)}")
        return self.nodes[node_id - 1]

    def admin_settings(self) -> KafkaSettings:
        """Client settings with full rights on this cluster (the SCRAM admin when secure)."""
        if not self.settings.secure:
            return KafkaSettings(bootstrap_servers=self.bootstrap)
        from astraflow.kafka.secure import ADMIN, CredentialStore

        return CredentialStore(self.root).settings(self.bootstrap, ADMIN)

    # ---- lifecycle -----------------------------------------------------------------------------

    def up(self, echo: Echo = print) -> KafkaStatus:
        """Starts every node that is not running; returns once all of them are registered."""
        st = self.status()
        if st.running and st.answering:
            echo(f"Kafka already running at {self.bootstrap} (pids {[n.pid for n in st.nodes]}); nothing to do")
            return st
        java = require("java", "install a Java 17+ runtime, e.g. `apt-get install openjdk-17-jre-headless`")
        todo = [self.node(n.node_id) for n in st.nodes if not n.running]
        for node in todo:
            self._check_ports(node)
        self.root.mkdir(parents=True, exist_ok=True)
        self._check_layout()
        self.resolve_jars(echo)
        cluster_id = self._cluster_id()
        for node in todo:
            node.logs.mkdir(parents=True, exist_ok=True)
            self._write_configs(node)
            self._format(java, node, cluster_id, echo)
        for node in todo:
            self._spawn(java, node)
            echo(f"Starting Apache Kafka node {node.node_id} at {node.bootstrap}, data in {node.root}")
        try:
            self._wait_ready()
        except LocalKafkaError:
            for node in todo:  # leave nothing half-started behind
                self.kill(node.node_id)
            raise
        echo(f"Kafka is up: bootstrap servers {self.bootstrap}")
        return self.status()

    def start(self, node_id: int, echo: Echo = print) -> NodeStatus:
        """(Re)starts one node of an already formatted cluster and waits until it is registered."""
        node = self.node(node_id)
        if pid_of(node) is None:
            # Clients retrying a dead node's port may briefly hold it as their own source port
            # (a TCP self-connect when the port lies in the ephemeral range): retry a moment.
            deadline = time.monotonic() + 15.0
            while True:
                try:
                    self._check_ports(node)
                    break
                except PortInUseError:
                    if time.monotonic() > deadline:
                        raise
                    time.sleep(0.5)
            self._spawn(require("java", "install a Java 17+ runtime"), node)
            echo(f"Starting Apache Kafka node {node_id} at {node.bootstrap}")
        self._wait_ready()
        return self.status().nodes[node_id - 1]

    def kill(self, node_id: int, sig: int = signal.SIGKILL, timeout_s: float = 30.0) -> int | None:
        """Sends `sig` (default: kill -9) to one node and waits until it is gone; returns its pid."""
        node = self.node(node_id)
        pid = pid_of(node)
        if pid is None:
            return None
        os.kill(pid, sig)
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline and alive(pid):
            time.sleep(0.1)
        if alive(pid):
            os.kill(pid, signal.SIGKILL)
            while alive(pid):
                time.sleep(0.1)
        node.pid_file.unlink(missing_ok=True)
        return pid

    def down(self, echo: Echo = print, timeout_s: float = 30.0) -> bool:
        """Stops every node this data directory started; returns False when none was running."""
        pids = {n.node_id: p for n in self.nodes if (p := pid_of(n)) is not None}
        for n in self.nodes:
            if n.node_id not in pids:
                n.pid_file.unlink(missing_ok=True)
        if not pids:
            echo("No local Kafka is running from this data directory")
            return False
        for pid in pids.values():
            os.kill(pid, signal.SIGTERM)
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline and any(alive(p) for p in pids.values()):
            time.sleep(0.2)
        for node_id, pid in pids.items():
            if alive(pid):
                echo(f"Kafka node {node_id} (pid {pid}) did not stop within {timeout_s:.0f}s; killing it")
                self.kill(node_id)
            self.node(node_id).pid_file.unlink(missing_ok=True)
            echo(f"Kafka node {node_id} (pid {pid}) stopped")
        return True

    def status(self) -> KafkaStatus:
        pids = [pid_of(n) for n in self.nodes]
        registered = self._registered(timeout_s=3.0) if any(p is not None for p in pids) else set()
        nodes = tuple(
            NodeStatus(n.node_id, p is not None, p is not None and n.node_id in registered, p, n.bootstrap)
            for n, p in zip(self.nodes, pids, strict=True)
        )
        return KafkaStatus(
            all(n.running for n in nodes), all(n.answering for n in nodes), pids[0], self.bootstrap, self.root, nodes
        )

    def log_tail(self, lines: int = 50) -> str:
        texts = []
        for node in self.nodes:
            for name in ("server.log", "kafka.out"):
                path = node.logs / name
                if path.exists():
                    tail = "\n".join(path.read_text(errors="replace").splitlines()[-lines:])
                    texts.append(f"==> {path} <==\n{tail}")
        return "\n".join(texts) or f"no logs yet under {self.root}"

    # ---- steps ---------------------------------------------------------------------------------

    def resolve_jars(self, echo: Echo = print) -> None:
        """Copies Kafka's runtime jars into the shared jars folder with Maven, once per pom."""
        if not POM.exists():
            raise LocalKafkaError(f"{POM} is missing; the local Kafka needs the repo's docker/kafka/pom.xml")
        if (self.libs / ".resolved").exists():
            return
        mvn = require("mvn", "install Apache Maven, e.g. `apt-get install maven`")
        echo("Resolving Apache Kafka jars from Maven Central (first run only; Maven caches them)...")
        tmp = self.libs.with_name(f".{self.libs.name}.{os.getpid()}")
        shutil.rmtree(tmp, ignore_errors=True)
        cmd = [mvn, "-q", "-B", "-f", str(POM), "dependency:copy-dependencies", "-DincludeScope=runtime",
               f"-DoutputDirectory={tmp}"]
        res = subprocess.run(cmd, capture_output=True, text=True)
        if res.returncode != 0:
            raise LocalKafkaError(
                "Maven could not resolve Kafka's jars (is Maven Central reachable, or a mirror set in "
                f"~/.m2/settings.xml?):\n{(res.stdout + res.stderr)[-3000:]}"
            )
        (tmp / ".resolved").touch()
        try:
            tmp.rename(self.libs)
        except OSError:  # another process resolved the same pom meanwhile: keep theirs
            shutil.rmtree(tmp, ignore_errors=True)

    def _write_configs(self, node: Node) -> None:
        props = server_properties(self.nodes, node)
        if self.settings.secure:
            from astraflow.kafka.secure import CredentialStore, secure_server_props

            props.update(secure_server_props(node.bootstrap, node.controller_port, CredentialStore(self.root).admin_password()))
        node.root.mkdir(parents=True, exist_ok=True)
        node.properties.write_text("".join(f"{k}={v}\n" for k, v in props.items()))
        node.properties.chmod(0o600)  # holds the admin password when secure
        node.log4j.write_text(LOG4J2.format(log=node.logs / "server.log"))

    def _format(self, java: str, node: Node, cluster_id: str, echo: Echo) -> None:
        meta = node.storage / "meta.properties"
        if meta.exists():
            found = read_props(meta).get("cluster.id")
            if found != cluster_id:
                raise ClusterIdMismatchError(
                    f"{node.storage} was formatted for cluster {found}, but {self.cluster_file} says {cluster_id}; "
                    f"point local_kafka.data_dir elsewhere, or delete {node.storage} to start empty"
                )
            return
        echo(f"Formatting KRaft storage in {node.storage} (cluster {cluster_id})")
        cmd = [java, "-Xmx256m", f"-Dlog4j2.configurationFile={node.log4j}", "-cp", f"{self.libs}/*",
               "kafka.tools.StorageTool", "format", "--ignore-formatted", f"--cluster-id={cluster_id}",  # "=": ids may start with "-"
               "-c", str(node.properties)]
        if len(self.nodes) == 1:
            cmd.append("--standalone")  # dynamic quorum of one; several nodes use static voters
        if self.settings.secure:
            from astraflow.kafka.secure import CredentialStore, format_scram_args

            cmd += format_scram_args(CredentialStore(self.root).admin_password())
        res = subprocess.run(cmd, capture_output=True, text=True)
        if res.returncode != 0:
            raise LocalKafkaError(f"formatting KRaft storage failed:\n{(res.stdout + res.stderr)[-3000:]}")

    def _spawn(self, java: str, node: Node) -> None:
        node.logs.mkdir(parents=True, exist_ok=True)
        heap = self.settings.heap_mb
        cmd = [java, f"-Xms{min(256, heap)}m", f"-Xmx{heap}m", "-XX:+UseG1GC", "-Djava.awt.headless=true",
               f"-Dkafka.logs.dir={node.logs}", f"-Dlog4j2.configurationFile={node.log4j}",
               "-cp", f"{self.libs}/*", "kafka.Kafka", str(node.properties)]
        with open(node.logs / "kafka.out", "ab") as out:
            proc = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, start_new_session=True)
        node.pid_file.write_text(str(proc.pid))

    def _check_layout(self) -> None:
        """One data directory holds one kind of cluster: refuse to reuse it for another."""
        want = {"brokers": len(self.nodes), "secure": self.settings.secure}
        ports = {"port": self.settings.port, "controller_port": self.settings.controller_port,
                 "wan_proxy_port": self.settings.wan_proxy_port, "wan_port": self.settings.wan_port}
        if self.layout_file.exists():
            found = {k: v for k, v in json.loads(self.layout_file.read_text()).items() if k in want}
        elif (self.root / "data" / "meta.properties").exists():
            found = {"brokers": 1, "secure": False}  # formatted before layout.json existed
        else:  # the ports too, so later commands on this data directory find the nodes
            self.layout_file.write_text(json.dumps({**want, **ports}) + "\n")
            return
        if found != want:
            raise LocalKafkaError(
                f"{self.root} holds a cluster of {found['brokers']} node(s) with secure={found['secure']}, not "
                f"{want['brokers']} with secure={want['secure']}; choose another --data-dir (and ports), or delete it"
            )

    def _cluster_id(self) -> str:
        if self.cluster_file.exists():
            return self.cluster_file.read_text().strip()
        cid = "-"
        while cid.startswith("-"):  # as Kafka's own Uuid.randomUuid(): an id starting with "-" reads as an option
            cid = base64.urlsafe_b64encode(uuid.uuid4().bytes).decode().rstrip("=")
        self.cluster_file.write_text(cid + "\n")
        return cid

    def _check_ports(self, node: Node) -> None:
        ports = [(node.port, "broker"), (node.controller_port, "controller")]
        if node.wan_port is not None:
            ports.append((node.wan_port, "WAN listener"))
        for port, what in ports:
            with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
                sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
                try:
                    sock.bind(("127.0.0.1", port))
                except OSError:
                    raise PortInUseError(
                        f"port {port} ({what} of node {node.node_id}) on 127.0.0.1 is taken by another process; stop "
                        f"it, or choose another with local_kafka.{_SETTING[what]}=N "
                        f"(and kafka.bootstrap_servers to match)"
                    ) from None

    def _wait_ready(self) -> None:
        deadline = time.monotonic() + self.settings.start_timeout_s
        want = {n.node_id for n in self.nodes}
        while time.monotonic() < deadline:
            for node in self.nodes:
                if pid_of(node) is None:
                    raise LocalKafkaError(
                        f"Kafka node {node.node_id} exited during start-up. Last log lines:\n{self.log_tail(40)}"
                    )
            if want <= self._registered(timeout_s=2.0):
                return
            time.sleep(0.5)
        raise LocalKafkaError(
            f"Kafka did not answer at {self.bootstrap} within {self.settings.start_timeout_s:.0f}s. "
            f"Last log lines:\n{self.log_tail(40)}"
        )

    def _registered(self, timeout_s: float) -> set[int]:
        """Ids of the brokers the cluster's metadata lists (fenced or stopped ones drop out)."""
        from confluent_kafka.admin import AdminClient

        try:
            conf = {**self.admin_settings().client_config(), "socket.connection.setup.timeout.ms": "1000", "log_level": "0"}
            md = AdminClient(conf).list_topics(timeout=timeout_s)
        except Exception:  # KafkaException while no node answers yet; missing credentials before format
            return set()
        return set(md.brokers)
