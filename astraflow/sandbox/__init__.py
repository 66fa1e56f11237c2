"""Sandbox for untrusted Python (model output): bubblewrap, seccomp and cgroups around each run.

    result = run_python("print(add(1, 2))", files={"solution.py": src}, limits=SandboxLimits(wall_s=5))
    result = await run_python_async(code, limits=...)

Every run gets a fresh private working directory, stdin at EOF, an environment with nothing from
the parent (PATH, HOME, LANG and single-thread settings only), `python -I` (no user site, no
PYTHON* variables, script directory first on sys.path), and these limits on every process it
creates: RLIMIT_CPU, RLIMIT_AS, RLIMIT_FSIZE, RLIMIT_NOFILE, no core files. A wall-clock timeout
kills the whole tree. Output is bounded (head and tail kept).

**bwrap** (the only mode unless the operator opts out, see below), what a run cannot do:
  * reach any network: an empty network namespace, and seccomp refuses every socket family but
    AF_UNIX (no IP, netlink, packet);
  * see or write the host's files: the root is a new tmpfs holding /usr, the interpreter's
    installation (read-only) and a private /tmp of `disk_mb` that vanishes with the run; no
    /etc beyond the loader cache, no /root, /home, /work, virtualenvs or secrets;
  * see or signal other processes: its own pid namespace; a uid of its own in its own user
    namespace, without capabilities; no further user namespaces (`--disable-userns`);
  * use the kernel's riskier interfaces: seccomp refuses ptrace, mount, unshare/setns, keyctl,
    bpf, perf_event_open, kexec, module loading, io_uring and more (`astraflow.sandbox.seccomp`);
  * outlive the run: bwrap dies with its parent, and the pid namespace with bwrap; what is left
    in the run's cgroup is killed;
  * use more than `memory_mb` (its processes and /tmp together, swap included), `nproc`
    processes or threads, or, with every other run of the machine, `total_memory_mb`
    (the memory and pids controllers of cgroup v1 or v2).
  Not covered: kernel exploits (this is not a VM or gVisor); CPU time is per process.

**process** (only with `allow_weak_isolation`, where bwrap, user namespaces, seccomp or the
cgroups are missing): a new session, the rlimits, an empty environment, the same seccomp filter
(loaded by the interpreter itself before the code runs: no network but AF_UNIX, none of the
refused calls), and as root a uid of its own; the filesystem is whatever that user may read or
write, and a non-root user's code can signal the processes of that user. Without that setting such a machine raises `SandboxUnavailableError` saying
what to install, instead of running the code with less isolation than promised.
"""

from astraflow.sandbox.isolation import resolve_mode, unavailable_reason
from astraflow.sandbox.runner import run_python, run_python_async
from astraflow.sandbox.settings import SandboxSettings, current_settings
from astraflow.sandbox.types import SandboxLimits, SandboxResult

__all__ = [
    "SandboxLimits",
    "SandboxResult",
    "SandboxSettings",
    "current_settings",
    "resolve_mode",
    "run_python",
    "run_python_async",
    "unavailable_reason",
]
