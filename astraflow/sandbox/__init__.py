"""Sandbox for untrusted Python (model output): a separate process tree with limits, no network.

    result = run_python("print(add(1, 2))", files={"solution.py": src}, limits=SandboxLimits(wall_s=5))
    result = await run_python_async(code, limits=...)

Every run gets a fresh temporary working directory (deleted afterwards), stdin at EOF, an
environment with nothing from the parent (PATH, HOME, LANG and single-thread settings only),
`python -I` (no user site, no PYTHON* variables, script directory first on sys.path), and these
limits on every process it creates: RLIMIT_CPU, RLIMIT_AS, RLIMIT_FSIZE, RLIMIT_NPROC,
RLIMIT_NOFILE, no core files. A wall-clock timeout kills the whole tree. Output is bounded.

What is guaranteed depends on the mode (`SandboxResult.isolation` says which one ran):

**namespaces** (root and a working `unshare`, the default where available):
  * no network: an empty network namespace (only a down loopback); nothing reaches any host,
    this one included, whatever the code uses (sockets, ctypes, subprocesses);
  * filesystem: every mount is read-only; /tmp (the working directory) and /dev/shm are private
    size-capped tmpfs that vanish with the run; directories the interpreter needs under a
    private home (e.g. /root) are shown alone, the rest of that home is hidden;
  * processes: a pid namespace (only its own processes are visible in /proc) and a uid of its
    own, not root, without capabilities and with no_new_privs, so RLIMIT_NPROC caps a fork bomb
    at `nproc` processes and it cannot signal anything outside; killing the run kills the
    namespace's init, and the kernel then kills every process of it, including ones that
    called setsid();
  * not covered: the files every user may read stay readable (e.g. /etc, the repository
    source); memory is an address-space limit per process (no cgroup), so `nproc * memory_mb`
    bounds the total; CPU time is per process; kernel exploits are out of scope (this is not
    a VM or gVisor).

**process** (anywhere else):
  * a new session and process group, killed on timeout; processes that leave the group with
    setsid() can outlive the run;
  * no network only against Python's socket module (an audit hook); ctypes or another program
    can bypass it;
  * RLIMIT_NPROC counts every process of the user: as root it does not apply at all, unless the
    interpreter is readable by other users, in which case the run drops to a uid of its own;
  * the filesystem is whatever that user may write; only the working directory is fresh.
  Prefer namespaces wherever untrusted code runs in production.
"""

from astraflow.sandbox.isolation import namespaces_available, resolve_mode
from astraflow.sandbox.runner import run_python, run_python_async
from astraflow.sandbox.types import SandboxLimits, SandboxResult

__all__ = [
    "SandboxLimits",
    "SandboxResult",
    "namespaces_available",
    "resolve_mode",
    "run_python",
    "run_python_async",
]
