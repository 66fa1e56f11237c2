"""Hardware of a given speed, simulated: a cgroup v1 CPU quota on one process (root only).

`CpuQuota(name, cpus)` creates `/sys/fs/cgroup/cpu/astraflow-<name>` with
`cpu.cfs_quota_us = cpus * cpu.cfs_period_us` (0.3: at most 30% of one core, however idle the
machine is) and a high `cpu.shares` (`SHARES`, 16 times a process's weight), so that the group also
gets its quota when the machine is loaded (a device of its own: as fast in a busy run as alone).
`add(pid)` moves a process into it (children it starts later inherit it; `add_tree`
moves a process and every descendant already started, such as a RaaS node's engine process, which
runs in a session and process group of its own), and
`remove()` moves whatever is left back to the root group and deletes the group. The benchmark
calls `remove()` in a `finally`, so no group outlives its run.
"""

from __future__ import annotations

import contextlib
from pathlib import Path

from astraflow.errors import AstraflowError

CPU_ROOT = Path("/sys/fs/cgroup/cpu")
SHARES = 16384  # cpu.shares of the group; a process of the root group weighs 1024


class CpuQuotaError(AstraflowError):
    """Raised when the cgroup v1 cpu controller is missing or not writable (run as root)."""


class CpuQuota:
    """One cgroup with a CPU quota; see the module doc."""

    def __init__(self, name: str, cpus: float) -> None:
        if not (CPU_ROOT / "cpu.cfs_quota_us").exists():
            raise CpuQuotaError(f"no cgroup v1 cpu controller at {CPU_ROOT}: slowed nodes need it (and root)")
        if not 0.01 <= cpus <= 64:
            raise CpuQuotaError(f"a CPU quota of {cpus} cores is out of range (0.01..64)")
        self.path = CPU_ROOT / f"astraflow-{name}"
        try:
            self.path.mkdir(exist_ok=True)
            period = int((self.path / "cpu.cfs_period_us").read_text())
            (self.path / "cpu.cfs_quota_us").write_text(str(int(cpus * period)))
            (self.path / "cpu.shares").write_text(str(SHARES))
        except OSError as exc:
            raise CpuQuotaError(f"cannot set up {self.path} ({exc}); run the benchmark as root") from exc
        self.cpus = cpus

    def add(self, pid: int) -> None:
        (self.path / "cgroup.procs").write_text(str(pid))

    def add_tree(self, pid: int) -> int:
        """Moves process `pid` and all its descendants into the group; returns how many."""
        children: dict[int, list[int]] = {}
        for stat in Path("/proc").glob("[0-9]*/stat"):
            with contextlib.suppress(OSError, ValueError, IndexError):
                fields = stat.read_text().rsplit(")", 1)[1].split()  # after the name: state, ppid, ...
                children.setdefault(int(fields[1]), []).append(int(stat.parent.name))
        moved, todo = 0, [pid]
        while todo:
            p = todo.pop()
            with contextlib.suppress(OSError):  # exited meanwhile
                self.add(p)
                moved += 1
            todo += children.get(p, [])
        return moved

    def throttled_s(self) -> float:
        """Time the group's processes were held back by the quota so far."""
        for line in (self.path / "cpu.stat").read_text().splitlines():
            key, _, value = line.partition(" ")
            if key == "throttled_time":
                return int(value) / 1e9
        return 0.0

    def remove(self) -> None:
        if not self.path.exists():
            return
        for pid in (self.path / "cgroup.procs").read_text().split():
            with contextlib.suppress(OSError):  # exited meanwhile
                (CPU_ROOT / "cgroup.procs").write_text(pid)
        self.path.rmdir()
