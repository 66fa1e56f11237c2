"""Runs the pipeline's roles as separate processes and stops them together.

Each role is a command line with its own log file in the run directory. If any role exits
before it is asked to, the supervisor stops the others and reports the failing role with the
tail of its log. Ctrl-C (or `stop_all`) sends SIGTERM to every role, waits, then SIGKILLs.
"""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import time
from dataclasses import dataclass, field
from pathlib import Path


@dataclass
class Role:
    """One supervised process."""

    name: str  # e.g. raas-1
    cmd: list[str]  # argv
    env: dict[str, str] = field(default_factory=dict)  # added to the environment
    proc: subprocess.Popen | None = None
    log: Path | None = None


class RoleFailed(Exception):
    """Raised by `check` when a role exited on its own; carries its name, code and log tail."""

    def __init__(self, role: Role, code: int, tail: str) -> None:
        super().__init__(f"{role.name} exited with code {code}")
        self.role, self.code, self.tail = role, code, tail


class Supervisor:
    """Starts roles, watches them, stops them all."""

    def __init__(self, log_dir: Path) -> None:
        self.log_dir = log_dir
        log_dir.mkdir(parents=True, exist_ok=True)
        self.roles: list[Role] = []

    def start(self, role: Role) -> Role:
        role.log = self.log_dir / f"{role.name}.log"
        out = role.log.open("ab")
        role.proc = subprocess.Popen(
            role.cmd, stdout=out, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
            env={**os.environ, **role.env}, start_new_session=True,
        )
        out.close()
        self.roles.append(role)
        return role

    def check(self) -> None:
        """Raises RoleFailed for the first role that has exited."""
        for role in self.roles:
            code = role.proc.poll() if role.proc else None
            if code is not None:
                raise RoleFailed(role, code, tail(role.log, 30))

    def stop_all(self, timeout_s: float = 30.0) -> None:
        live = [r for r in self.roles if r.proc and r.proc.poll() is None]
        for r in live:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(r.proc.pid, signal.SIGTERM)
        deadline = time.monotonic() + timeout_s
        for r in live:
            try:
                r.proc.wait(timeout=max(0.1, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(r.proc.pid, signal.SIGKILL)
                r.proc.wait()


def tail(path: Path | None, lines: int) -> str:
    if path is None or not path.exists():
        return ""
    return "\n".join(path.read_text(errors="replace").splitlines()[-lines:])
