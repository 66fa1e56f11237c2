"""How a sandbox run is launched: which isolation this machine allows, and the command for each.

Two modes:

* **namespaces** (root and a working `unshare`): fresh mount, network, pid, ipc and uts
  namespaces; the init script (`_nsinit.py`) makes the filesystem read-only, gives the run a
  private size-capped tmpfs as /tmp, and drops to a uid of its own before the untrusted code
  runs. Killing `unshare`'s process group kills the namespace's init, and with it every process
  of the run, whatever sessions or groups they made.
* **process** (anywhere else): a new session, the resource limits, an empty environment and a
  socket-refusing audit hook; the uid is dropped only when running as root and the interpreter
  is reachable by other users. See `astraflow.sandbox` for what each mode guarantees.
"""

from __future__ import annotations

import functools
import json
import os
import secrets
import shutil
import subprocess
import sys
from dataclasses import dataclass, field
from pathlib import Path

from astraflow.errors import SandboxError
from astraflow.sandbox.types import SandboxLimits

_HERE = Path(__file__).parent
PRELUDE_SOURCE = (_HERE / "_prelude.py").read_text()
NSINIT_SOURCE = (_HERE / "_nsinit.py").read_text()
UNSHARE_FLAGS = ("--mount", "--net", "--pid", "--ipc", "--uts", "--fork", "--kill-child")
SANDBOX_UIDS = (1_000_000, 2_000_000)  # each run gets its own uid from this range (no passwd entry)
MAIN_SCRIPT = "main.py"


@dataclass(slots=True)
class Launch:
    """Everything `create_subprocess_exec` needs for one run."""

    argv: list[str]  # command line
    env: dict[str, str]  # the whole environment of the launched process
    cwd: str  # working directory of the launched process
    mode: str  # "namespaces" or "process"
    user: int | None = None  # uid/gid to switch to before exec (process mode as root)
    pass_fds: tuple[int, ...] = field(default=())  # the status pipe (namespace mode)


@functools.cache
def namespaces_available() -> bool:
    """Whether this process may create the namespaces the strict mode needs (probed once)."""
    unshare = shutil.which("unshare")
    if sys.platform != "linux" or os.geteuid() != 0 or unshare is None:
        return False
    try:
        probe = subprocess.run(
            [unshare, *UNSHARE_FLAGS, "--", "true"], env={}, capture_output=True, timeout=10, check=False
        )
    except (OSError, subprocess.TimeoutExpired):
        return False
    return probe.returncode == 0


def resolve_mode(limits: SandboxLimits) -> str:
    """The isolation a run with `limits` gets here; raises if `namespaces` is demanded but missing."""
    if limits.isolation == "process":
        return "process"
    if namespaces_available():
        return "namespaces"
    if limits.isolation == "namespaces":
        raise SandboxError(
            "namespace isolation is not available here (it needs Linux, root and a working `unshare`); "
            "run as root, or set isolation='process' to accept weaker containment"
        )
    return "process"


def interpreter(limits: SandboxLimits) -> tuple[str, str]:
    """(interpreter path, installation prefix to expose) for the untrusted code."""
    if limits.python is None:
        return os.path.realpath(sys._base_executable), sys.base_prefix  # type: ignore[attr-defined]
    real = os.path.realpath(limits.python)
    return real, str(Path(real).parent.parent)


def rlimits(limits: SandboxLimits) -> list[tuple[str, int, int]]:
    """(resource name, soft, hard) triples the prelude applies to itself."""
    mib = 1024 * 1024
    return [
        ("RLIMIT_CPU", limits.cpu_s, limits.cpu_s + 1),
        ("RLIMIT_AS", limits.memory_mb * mib, limits.memory_mb * mib),
        ("RLIMIT_FSIZE", limits.file_size_mb * mib, limits.file_size_mb * mib),
        ("RLIMIT_NPROC", limits.nproc, limits.nproc),
        ("RLIMIT_NOFILE", limits.nofile, limits.nofile),
        ("RLIMIT_CORE", 0, 0),
    ]


def sandbox_env(home: str) -> dict[str, str]:
    """The complete environment of the untrusted code: nothing inherited from the parent."""
    return {
        "PATH": "/usr/local/bin:/usr/bin:/bin",
        "HOME": home,
        "LANG": "C.UTF-8",
        # thread pools count against RLIMIT_NPROC: keep numeric libraries single-threaded
        "OMP_NUM_THREADS": "1",
        "OPENBLAS_NUM_THREADS": "1",
        "MKL_NUM_THREADS": "1",
    }


def user_argv(python: str, limits: SandboxLimits, args: list[str]) -> list[str]:
    """Command line of the untrusted interpreter: isolated mode, prelude, then the script."""
    cfg = json.dumps({"rlimits": rlimits(limits)})
    return [python, "-I", "-c", PRELUDE_SOURCE, cfg, MAIN_SCRIPT, *args]


def others_can_reach(path: str) -> bool:
    """Whether a user with no special rights can traverse to and read `path`."""
    p = Path(path).resolve()
    dirs_ok = all(os.stat(d).st_mode & 0o001 for d in p.parents)
    return bool(dirs_ok and os.stat(p).st_mode & 0o005 == 0o005)


def new_uid() -> int:
    """A uid of the sandbox range; own per run, so RLIMIT_NPROC counts only this run's processes."""
    low, high = SANDBOX_UIDS
    return low + secrets.randbelow(high - low)


def build_launch(limits: SandboxLimits, workdir: str, args: list[str], status_fd: int | None) -> Launch:
    """The command that runs `workdir/main.py` under `limits` with the mode this machine allows."""
    mode = resolve_mode(limits)
    python, prefix = interpreter(limits)
    if mode == "namespaces":
        if status_fd is None:
            raise SandboxError("namespace mode needs a status pipe")
        uid = new_uid()
        cfg = {
            "uid": uid,
            "workdir": workdir,
            "disk_mb": limits.disk_mb,
            "expose": [prefix],
            "python": python,
            "argv": user_argv(python, limits, args),
            "env": sandbox_env("/tmp"),
            "status_fd": status_fd,
        }
        unshare = shutil.which("unshare") or "unshare"
        argv = [unshare, *UNSHARE_FLAGS, "--", python, "-I", "-S", "-c", NSINIT_SOURCE, json.dumps(cfg)]
        return Launch(argv, {}, "/", mode, pass_fds=(status_fd,))
    user = None
    if os.geteuid() == 0 and others_can_reach(python) and others_can_reach(prefix):
        user = new_uid()
    return Launch(user_argv(python, limits, args), sandbox_env(workdir), workdir, mode, user=user)
