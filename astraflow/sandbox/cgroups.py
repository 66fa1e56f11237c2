"""Memory and process-count bounds of sandbox runs, per run and in total (cgroup v1 or v2).

Layout (v1: in both the memory and the pids hierarchy; v2: once, in the unified one):

    /sys/fs/cgroup[/memory|/pids]/astraflow-sandbox/   memory: `total_memory_mb` for all runs
        <pid>-<n>-<random>/                            one per run: memory `memory_mb` (no swap
                                                       beyond it), pids `nproc` (+ bwrap's three)

(`SandboxSettings.cgroup_parent` names the parent.) A run's processes enter its cgroup before
the sandbox starts (`enter_argv` puts a shell in front of bwrap that moves itself, then execs),
so everything the run forks is counted; the cgroup charges tmpfs pages too, so files the run
writes count against its memory. When a run ends, the remaining processes of its cgroup are
killed and the cgroup is removed. A process that dies mid-run leaves its runs' empty cgroups
behind; the next process to create one removes them.

Needs root (or a delegated, writable hierarchy); `unavailable()` says why not otherwise. On v2
the parent sits at the top of the hierarchy, which must offer the memory and pids controllers
(a container's own cgroup namespace usually does not let us create one there).
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
CONTROLLERS = ("memory", "pids")
_MIB = 1024 * 1024
_counter = itertools.count()
# bwrap's outer process and the pid-1 reaper it starts in the new pid namespace, besides the run's own;
# as root, also the bwrap that drops to the run's unprivileged uid (`isolation.unprivileged_argv`)
BWRAP_PROCESSES = 3


def version(root: Path = ROOT) -> int:
    """2 for a unified hierarchy at `root`, else 1."""
    return 2 if (root / "cgroup.controllers").is_file() else 1


def unavailable(root: Path = ROOT) -> str | None:
    """Why per-run cgroups cannot be made here, or None when they can."""
    if version(root) == 2:
        offered = (root / "cgroup.controllers").read_text().split()
        missing = [c for c in CONTROLLERS if c not in offered]
        if missing:
            return f"the cgroup v2 hierarchy at {root} does not offer the {' and '.join(missing)} controller"
        if not os.access(root, os.W_OK):
            return f"the cgroup v2 hierarchy at {root} is not writable (run as root)"
        enabled = (root / "cgroup.subtree_control").read_text().split()
        if not all(c in enabled for c in CONTROLLERS):
            try:
                _write(root / "cgroup.subtree_control", " ".join(f"+{c}" for c in CONTROLLERS))
            except SandboxError as exc:  # e.g. the root of a container's namespace, which has processes
                return f"cannot enable the memory and pids controllers below {root}: {exc}"
        return None
    for controller in CONTROLLERS:
        base = root / controller
        if not (base / "cgroup.procs").is_file():
            return f"no cgroup v1 {controller} controller at {base}"
        if not os.access(base, os.W_OK):
            return f"the cgroup v1 {controller} controller at {base} is not writable (run as root)"
    return None


def _write(path: Path, value: str | int) -> None:
    try:
        path.write_text(str(value))
    except OSError as exc:
        raise SandboxError(f"sandbox cgroup: cannot write {value} to {path}: {exc}") from exc


def _set_memory(directory: Path, mb: int, v: int) -> None:
    """Limits memory to `mb`, with no swap beyond it where swap is accounted."""
    limit = mb * _MIB
    if v == 2:
        _write(directory / "memory.max", limit)
        if (directory / "memory.swap.max").exists():
            _write(directory / "memory.swap.max", 0)
        return
    memsw = directory / "memory.memsw.limit_in_bytes"
    if memsw.exists():
        _write(memsw, -1)  # memsw may never be below the memory limit: lift it first
    _write(directory / "memory.limit_in_bytes", limit)
    if memsw.exists():
        _write(memsw, limit)


@dataclass(slots=True)
class RunCgroup:
    """The cgroup directories of one run: the memory one first (v1: then pids; v2: one for both)."""

    dirs: tuple[Path, ...]
    v: int  # cgroup version

    @property
    def procs_files(self) -> list[str]:
        return [str(d / "cgroup.procs") for d in self.dirs]

    def oom_killed(self) -> bool:
        """Whether the kernel killed a process of this run for exceeding its memory."""
        events = self.dirs[0] / ("memory.events" if self.v == 2 else "memory.oom_control")
        with contextlib.suppress(OSError, ValueError):
            for line in events.read_text().splitlines():
                if line.startswith("oom_kill "):
                    return int(line.split()[1]) > 0
        return False

    def _kill_all(self) -> None:
        for directory in self.dirs:
            with contextlib.suppress(OSError):
                for pid in (directory / "cgroup.procs").read_text().split():
                    with contextlib.suppress(ProcessLookupError):
                        os.kill(int(pid), signal.SIGKILL)

    async def remove(self) -> None:
        """Kills what is left of the run and removes its cgroups (retried while they empty)."""
        for _ in range(200):
            self._kill_all()
            for directory in self.dirs:
                with contextlib.suppress(OSError):
                    directory.rmdir()
            if not any(directory.exists() for directory in self.dirs):
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


def _parents(root: Path, parent: str, total_memory_mb: int, v: int) -> tuple[Path, ...]:
    """The parent cgroup(s), made and limited to the total where needed (memory one first)."""
    if v == 2:
        parents: tuple[Path, ...] = (root / parent,)
        wanted = " ".join(f"+{c}" for c in CONTROLLERS)
        if not all(c in (root / "cgroup.subtree_control").read_text().split() for c in CONTROLLERS):
            _write(root / "cgroup.subtree_control", wanted)
        parents[0].mkdir(exist_ok=True)
        if not all(c in (parents[0] / "cgroup.subtree_control").read_text().split() for c in CONTROLLERS):
            _write(parents[0] / "cgroup.subtree_control", wanted)
        limit_file = "memory.max"
    else:
        parents = tuple(root / c / parent for c in CONTROLLERS)
        for directory in parents:
            directory.mkdir(exist_ok=True)
        limit_file = "memory.limit_in_bytes"
    if (parents[0] / limit_file).read_text().strip() != str(total_memory_mb * _MIB):
        _set_memory(parents[0], total_memory_mb, v)
    return parents


def create(
    memory_mb: int, nproc: int, total_memory_mb: int, parent: str = PARENT, root: Path = ROOT
) -> RunCgroup:
    """A fresh cgroup for one run, under `parent` (whose total limit is set too)."""
    v = version(root)
    n = next(_counter)
    name = f"{os.getpid()}-{n}-{secrets.token_hex(4)}"
    try:
        parents = _parents(root, parent, total_memory_mb, v)
    except OSError as exc:
        raise SandboxError(f"sandbox cgroup: cannot prepare {parent} under {root}: {exc}") from exc
    if n % 100 == 0:  # at a process's first run, and now and then
        for directory in parents:
            _remove_stale(directory)
    run = RunCgroup(tuple(p / name for p in parents), v)
    try:
        for directory in run.dirs:
            directory.mkdir()
        _set_memory(run.dirs[0], memory_mb, v)
        _write(run.dirs[-1] / "pids.max", nproc + BWRAP_PROCESSES)
    except (OSError, SandboxError) as exc:
        for directory in run.dirs:
            with contextlib.suppress(OSError):
                directory.rmdir()
        raise SandboxError(f"sandbox cgroup: cannot create {name}: {exc}") from exc
    return run


def enter_argv(run: RunCgroup, argv: list[str]) -> list[str]:
    """`argv` behind a shell that first moves itself into the run's cgroups (then execs it)."""
    script = 'while [ "$1" != -- ]; do echo $$ > "$1" || exit 125; shift; done; shift; exec "$@"'
    return ["/bin/sh", "-c", script, "sh", *run.procs_files, "--", *argv]
