"""What a sandbox run is given (`SandboxLimits`) and what it returns (`SandboxResult`)."""

from __future__ import annotations

import signal as _signal
from dataclasses import dataclass


@dataclass(frozen=True, slots=True)
class SandboxLimits:
    """Resource limits of one run; the defaults suit a unit-test reward (isolation is the operator's: `SandboxSettings`)."""

    wall_s: float = 10.0  # wall-clock timeout; then the whole process tree is killed
    cpu_s: int = 5  # RLIMIT_CPU per process (SIGXCPU at the limit, SIGKILL one second later)
    memory_mb: int = 512  # memory of the whole run (cgroup), and RLIMIT_AS of each process
    file_size_mb: int = 16  # RLIMIT_FSIZE: largest file a process may write
    disk_mb: int = 64  # size of the private /tmp working directory (bwrap mode; counts as memory)
    nproc: int = 32  # processes and threads of the run (pids cgroup; RLIMIT_NPROC in process mode)
    nofile: int = 256  # RLIMIT_NOFILE: open file descriptors per process
    max_output_bytes: int = 64 * 1024  # stdout and stderr are each cut to this (head and tail kept)


@dataclass(frozen=True, slots=True)
class SandboxResult:
    """How a run ended. `ok` is true only for exit code 0 within every limit."""

    ok: bool  # exit code 0, no signal, no timeout
    exit_code: int | None  # None when the process died of a signal (or was killed on timeout)
    signal: int | None  # the signal that ended it (SIGKILL after a timeout)
    stdout: str  # decoded (UTF-8, replacement on errors), cut to max_output_bytes
    stderr: str  # likewise
    stdout_truncated: bool  # whether stdout was cut
    stderr_truncated: bool  # whether stderr was cut
    timed_out: bool  # the wall-clock timeout fired
    killed_reason: str | None  # timeout | cpu | memory | file_size | signal:<NAME>; None if none applies
    duration_s: float  # wall-clock seconds from spawn to exit
    isolation: str  # "bwrap" or "process": what actually contained this run


def killed_reason(
    *, timed_out: bool, exit_code: int | None, signal: int | None, stderr_tail: str
) -> str | None:
    """Names the limit that ended a run, from its exit status and the end of its stderr.

    `memory` and `file_size` are read from Python's own error messages (MemoryError, EFBIG),
    so they are a best effort: code that catches those errors and exits 1 reads as a failure
    without a reason.
    """
    if timed_out:
        return "timeout"
    if signal == _signal.SIGXCPU:
        return "cpu"
    if signal == _signal.SIGXFSZ:
        return "file_size"
    if signal is not None:
        try:
            return f"signal:{_signal.Signals(signal).name}"
        except ValueError:
            return f"signal:{signal}"
    if exit_code and "MemoryError" in stderr_tail:
        return "memory"
    if exit_code and "File too large" in stderr_tail:
        return "file_size"
    return None
