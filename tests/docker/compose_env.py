"""What the docker tests share: the engine, free host ports, and projects a killed run left behind.

Each docker test runs its own compose project, named with its own prefix, so that one test's
clean-up never removes another's project.
"""

from __future__ import annotations

import os
import socket
import subprocess
import uuid
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = ROOT / "scripts" / "compose.sh"


def client() -> str:
    """The docker client scripts/compose.sh prefers (Debian's, which builds with BuildKit)."""
    return "/usr/bin/docker" if Path("/usr/bin/docker").exists() else "docker"


def engine_answers() -> bool:
    for c in ("/usr/bin/docker", "docker"):
        try:
            if subprocess.run([c, "info"], capture_output=True, timeout=30).returncode == 0:
                return True
        except (OSError, subprocess.TimeoutExpired):
            continue
    return False


def require_engine() -> None:
    """Skips without an engine, unless ASTRAFLOW_REQUIRE_DOCKER=1 (scripts/test.sh), which fails."""
    if engine_answers():
        return
    if os.environ.get("ASTRAFLOW_REQUIRE_DOCKER") == "1":
        pytest.fail("no Docker engine answers (scripts/test.sh starts one: bash scripts/compose.sh engine)")
    pytest.skip("no Docker engine (bash scripts/compose.sh engine starts one)")


def free_ports(n: int) -> list[int]:
    """Host ports the system has free now, not fixed ones another stack may hold."""
    socks = [socket.socket() for _ in range(n)]
    try:
        for sock in socks:
            sock.bind(("127.0.0.1", 0))
        return [sock.getsockname()[1] for sock in socks]
    finally:
        for sock in socks:
            sock.close()


def remove_stale_projects(prefix: str) -> None:
    """Containers, networks and volumes of earlier projects named `prefix...` (a run killed before its
    `down -v`): a container that restarts with the engine would hold the host's ports and memory."""
    docker = client()
    label = '{{.Label "com.docker.compose.project"}}'
    for ls, rm in ((["ps", "-a", "--format", "{{.ID}} " + label], ["rm", "-f"]),
                   (["network", "ls", "--format", "{{.ID}} " + label], ["network", "rm"]),
                   (["volume", "ls", "--format", "{{.Name}} " + label], ["volume", "rm", "-f"])):
        rows = subprocess.run([docker, *ls], capture_output=True, text=True, timeout=60).stdout.splitlines()
        stale = [row.split()[0] for row in rows if len(row.split()) == 2 and row.split()[1].startswith(prefix)]
        if stale:
            subprocess.run([docker, *rm, *stale], capture_output=True, timeout=300)


def project_is_gone(project: str) -> None:
    """Asserts that no container, network or volume of the compose project is left."""
    label = f"label=com.docker.compose.project={project}"
    for kind in (["ps", "-a", "-q"], ["network", "ls", "-q"], ["volume", "ls", "-q"]):
        out = subprocess.run([client(), *kind, "--filter", label], capture_output=True, text=True, check=True).stdout
        assert not out.strip(), f"docker {' '.join(kind)} after down -v: {out}"


class ComposeProject:
    """One compose project of scripts/compose.sh, named `prefix` + a random suffix: `dc(...)` runs
    docker-compose on it with `env` (compose variables) on top of this process's environment."""

    def __init__(self, prefix: str, env: dict[str, str]) -> None:
        self.project = f"{prefix}{uuid.uuid4().hex[:8]}"
        self.env = {**os.environ, **env, "AF_PROJECT": self.project}

    def script(self, *args: str, timeout: float = 3600) -> str:
        res = subprocess.run(["bash", str(SCRIPT), *args], env=self.env, cwd=ROOT, capture_output=True, text=True,
                             timeout=timeout)
        if res.returncode != 0:
            raise AssertionError(f"scripts/compose.sh {' '.join(args)} failed ({res.returncode}):\n"
                                 f"{res.stdout[-3000:]}\n{res.stderr[-5000:]}")
        return res.stdout

    def dc(self, *args: str, timeout: float = 600) -> str:
        return self.script("compose", *args, timeout=timeout)

    def containers(self, service: str | None = None, all_: bool = False) -> list[str]:
        args = ["ps", "-q", *(["-a"] if all_ else []), *([service] if service else [])]
        return self.dc(*args).split()

    def logs(self, tail: int = 40, service: str | None = None) -> str:
        try:
            return self.dc("logs", "--no-color", "--tail", str(tail), *([service] if service else []), timeout=120)[-20000:]
        except AssertionError as exc:
            return str(exc)
