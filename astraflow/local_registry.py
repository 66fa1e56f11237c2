"""A real schema registry on this machine, without Docker: Apicurio Registry 3.3.

`LocalRegistry.up()` resolves Apicurio's assembled Quarkus application from Maven Central with
`docker/registry/pom.xml` (Maven caches it in ~/.m2; unpacked once per pom into
`local_registry.dist_dir`), starts it on 127.0.0.1 with a small heap, waits until its
Confluent-compatible API (`/apis/ccompat/v7`) answers and writes a pid file; `down()` stops only
the process that file names, after checking it is our registry. Roles put
`kafka.schema_registry_url` at `LocalRegistrySettings.url` and register their schemas on start.

Its schemas live in Apicurio's H2 database in a file under the data directory (`storage_flags`,
which the compose image uses too): records on the topics name their schema by the registry's id,
and a registry that restarted empty would hand the same ids to other schemas.

Apicurio 3.3 is compiled for Java 21: `java` is the first Java 21+ found (see the setting).
"""

from __future__ import annotations

import hashlib
import os
import re
import shutil
import signal
import socket
import subprocess
import time
import urllib.request
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from astraflow.config import LocalRegistrySettings
from astraflow.errors import LocalRegistryError, PortInUseError, ToolMissingError
from astraflow.kafka.nodes import alive, require

POM = Path(__file__).resolve().parents[1] / "docker" / "registry" / "pom.xml"
SETTINGS = POM.with_name("settings.xml")
MIN_JAVA = 21
Echo = Callable[..., Any]
# JVM flags of every registry we run (here and in the compose image): the serial collector and C1
# only, which start fastest for a service this small.
JVM_FLAGS = ("-XX:+UseSerialGC", "-XX:TieredStopAtLevel=1", "-Djava.awt.headless=true")
DB_NAME = "registry"  # H2 keeps the database in <db_dir>/registry.mv.db


def storage_flags(db_dir: str | Path) -> list[str]:
    """Apicurio's storage as JVM system properties: its H2 database in a file under `db_dir`.

    Apicurio's default is an H2 database in memory, gone at every restart. WRITE_DELAY=0 writes
    each commit to the file at once (H2's default waits up to 500 ms), so an id the registry has
    handed out survives even a killed registry; schemas are registered rarely, so it costs nothing.
    """
    return [f"-Dapicurio.datasource.url=jdbc:h2:file:{db_dir}/{DB_NAME};WRITE_DELAY=0"]


@dataclass(frozen=True)
class RegistryStatus:
    """What `status` reports."""

    running: bool  # our process is alive
    answering: bool  # its API answered
    pid: int | None
    url: str
    log: Path
    database: Path  # the H2 file its schemas live in (absent until the first start)


def java_version(java: str) -> int:
    """The major version `java -version` prints (0 when it cannot be run)."""
    try:
        out = subprocess.run([java, "-version"], capture_output=True, text=True, timeout=30).stderr
    except (OSError, subprocess.SubprocessError):
        return 0
    m = re.search(r'version "(\d+)', out)
    return int(m.group(1)) if m else 0


def find_java(configured: str | None = None) -> str:
    """A Java 21+ executable: the setting, $ASTRAFLOW_REGISTRY_JAVA, $JAVA_HOME, /usr/lib/jvm, PATH."""
    explicit = configured or os.environ.get("ASTRAFLOW_REGISTRY_JAVA")
    if explicit:
        if java_version(explicit) < MIN_JAVA:
            raise ToolMissingError(f"{explicit} is not a Java {MIN_JAVA}+ runtime; Apicurio Registry 3.3 needs one")
        return explicit
    candidates = []
    if os.environ.get("JAVA_HOME"):
        candidates.append(Path(os.environ["JAVA_HOME"]) / "bin" / "java")
    candidates += sorted(Path("/usr/lib/jvm").glob("*/bin/java"), reverse=True)
    if shutil.which("java"):
        candidates.append(Path(shutil.which("java")))  # type: ignore[arg-type]
    for java in candidates:
        if java.exists() and java_version(str(java)) >= MIN_JAVA:
            return str(java)
    raise ToolMissingError(
        f"no Java {MIN_JAVA}+ runtime found (looked at $JAVA_HOME, /usr/lib/jvm/*, PATH); Apicurio Registry 3.3 "
        f"needs one: install e.g. a Temurin or OpenJDK {MIN_JAVA}, or set local_registry.java=/path/to/java"
    )


class LocalRegistry:
    """Manages the local Apicurio rooted at `settings.data_dir`."""

    def __init__(self, settings: LocalRegistrySettings | None = None) -> None:
        self.settings = s = settings or LocalRegistrySettings()
        self.root = s.data_dir.expanduser().resolve()
        self.pid_file = self.root / "registry.pid"
        self.log = self.root / "registry.log"
        self.database = self.root / f"{DB_NAME}.mv.db"
        digest = hashlib.sha256(POM.read_bytes()).hexdigest()[:16] if POM.exists() else "missing"
        self.dist = s.dist_dir.expanduser().resolve() / digest
        self._proc: subprocess.Popen[bytes] | None = None  # the process `up` started in this process

    @property
    def url(self) -> str:
        return self.settings.url

    def pid(self) -> int | None:
        """The pid in the pid file, if that process is alive and is our registry."""
        try:
            pid = int(self.pid_file.read_text().strip())
        except (FileNotFoundError, ValueError):
            return None
        if not alive(pid):
            return None
        try:
            cmdline = Path(f"/proc/{pid}/cmdline").read_bytes()
        except OSError:
            return None
        return pid if str(self.dist).encode() in cmdline else None

    def answering(self, timeout_s: float = 2.0) -> bool:
        try:
            with urllib.request.urlopen(f"{self.url}/subjects", timeout=timeout_s) as resp:
                return resp.status == 200
        except OSError:
            return False

    def status(self) -> RegistryStatus:
        pid = self.pid()
        return RegistryStatus(pid is not None, pid is not None and self.answering(), pid, self.url, self.log,
                              self.database)

    def resolve(self, echo: Echo = print) -> Path:
        """Unpacks Apicurio's application into the shared folder with Maven, once per pom."""
        if (self.dist / ".resolved").exists():
            return self.dist
        if not POM.exists():
            raise LocalRegistryError(f"{POM} is missing; the local registry needs the repo's docker/registry/pom.xml")
        mvn = require("mvn", "install Apache Maven, e.g. `apt-get install maven`")
        echo("Resolving Apicurio Registry from Maven Central (first run only, ~160 MB; Maven caches it)...")
        tmp = self.dist.with_name(f".{self.dist.name}.{os.getpid()}")
        work = self.dist.with_name(f".work.{os.getpid()}")  # Maven's target/ and markers stay out of the repo
        for d in (tmp, work):
            shutil.rmtree(d, ignore_errors=True)
        work.mkdir(parents=True)
        shutil.copy(POM, work / "pom.xml")
        cmd = [mvn, "-q", "-B", "-gs", str(SETTINGS), "-f", str(work / "pom.xml"), "dependency:unpack-dependencies",
               f"-DoutputDirectory={tmp}"]
        try:
            res = subprocess.run(cmd, capture_output=True, text=True)
        finally:
            shutil.rmtree(work, ignore_errors=True)
        if res.returncode != 0 or not (tmp / "quarkus-run.jar").exists():
            raise LocalRegistryError(
                "Maven could not resolve Apicurio Registry (is Maven Central reachable, or a mirror set in "
                f"~/.m2/settings.xml?):\n{(res.stdout + res.stderr)[-3000:]}"
            )
        (tmp / ".resolved").touch()
        try:
            tmp.rename(self.dist)
        except OSError:  # another process resolved the same pom meanwhile: keep theirs
            shutil.rmtree(tmp, ignore_errors=True)
        return self.dist

    def up(self, echo: Echo = print) -> RegistryStatus:
        """Starts the registry unless it runs; returns once its API answers."""
        st = self.status()
        if st.running and st.answering:
            echo(f"Schema registry already running at {self.url} (pid {st.pid}); nothing to do")
            return st
        if not st.running:
            java = find_java(self.settings.java)
            self._check_port()
            self.resolve(echo)
            self._spawn(java)
            echo(f"Starting Apicurio Registry at {self.url} (schemas: {self.database}; logs: {self.log})")
        self._wait_ready()
        echo(f"Schema registry is up: kafka.schema_registry_url={self.url}")
        return self.status()

    def down(self, echo: Echo = print, timeout_s: float = 30.0) -> bool:
        """Stops the registry this data directory started; returns False when none was running."""
        pid = self.pid()
        if pid is None:
            self.pid_file.unlink(missing_ok=True)
            echo("No local schema registry is running from this data directory")
            return False
        os.kill(pid, signal.SIGTERM)
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline and alive(pid):
            time.sleep(0.2)
        if alive(pid):
            echo(f"schema registry (pid {pid}) did not stop within {timeout_s:.0f}s; killing it")
            os.kill(pid, signal.SIGKILL)
            while alive(pid):
                time.sleep(0.1)
        self.pid_file.unlink(missing_ok=True)
        echo(f"Schema registry (pid {pid}) stopped")
        return True

    def log_tail(self, lines: int = 40) -> str:
        if not self.log.exists():
            return f"no log yet at {self.log}"
        return "\n".join(self.log.read_text(errors="replace").splitlines()[-lines:])

    def _spawn(self, java: str) -> None:
        self.root.mkdir(parents=True, exist_ok=True)
        heap = self.settings.heap_mb
        cmd = [java, f"-Xms{min(64, heap)}m", f"-Xmx{heap}m", *JVM_FLAGS, *storage_flags(self.root),
               f"-Dquarkus.http.port={self.settings.port}", "-Dquarkus.http.host=127.0.0.1",
               # Quarkus' management interface (health, metrics; we use neither) listens on
               # 0.0.0.0:9000 by default: loopback and a free port, so two registries can run here.
               "-Dquarkus.management.host=127.0.0.1", "-Dquarkus.management.port=0",
               "-jar", str(self.dist / "quarkus-run.jar")]
        with open(self.log, "ab") as out:
            self._proc = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                          cwd=self.dist, start_new_session=True)
        self.pid_file.write_text(str(self._proc.pid))

    def _check_port(self) -> None:
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            try:
                sock.bind(("127.0.0.1", self.settings.port))
            except OSError:
                raise PortInUseError(
                    f"port {self.settings.port} on 127.0.0.1 is taken by another process; stop it, or choose another "
                    f"with local_registry.port=N (and kafka.schema_registry_url to match)"
                ) from None

    def _wait_ready(self) -> None:
        deadline = time.monotonic() + self.settings.start_timeout_s
        proc = self._proc  # the process `up` started, if it did (its exit code, not a pid lookup, tells it died)
        while time.monotonic() < deadline:
            if proc is not None and proc.poll() is not None:
                self.pid_file.unlink(missing_ok=True)
                raise LocalRegistryError(f"the schema registry exited during start-up. Last log lines:\n{self.log_tail()}")
            if self.answering():
                return
            time.sleep(0.5)
        if proc is not None:  # leave nothing half-started behind
            proc.kill()
            proc.wait()
            self.pid_file.unlink(missing_ok=True)
        raise LocalRegistryError(
            f"the schema registry did not answer at {self.url} within {self.settings.start_timeout_s:.0f}s. "
            f"Last log lines:\n{self.log_tail()}"
        )
