"""Memory and process-count bounds of sandbox runs, per run and in total (cgroup v1).

Layout, in the memory and the pids hierarchies under /sys/fs/cgroup:

    astraflow-sandbox/             memory: `total_memory_mb` for all runs of this machine
                                   (`SandboxSettings.cgroup_parent` names it)
        <pid>-<n>-<random>/        one per run: memory `memory_mb` (swap included), pids `nproc`

A run's processes enter its cgroup before the sandbox starts (`enter_argv` puts a shell in front
of bwrap that moves itself, then execs), so everything the run forks is counted; the cgroup
charges tmpfs pages too, so files the run writes count against its memory. When a run ends, the
remaining processes of its cgroup are killed and the cgroup is removed. A process that dies
mid-run leaves its runs' empty cgroups behind; the next process to create one removes them.

Only cgroup v1 with writable memory and pids controllers (root) is supported; `unavailable()`
says why not otherwise (cgroup v2 delegation is not implemented yet).
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import os
import secrets
import signal
from dataclasses import dataclass
from pathlib import Path

from astraflow.errors import SandboxError

ROOT = Path("/sys/fs/cgroup")
PARENT = "astraflow-sandbox"
_MIB = 1024 * 1024
_counter = itertools.count()
# bwrap's outer process and the pid-1 reaper it starts in the new pid namespace, besides the run's own
BWRAP_PROCESSES = 2


def unavailable(root: Path = ROOT) -> str | None:
    """Why per-run cgroups cannot be made here, or None when they can."""
    for controller in ("memory", "pids"):
        base = root / controller
        if not (base / "cgroup.procs").is_file():
            return f"no cgroup v1 {controller} controller at {base}"
        if not os.access(base, os.W_OK):
            return f"cgroup v1 {controller} controller at {base} is not writable (run as root)"
    return None


def _write(path: Path, value: str | int) -> None:
    try:
        path.write_text(str(value))
    except OSError as exc:
        raise SandboxError(f"sandbox cgroup: cannot write {value} to {path}: {exc}") from exc


def _set_memory(directory: Path, mb: int) -> None:
    """Limits memory, and memory plus swap where swap is accounted, to `mb`."""
    limit = mb * _MIB
    memsw = directory / "memory.memsw.limit_in_bytes"
    if memsw.exists():
        _write(memsw, -1)  # memsw may never be below the memory limit: lift it first
    _write(directory / "memory.limit_in_bytes", limit)
    if memsw.exists():
        _write(memsw, limit)


@dataclass(slots=True)
class RunCgroup:
    """The memory and pids cgroups of one run."""

    memory: Path  # the run's directory in the memory hierarchy
    pids: Path  # the run's directory in the pids hierarchy

    @property
    def procs_files(self) -> tuple[str, str]:
        return str(self.memory / "cgroup.procs"), str(self.pids / "cgroup.procs")

    def oom_killed(self) -> bool:
        """Whether the kernel killed a process of this run for exceeding its memory."""
        with contextlib.suppress(OSError):
            for line in (self.memory / "memory.oom_control").read_text().splitlines():
                if line.startswith("oom_kill "):
                    return int(line.split()[1]) > 0
        return False

    def _kill_all(self) -> bool:
        """SIGKILLs every process left in the run; whether any was left."""
        left = False
        for directory in (self.memory, self.pids):
            with contextlib.suppress(OSError):
                for pid in (directory / "cgroup.procs").read_text().split():
                    left = True
                    with contextlib.suppress(ProcessLookupError):
                        os.kill(int(pid), signal.SIGKILL)
        return left

    async def remove(self) -> None:
        """Kills what is left of the run and removes its cgroups (retried while they empty)."""
        for _ in range(200):
            self._kill_all()
            for directory in (self.memory, self.pids):
                with contextlib.suppress(FileNotFoundError, OSError):
                    directory.rmdir()
            if not self.memory.exists() and not self.pids.exists():
                return
            await asyncio.sleep(0.01)


def _remove_stale(parent: Path) -> None:
    """Removes empty run cgroups left by processes that died mid-run (named by their pid)."""
    with contextlib.suppress(OSError):
        for child in parent.iterdir():
            pid = child.name.split("-", 1)[0]
            if not child.is_dir() or not pid.isdigit() or Path(f"/proc/{pid}").exists():
                continue
            with contextlib.suppress(OSError):
                if not (child / "cgroup.procs").read_text().strip():
                    child.rmdir()


def create(
    memory_mb: int, nproc: int, total_memory_mb: int, parent: str = PARENT, root: Path = ROOT
) -> RunCgroup:
    """A fresh cgroup pair for one run, under `parent` (whose total limit is set too)."""
    n = next(_counter)
    name = f"{os.getpid()}-{n}-{secrets.token_hex(4)}"
    parents = {c: root / c / parent for c in ("memory", "pids")}
    for directory in parents.values():
        directory.mkdir(exist_ok=True)
        if n % 100 == 0:  # at a process's first run, and now and then
            _remove_stale(directory)
    current = (parents["memory"] / "memory.limit_in_bytes").read_text().strip()
    if current != str(total_memory_mb * _MIB):
        _set_memory(parents["memory"], total_memory_mb)
    run = RunCgroup(parents["memory"] / name, parents["pids"] / name)
    try:
        run.memory.mkdir()
        run.pids.mkdir()
        _set_memory(run.memory, memory_mb)
        _write(run.pids / "pids.max", nproc + BWRAP_PROCESSES)
    except (OSError, SandboxError) as exc:
        for directory in (run.memory, run.pids):
            with contextlib.suppress(OSError):
                directory.rmdir()
        raise SandboxError(f"sandbox cgroup: cannot create {name}: {exc}") from exc
    return run


def enter_argv(run: RunCgroup, argv: list[str]) -> list[str]:
    """`argv` behind a shell that first moves itself into the run's cgroups (then execs it)."""
    script = 'echo $$ > "$1" && echo $$ > "$2" && shift 2 && exec "$@"'
    return ["/bin/sh", "-c", script, "sh", *run.procs_files, *argv]
