"""How a sandbox run is launched: which isolation this machine allows, and the command for it.

Two modes (`SandboxResult.isolation` says which one ran):

* **bwrap** (required unless the operator allows weak isolation): bubblewrap starts the code in
  fresh user, pid, network, ipc, uts and cgroup namespaces on a new root holding only /usr, the
  interpreter's installation (read-only) and a private size-capped /tmp; `--disable-userns`, the
  seccomp filter of `astraflow.sandbox.seccomp`, and the run's memory and pids cgroups
  (`astraflow.sandbox.cgroups`) surround it. As root, bwrap itself runs as a host uid of its own
  per run (`unprivileged_argv`), so the code's uid 1000 is that unprivileged uid outside its
  namespace, never host uid 0.
* **process** (only with `allow_weak_isolation`, where bwrap cannot run): a new session, the
  resource limits, an empty environment and the same seccomp filter (loaded by the prelude); as root, the code runs
  under a uid of its own, and where that is impossible (an interpreter other users cannot read)
  it refuses: weak isolation never means running untrusted code as root.

Where bwrap is demanded but cannot run, `resolve_mode` raises `SandboxUnavailableError` with the
reason and the two ways out (install it, or allow the weak mode).
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

from astraflow.errors import SandboxUnavailableError
from astraflow.sandbox import cgroups, seccomp
from astraflow.sandbox.settings import SandboxSettings
from astraflow.sandbox.types import SandboxLimits

_HERE = Path(__file__).parent
PRELUDE_SOURCE = (_HERE / "_prelude.py").read_text()
SANDBOX_UIDS = (1_000_000, 2_000_000)  # as root: the host uid of each run, its own
SANDBOX_UID = 1000  # the uid the code sees inside the user namespace
MAIN_SCRIPT = "main.py"
WORKDIR = "/tmp"  # the run's private working directory inside bwrap
# bwrap's namespaces and process handling; the filesystem and limits are added per run
BWRAP_FLAGS = (
    "--unshare-user", "--unshare-pid", "--unshare-net", "--unshare-ipc", "--unshare-uts",
    "--unshare-cgroup-try", "--disable-userns", "--uid", str(SANDBOX_UID), "--gid", str(SANDBOX_UID),
    "--hostname", "sandbox", "--die-with-parent", "--new-session", "--cap-drop", "ALL", "--clearenv",
)  # fmt: skip
HOW_TO_FIX = (
    "install bubblewrap (`bash scripts/system-deps.sh` as root, or `apt-get install bubblewrap`) "
    "on Linux with user namespaces, seccomp and the cgroup memory and pids controllers, and run "
    "as root; or set ASTRAFLOW__SANDBOX__ALLOW_WEAK_ISOLATION=true (config sandbox.allow_weak_isolation) "
    "to accept resource limits without namespaces, seccomp or cgroups"
)


@dataclass(slots=True)
class Launch:
    """Everything `create_subprocess_exec` needs for one run."""

    argv: list[str]  # command line
    env: dict[str, str]  # the whole environment of the launched process
    cwd: str  # working directory of the launched process
    mode: str  # "bwrap" or "process"
    user: int | None = None  # uid/gid to switch to before exec (process mode as root)
    pass_fds: tuple[int, ...] = field(default=())  # descriptors the launched process keeps


def interpreter(settings: SandboxSettings) -> tuple[str, str]:
    """(interpreter path, installation prefix to expose) for the untrusted code."""
    if settings.python is None:
        return os.path.realpath(sys._base_executable), os.path.realpath(sys.base_prefix)  # type: ignore[attr-defined]
    real = os.path.realpath(shutil.which(settings.python) or settings.python)
    return real, str(Path(real).parent.parent)


def root_binds(prefix: str) -> list[str]:
    """bwrap arguments that build the read-only root: /usr, its links, the interpreter's prefix."""
    args = ["--ro-bind", "/usr", "/usr"]
    for top in ("/bin", "/sbin", "/lib", "/lib32", "/lib64", "/libx32"):
        if os.path.islink(top):
            args += ["--symlink", os.readlink(top), top]
        elif os.path.isdir(top):
            args += ["--ro-bind", top, top]
    if os.path.exists("/etc/ld.so.cache"):
        args += ["--ro-bind", "/etc/ld.so.cache", "/etc/ld.so.cache"]
    if prefix != "/usr" and not prefix.startswith("/usr/"):
        args += ["--ro-bind", prefix, prefix]
    return [*args, "--proc", "/proc", "--dev", "/dev"]


def bwrap_path(settings: SandboxSettings) -> str | None:
    return shutil.which(settings.bwrap)


def unprivileged_argv(bwrap: str, prefix: str, uid: int) -> list[str]:
    """What runs the sandbox's bwrap as host uid `uid` when we are root (so the code's uid 1000
    inside its user namespace is `uid` outside, not 0).

    An unprivileged bwrap can bind only what that uid can reach, and the interpreter often lives
    where it cannot (a pyenv or venv under /root, mode 0700). So a first bwrap, as root, builds a
    view holding /usr, the loader cache and the interpreter's prefix under directories every user
    may traverse (`--perms 0755 --dir`), the host's /proc (a new procfs inside a user namespace
    needs a fully visible one) and a /tmp for bwrap's own new root; `setpriv` then drops to `uid`
    (no supplementary groups) and execs the sandbox's bwrap in that view."""
    setpriv = shutil.which("setpriv") or "setpriv"
    # --unshare-pid: the inner bwrap drops its parent-death signal when it changes credentials, and
    # outlived a SIGKILLed host (1 run in 5, reparented to init); in a pid namespace of its own, the
    # kernel kills it with the namespace's init, which dies with the outer bwrap, which dies with the host.
    argv = [bwrap, "--unshare-pid", "--ro-bind", "/usr", "/usr"]
    for top in ("/bin", "/sbin", "/lib", "/lib32", "/lib64", "/libx32"):
        if os.path.islink(top):
            argv += ["--symlink", os.readlink(top), top]
        elif os.path.isdir(top):
            argv += ["--ro-bind", top, top]
    binds = ["/etc/ld.so.cache"] if os.path.exists("/etc/ld.so.cache") else []
    if prefix != "/usr" and not prefix.startswith("/usr/"):
        binds.append(prefix)
    for path in binds:  # bwrap makes missing parents 0700: make them 0755 first, outermost first
        for parent in reversed(Path(path).parents[:-1]):
            argv += ["--perms", "0755", "--dir", str(parent)]
        argv += ["--ro-bind", path, path]
    argv += ["--bind", "/proc", "/proc", "--dev", "/dev", "--tmpfs", "/tmp", "--die-with-parent", "--"]
    return [*argv, setpriv, f"--reuid={uid}", f"--regid={uid}", "--clear-groups", "--"]


def bwrap_argv(
    bwrap: str, prefix: str, limits: SandboxLimits, inner: list[str], *, seccomp_fd: int, status_fd: int,
    files: list[str], host_uid: int | None = None,
) -> list[str]:
    """The bwrap command line that runs `inner` under `limits`, with the interpreter installed at
    `prefix`; `files` are `--file FD DEST` pairs. With `host_uid` (we are root), bwrap runs as
    that uid (`unprivileged_argv`)."""
    outer = [] if host_uid is None else unprivileged_argv(bwrap, prefix, host_uid)
    argv = [*outer, bwrap, *BWRAP_FLAGS, *root_binds(prefix)]
    argv += ["--size", str(limits.disk_mb * 1024 * 1024), "--tmpfs", WORKDIR]
    argv += ["--size", str(1024 * 1024), "--tmpfs", "/dev/shm"]
    for var, value in sandbox_env(WORKDIR).items():
        argv += ["--setenv", var, value]
    argv += files
    argv += ["--chdir", WORKDIR, "--seccomp", str(seccomp_fd), "--json-status-fd", str(status_fd), "--"]
    return argv + inner


def _probe(bwrap: str, python: str, prefix: str) -> str | None:
    """Why bwrap cannot run a sandboxed `python -c pass` here, or None when it can."""
    r, w = os.pipe()
    try:
        os.write(w, seccomp.build_filter())
        os.close(w)
        w = -1
        inner = [python, "-I", "-c", "pass"]
        argv = bwrap_argv(bwrap, prefix, SandboxLimits(), inner, seccomp_fd=r, status_fd=2, files=[],
                          host_uid=new_uid() if os.geteuid() == 0 else None)
        try:
            done = subprocess.run(argv, env={}, capture_output=True, timeout=20, check=False, pass_fds=(r,))
        except (OSError, subprocess.TimeoutExpired) as exc:
            return f"{bwrap} did not run: {exc}"
        if done.returncode != 0:
            detail = done.stderr.decode(errors="replace").strip().splitlines()
            return f"{bwrap} failed ({done.returncode}): {detail[0] if detail else 'no message'}"
        return None
    finally:
        os.close(r)
        if w >= 0:
            os.close(w)


@functools.cache
def _bwrap_unavailable(bwrap: str | None, python: str, prefix: str) -> str | None:
    if sys.platform != "linux":
        return "bubblewrap needs Linux"
    if bwrap is None:
        return "bubblewrap (bwrap) is not installed"
    if os.geteuid() == 0 and shutil.which("setpriv") is None:
        return "setpriv (util-linux) is not installed: as root, the sandbox needs it to run code as an unprivileged uid"
    if not seccomp.supported():
        return f"no seccomp filter for this architecture ({', '.join(seccomp.ARCHES)} have one)"
    reason = cgroups.unavailable()
    if reason is not None:
        return reason
    return _probe(bwrap, python, prefix)


def unavailable_reason(settings: SandboxSettings) -> str | None:
    """Why the bwrap mode cannot run here (probed once per binary and interpreter), or None."""
    python, prefix = interpreter(settings)
    return _bwrap_unavailable(bwrap_path(settings), python, prefix)


def resolve_mode(settings: SandboxSettings) -> str:
    """"bwrap", or "process" where bwrap cannot run and weak isolation is allowed; else raises."""
    reason = unavailable_reason(settings)
    if reason is None:
        return "bwrap"
    if not settings.allow_weak_isolation:
        raise SandboxUnavailableError(f"the sandbox refuses to run untrusted code: {reason}. To fix: {HOW_TO_FIX}")
    python, prefix = interpreter(settings)
    if os.geteuid() == 0 and not (others_can_reach(python) and others_can_reach(prefix)):
        raise SandboxUnavailableError(
            f"the sandbox refuses to run untrusted code: {reason}, and in the weak mode the code would run "
            f"as root, because other users cannot read the interpreter {python}. To fix: install bubblewrap "
            "(`bash scripts/system-deps.sh`), or set ASTRAFLOW__SANDBOX__PYTHON to an interpreter every user "
            "can read (e.g. /usr/bin/python3), or run as an unprivileged user"
        )
    return "process"


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
        # thread pools count against the process limit: keep numeric libraries single-threaded
        "OMP_NUM_THREADS": "1",
        "OPENBLAS_NUM_THREADS": "1",
        "MKL_NUM_THREADS": "1",
    }


def user_argv(python: str, limits: SandboxLimits, args: list[str], *, load_seccomp: bool = False) -> list[str]:
    """Command line of the untrusted interpreter: isolated mode, prelude, then the script; the
    prelude loads the seccomp filter itself when `load_seccomp` (the weak mode: no bwrap to do it)."""
    cfg: dict = {"rlimits": rlimits(limits)}
    if load_seccomp:
        cfg["seccomp"] = seccomp.build_filter().hex()
    return [python, "-I", "-c", PRELUDE_SOURCE, json.dumps(cfg), MAIN_SCRIPT, *args]


def others_can_reach(path: str) -> bool:
    """Whether a user with no special rights can traverse to and read `path`."""
    p = Path(path).resolve()
    dirs_ok = all(os.stat(d).st_mode & 0o001 for d in p.parents)
    return bool(dirs_ok and os.stat(p).st_mode & 0o005 == 0o005)


def new_uid() -> int:
    """A uid of the sandbox range; own per run, so RLIMIT_NPROC counts only this run's processes."""
    low, high = SANDBOX_UIDS
    return low + secrets.randbelow(high - low)


def process_launch(
    settings: SandboxSettings, limits: SandboxLimits, workdir: str, args: list[str], pass_fds: tuple[int, ...]
) -> Launch:
    """The weak mode's command: the interpreter in `workdir`, as root under a uid of its own
    (`resolve_mode` has checked that this uid can read the interpreter)."""
    python, _prefix = interpreter(settings)
    user = new_uid() if os.geteuid() == 0 else None
    argv = user_argv(python, limits, args, load_seccomp=seccomp.supported())
    return Launch(argv, sandbox_env(workdir), workdir, "process", user=user, pass_fds=pass_fds)


def _memfd(name: str, data: bytes) -> int:
    fd = os.memfd_create(name, 0)
    os.write(fd, data)
    os.lseek(fd, 0, os.SEEK_SET)
    return fd


def bwrap_launch(
    settings: SandboxSettings,
    limits: SandboxLimits,
    files: dict[str, bytes],
    args: list[str],
    status_fd: int,
    cgroup: cgroups.RunCgroup,
    pass_fds: tuple[int, ...],
) -> tuple[Launch, list[int]]:
    """The bwrap mode's command, and the descriptors to close once it has started.

    `files` (relative path -> content, already checked) are copied into the private /tmp by
    bwrap itself from memory files, so nothing of the run ever touches the host's disk.
    """
    python, prefix = interpreter(settings)
    bwrap = bwrap_path(settings) or settings.bwrap
    owned: list[int] = []
    file_args: list[str] = []
    made: set[str] = set()
    for rel, content in files.items():
        parts = rel.split("/")
        for i in range(1, len(parts)):
            d = "/".join(parts[:i])
            if d not in made:
                made.add(d)
                file_args += ["--dir", f"{WORKDIR}/{d}"]
        fd = _memfd("sandbox-file", content)
        owned.append(fd)
        file_args += ["--perms", "0644", "--file", str(fd), f"{WORKDIR}/{rel}"]
    seccomp_fd = _memfd("sandbox-seccomp", seccomp.build_filter())
    owned.append(seccomp_fd)
    inner = user_argv(python, limits, args)
    argv = bwrap_argv(bwrap, prefix, limits, inner, seccomp_fd=seccomp_fd, status_fd=status_fd, files=file_args,
                      host_uid=new_uid() if os.geteuid() == 0 else None)
    launch = Launch(cgroups.enter_argv(cgroup, argv), {}, "/", "bwrap", pass_fds=(*owned, status_fd, *pass_fds))
    return launch, owned
