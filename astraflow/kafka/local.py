"""A real single-node Apache Kafka (KRaft) for machines without Docker.

`LocalKafka.up()` resolves the broker's jars from Maven Central with `docker/kafka/pom.xml`
(Maven caches them in ~/.m2), formats KRaft storage once, starts `kafka.Kafka` on 127.0.0.1
with a small heap, waits until it answers a metadata request and writes a pid file. `down()`
stops only the process that pid file names, after checking it is our broker.
"""

from __future__ import annotations

import base64
import contextlib
import hashlib
import os
import shutil
import signal
import socket
import subprocess
import sys
import time
import uuid
from dataclasses import dataclass
from pathlib import Path

from astraflow.config import LocalKafkaSettings
from astraflow.errors import ClusterIdMismatchError, LocalKafkaError, PortInUseError, ToolMissingError

POM = Path(__file__).resolve().parents[2] / "docker" / "kafka" / "pom.xml"

_LOG4J2 = """\
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
class KafkaStatus:
    """What `status` reports."""

    running: bool  # our broker process is alive
    answering: bool  # it answers metadata requests
    pid: int | None
    bootstrap: str
    data_dir: Path


class LocalKafka:
    """Manages one local broker+controller rooted at `settings.data_dir`."""

    def __init__(self, settings: LocalKafkaSettings | None = None) -> None:
        self.settings = settings or LocalKafkaSettings()
        root = self.settings.data_dir.expanduser().resolve()
        self.root = root
        self.libs = root / "libs"
        self.storage = root / "data"
        self.logs = root / "logs"
        self.pid_file = root / "kafka.pid"
        self.cluster_file = root / "cluster.id"
        self.properties = root / "server.properties"
        self.log4j = root / "log4j2.properties"

    @property
    def bootstrap(self) -> str:
        return f"127.0.0.1:{self.settings.port}"

    # ---- lifecycle -----------------------------------------------------------------------------

    def up(self, echo=print) -> KafkaStatus:
        """Starts the broker unless ours is already running; returns once it answers."""
        st = self.status()
        if st.running and st.answering:
            echo(f"Kafka already running at {self.bootstrap} (pid {st.pid}); nothing to do")
            return st
        if st.running:
            echo(f"Kafka process {st.pid} is alive but not answering yet; waiting")
            self._wait_ready(st.pid)
            return self.status()
        java = _require("java", "install a Java 17+ runtime, e.g. `apt-get install openjdk-17-jre-headless`")
        self._check_ports()
        self.root.mkdir(parents=True, exist_ok=True)
        self.logs.mkdir(exist_ok=True)
        self.resolve_jars(echo)
        self._write_configs()
        self._format(java, echo)
        out = open(self.logs / "kafka.out", "ab")  # noqa: SIM115 - handed to the child process
        cmd = [
            java,
            f"-Xms{min(256, self.settings.heap_mb)}m",
            f"-Xmx{self.settings.heap_mb}m",
            "-XX:+UseG1GC",
            "-Djava.awt.headless=true",
            f"-Dkafka.logs.dir={self.logs}",
            f"-Dlog4j2.configurationFile={self.log4j}",
            "-cp",
            f"{self.libs}/*",
            "kafka.Kafka",
            str(self.properties),
        ]
        proc = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, start_new_session=True)
        out.close()
        self.pid_file.write_text(str(proc.pid))
        echo(f"Starting Apache Kafka (pid {proc.pid}), data in {self.root}")
        self._wait_ready(proc.pid)
        echo(f"Kafka is up: bootstrap servers {self.bootstrap}")
        return self.status()

    def down(self, echo=print, timeout_s: float = 30.0) -> bool:
        """Stops the broker this data directory started; returns False when none was running."""
        pid = self._our_pid()
        if pid is None:
            echo("No local Kafka is running from this data directory")
            self.pid_file.unlink(missing_ok=True)
            return False
        os.kill(pid, signal.SIGTERM)
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline and _alive(pid):
            time.sleep(0.2)
        if _alive(pid):
            echo(f"Kafka (pid {pid}) did not stop within {timeout_s:.0f}s; killing it")
            os.kill(pid, signal.SIGKILL)
        self.pid_file.unlink(missing_ok=True)
        echo(f"Kafka (pid {pid}) stopped")
        return True

    def status(self) -> KafkaStatus:
        pid = self._our_pid()
        answering = pid is not None and _answers_metadata(self.bootstrap, timeout_s=3.0)
        return KafkaStatus(pid is not None, answering, pid, self.bootstrap, self.root)

    def log_tail(self, lines: int = 50) -> str:
        texts = []
        for name in ("server.log", "kafka.out"):
            path = self.logs / name
            if path.exists():
                texts.append(f"==> {path} <==\n" + "\n".join(path.read_text(errors="replace").splitlines()[-lines:]))
        return "\n".join(texts) or f"no logs yet in {self.logs}"

    # ---- steps ---------------------------------------------------------------------------------

    def resolve_jars(self, echo=print) -> None:
        """Copies Kafka's runtime jars into `libs/` with Maven, once per pom version."""
        if not POM.exists():
            raise LocalKafkaError(f"{POM} is missing; the local Kafka needs the repo's docker/kafka/pom.xml")
        digest = hashlib.sha256(POM.read_bytes()).hexdigest()[:16]
        marker = self.libs / f".resolved-{digest}"
        if marker.exists():
            return
        mvn = _require("mvn", "install Apache Maven, e.g. `apt-get install maven`")
        echo("Resolving Apache Kafka jars from Maven Central (first run only; Maven caches them)...")
        if self.libs.exists():
            shutil.rmtree(self.libs)
        cmd = [mvn, "-q", "-B", "-f", str(POM), "dependency:copy-dependencies", "-DincludeScope=runtime",
               f"-DoutputDirectory={self.libs}"]
        res = subprocess.run(cmd, capture_output=True, text=True)
        if res.returncode != 0:
            raise LocalKafkaError(
                "Maven could not resolve Kafka's jars (is Maven Central reachable, or a mirror set in "
                f"~/.m2/settings.xml?):\n{(res.stdout + res.stderr)[-3000:]}"
            )
        marker.touch()

    def _write_configs(self) -> None:
        s = self.settings
        props = {
            "process.roles": "broker,controller",
            "node.id": "1",
            "controller.quorum.bootstrap.servers": f"127.0.0.1:{s.controller_port}",
            "listeners": f"PLAINTEXT://127.0.0.1:{s.port},CONTROLLER://127.0.0.1:{s.controller_port}",
            "advertised.listeners": f"PLAINTEXT://127.0.0.1:{s.port}",
            "controller.listener.names": "CONTROLLER",
            "inter.broker.listener.name": "PLAINTEXT",
            "listener.security.protocol.map": "PLAINTEXT:PLAINTEXT,CONTROLLER:PLAINTEXT",
            "log.dirs": str(self.storage),
            "num.network.threads": "2",
            "num.io.threads": "2",
            "num.partitions": "4",
            "offsets.topic.num.partitions": "8",
            "offsets.topic.replication.factor": "1",
            "transaction.state.log.num.partitions": "4",
            "transaction.state.log.replication.factor": "1",
            "transaction.state.log.min.isr": "1",
            "share.coordinator.state.topic.replication.factor": "1",
            "share.coordinator.state.topic.min.isr": "1",
            "group.initial.rebalance.delay.ms": "0",
            "auto.create.topics.enable": "false",
            "log.cleaner.dedupe.buffer.size": str(16 * 1024 * 1024),
            "message.max.bytes": str(64 * 1024 * 1024),
            "replica.fetch.max.bytes": str(64 * 1024 * 1024),
            "log.retention.check.interval.ms": "60000",
        }
        self.properties.write_text("".join(f"{k}={v}\n" for k, v in props.items()))
        self.log4j.write_text(_LOG4J2.format(log=self.logs / "server.log"))

    def _format(self, java: str, echo) -> None:
        cluster_id = self._cluster_id()
        meta = self.storage / "meta.properties"
        if meta.exists():
            found = _read_props(meta).get("cluster.id")
            if found != cluster_id:
                raise ClusterIdMismatchError(
                    f"{self.storage} was formatted for cluster {found}, but {self.cluster_file} says {cluster_id}; "
                    f"point local_kafka.data_dir elsewhere, or delete {self.storage} to start empty"
                )
            return
        echo(f"Formatting KRaft storage in {self.storage} (cluster {cluster_id})")
        cmd = [java, "-Xmx256m", f"-Dlog4j2.configurationFile={self.log4j}", "-cp", f"{self.libs}/*",
               "kafka.tools.StorageTool", "format", "--standalone", "--ignore-formatted",
               "-t", cluster_id, "-c", str(self.properties)]
        res = subprocess.run(cmd, capture_output=True, text=True)
        if res.returncode != 0:
            raise LocalKafkaError(f"formatting KRaft storage failed:\n{(res.stdout + res.stderr)[-3000:]}")

    def _cluster_id(self) -> str:
        if self.cluster_file.exists():
            return self.cluster_file.read_text().strip()
        cid = base64.urlsafe_b64encode(uuid.uuid4().bytes).decode().rstrip("=")
        self.cluster_file.write_text(cid + "\n")
        return cid

    def _check_ports(self) -> None:
        for port, what in ((self.settings.port, "broker"), (self.settings.controller_port, "controller")):
            with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
                sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
                try:
                    sock.bind(("127.0.0.1", port))
                except OSError:
                    raise PortInUseError(
                        f"port {port} ({what}) on 127.0.0.1 is taken by another process; stop it, or choose "
                        f"another with local_kafka.{'port' if what == 'broker' else 'controller_port'}=N "
                        f"(and kafka.bootstrap_servers to match)"
                    ) from None

    def _wait_ready(self, pid: int | None) -> None:
        deadline = time.monotonic() + self.settings.start_timeout_s
        while time.monotonic() < deadline:
            if pid is not None and not _alive(pid):
                self.pid_file.unlink(missing_ok=True)
                raise LocalKafkaError(f"Kafka exited during start-up. Last log lines:\n{self.log_tail(40)}")
            if _answers_metadata(self.bootstrap, timeout_s=2.0):
                return
            time.sleep(0.5)
        raise LocalKafkaError(
            f"Kafka did not answer at {self.bootstrap} within {self.settings.start_timeout_s:.0f}s. "
            f"Last log lines:\n{self.log_tail(40)}"
        )

    def _our_pid(self) -> int | None:
        """The pid in our pid file, if that process is alive and is our broker."""
        try:
            pid = int(self.pid_file.read_text().strip())
        except (FileNotFoundError, ValueError):
            return None
        if not _alive(pid):
            return None
        try:
            cmdline = Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")
        except OSError:
            return pid if sys.platform != "linux" else None
        if b"kafka.Kafka" in cmdline and str(self.properties).encode() in cmdline:
            return pid
        return None


def _require(tool: str, hint: str) -> str:
    path = shutil.which(tool)
    if path is None:
        raise ToolMissingError(f"`{tool}` is not on PATH; the local Kafka needs it: {hint}")
    return path


def _alive(pid: int) -> bool:
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


def _read_props(path: Path) -> dict[str, str]:
    out = {}
    for line in path.read_text().splitlines():
        if "=" in line and not line.lstrip().startswith("#"):
            k, v = line.split("=", 1)
            out[k.strip()] = v.strip()
    return out


def _answers_metadata(bootstrap: str, timeout_s: float) -> bool:
    from confluent_kafka.admin import AdminClient

    admin = AdminClient({"bootstrap.servers": bootstrap, "socket.connection.setup.timeout.ms": "1000", "log_level": "0"})
    try:
        md = admin.list_topics(timeout=timeout_s)
    except Exception:  # KafkaException while the broker is not up yet
        return False
    return bool(md.brokers)
