"""Runs the pipeline's roles as separate processes and stops them together.

Each role is a command line with its own log file in the run directory. If any role exits
before it is asked to, the supervisor stops the others and reports the failing role with the
tail of its log. Ctrl-C (or `stop_all`) sends SIGTERM to every role, waits, then SIGKILLs.
The fault harness (`bench/faults.py`) also kills one role (`kill`, its whole process group),
starts it again (`restart`, same command, same log appended) and stops one (`stop`).

With `die_with_parent` (the demo), each role gets SIGTERM from the kernel when the process that
started it dies in any way (a segfault, kill -9), so a crashed demo leaves no orphaned roles
behind (Linux `PR_SET_PDEATHSIG`; the signal follows the *thread* that started the role, so only
use it where roles are started from a thread that lives as long as the run, e.g. the main one).
"""

from __future__ import annotations

import contextlib
import ctypes
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


_PR_SET_PDEATHSIG = 1


def _term_with_parent() -> None:
    """In the child, before exec: SIGTERM when the parent dies (Linux; elsewhere a no-op)."""
    with contextlib.suppress(OSError, AttributeError):
        ctypes.CDLL(None, use_errno=True).prctl(_PR_SET_PDEATHSIG, signal.SIGTERM, 0, 0, 0)


class RoleFailed(Exception):
    """Raised by `check` when a role exited on its own; carries its name, code and log tail."""

    def __init__(self, role: Role, code: int, tail: str) -> None:
        super().__init__(f"{role.name} exited with code {code}")
        self.role, self.code, self.tail = role, code, tail


class Supervisor:
    """Starts roles, watches them, stops them all."""

    def __init__(self, log_dir: Path, die_with_parent: bool = False) -> None:
        self.log_dir = log_dir
        self.die_with_parent = die_with_parent
        log_dir.mkdir(parents=True, exist_ok=True)
        self.roles: list[Role] = []

    def start(self, role: Role) -> Role:
        self._spawn(role)
        self.roles.append(role)
        return role

    def _spawn(self, role: Role) -> None:
        role.log = self.log_dir / f"{role.name}.log"
        out = role.log.open("ab")
        role.proc = subprocess.Popen(
            role.cmd, stdout=out, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
            env={**os.environ, **role.env}, start_new_session=True,
            preexec_fn=_term_with_parent if self.die_with_parent else None,
        )
        out.close()

    def kill(self, role: Role, sig: int = signal.SIGKILL) -> None:
        """Sends `sig` to the role's process group (the role and anything it started) and reaps it."""
        if role.proc is None or role.proc.poll() is not None:
            return
        with contextlib.suppress(ProcessLookupError):
            os.killpg(role.proc.pid, sig)
        role.proc.wait()

    def restart(self, role: Role) -> Role:
        """Starts an exited (or killed) role again with the same command; its log is appended to."""
        if role.proc is not None and role.proc.poll() is None:
            raise RuntimeError(f"{role.name} is still running (pid {role.proc.pid}); kill it first")
        self._spawn(role)
        return role

    def stop(self, role: Role, timeout_s: float = 30.0) -> None:
        """SIGTERM, then SIGKILL after `timeout_s`; the role is no longer supervised."""
        if role.proc is not None and role.proc.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(role.proc.pid, signal.SIGTERM)
            try:
                role.proc.wait(timeout=timeout_s)
            except subprocess.TimeoutExpired:
                self.kill(role)
        if role in self.roles:
            self.roles.remove(role)

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
