"""What bwrap mode adds, checked from inside a run: the filesystem it sees, the system calls
seccomp refuses, memory bounded per run (across processes and /tmp) and in total, and the
cleanup of cgroups that a dead process left. Skipped where bwrap mode is unavailable (the
refusal itself is tested in test_sandbox.py).
"""

from __future__ import annotations

import dataclasses
import os
import platform
import subprocess
import sys
import time
import uuid
from pathlib import Path

import pytest
from helpers import processes_with

from astraflow.sandbox import (
    SandboxLimits,
    SandboxSettings,
    cgroups,
    isolation,
    run_python,
    unavailable_reason,
)

STRICT = SandboxSettings()
BWRAP_MISSING = unavailable_reason(STRICT)
pytestmark = [
    pytest.mark.unit,
    pytest.mark.timeout(60),
    pytest.mark.skipif(BWRAP_MISSING is not None, reason=f"bwrap mode unavailable: {BWRAP_MISSING}"),
]
SMALL = SandboxLimits(wall_s=5, cpu_s=2, memory_mb=192, nproc=8, file_size_mb=1, disk_mb=8)
_with = dataclasses.replace


def cgroup_dirs(parent: str) -> list[Path]:
    """Where the cgroup `parent` lives: one directory per controller (v1), or one (v2)."""
    if cgroups.version() == 2:
        return [cgroups.ROOT / parent]
    return [cgroups.ROOT / c / parent for c in cgroups.CONTROLLERS]


def remove_cgroup(parent: str) -> None:
    """Removes a test's parent cgroup and its runs' (retried while their last processes exit)."""
    deadline = time.monotonic() + 5
    for directory in cgroup_dirs(parent):
        for path in [*directory.glob("*-*-*"), directory]:
            while path.is_dir():
                try:
                    path.rmdir()
                except OSError:
                    if time.monotonic() > deadline:
                        raise
                    time.sleep(0.05)


def test_bwrap_filesystem_holds_only_the_interpreter_and_a_private_tmp() -> None:
    secret_dir = Path.home()  # /root here: the venv, caches and credentials live below it
    code = (
        "import os, sys\n"
        "for path in sys.argv[1:]:\n"
        "    print(path, os.path.exists(path))\n"
        "print('root', sorted(os.listdir('/')))\n"
        "print('etc', sorted(os.listdir('/etc')))\n"
        "print('uid', os.getuid(), 'pids', sorted(int(p) for p in os.listdir('/proc') if p.isdigit()))\n"
        "try:\n"
        "    open('/usr/astraflow-escape', 'w')\n"
        "except OSError as e:\n"
        "    print('usr read-only', e.errno)\n"
    )
    repo = Path(__file__).resolve().parents[2]
    probes = [str(repo), str(secret_dir / ".cache"), sys.prefix, "/etc/passwd", "/var", "/home"]
    r = run_python(code, args=probes, limits=SMALL, settings=STRICT)
    assert r.ok, r.stderr
    for probe in probes:
        assert f"{probe} False" in r.stdout  # no repository, no venv, no caches, no /etc files
    assert "etc ['ld.so.cache']" in r.stdout
    assert "uid 1000 pids [1, 2]" in r.stdout  # bwrap's reaper and the run itself, nothing else
    assert "usr read-only 30" in r.stdout  # EROFS


SYSCALLS = """\
import ctypes, errno, socket
libc = ctypes.CDLL(None, use_errno=True)
def attempt(name, *args):
    rc = libc.syscall(*args)
    print(name, rc, errno.errorcode.get(ctypes.get_errno(), '-') if rc < 0 else 'ok', flush=True)
attempt('ptrace', 101, 0, 0, 0, 0)                 # PTRACE_TRACEME
attempt('mount', 165, b'none', b'/tmp', b'tmpfs', 0, 0)
attempt('unshare', 272, 0x10000000)                # CLONE_NEWUSER
attempt('setns', 308, 0, 0)
attempt('keyctl', 250, 0, 0, 0)
attempt('bpf', 321, 0, 0, 0)
attempt('perf_event_open', 298, 0, 0, -1, -1, 0)
attempt('kexec_load', 246, 0, 0, 0, 0)
attempt('init_module', 175, 0, 0, 0)
attempt('io_uring_setup', 425, 1, 0)
attempt('inet', 41, socket.AF_INET, socket.SOCK_STREAM, 0)
attempt('netlink', 41, socket.AF_NETLINK, socket.SOCK_RAW, 0)
attempt('unix', 41, socket.AF_UNIX, socket.SOCK_STREAM, 0)
"""


@pytest.mark.skipif(platform.machine() != "x86_64", reason="the probe uses x86_64 system call numbers")
def test_seccomp_refuses_dangerous_system_calls() -> None:
    r = run_python(SYSCALLS, limits=SMALL, settings=STRICT)
    assert r.ok, r.stderr
    got = dict(line.split(" ", 1) for line in r.stdout.splitlines())
    for name in ("ptrace", "mount", "unshare", "setns", "keyctl", "bpf", "perf_event_open", "kexec_load",
                 "init_module", "io_uring_setup"):  # fmt: skip
        assert got[name] == "-1 EPERM", (name, got[name])
    assert got["inet"] == got["netlink"] == "-1 EAFNOSUPPORT"
    assert got["unix"].endswith("ok")  # local sockets still work (multiprocessing needs them)


def test_memory_is_bounded_per_run_across_processes_and_tmp() -> None:
    # each process stays under its RLIMIT_AS; together (four processes, or files in /tmp) they exceed the run's memory
    forks = (
        "import os, time\n"
        "kids = []\n"
        "for _ in range(4):\n"
        "    pid = os.fork()\n"
        "    if pid == 0:\n"
        "        block = b'x' * (60 * 1024 * 1024)\n"
        "        time.sleep(3)\n"
        "        os._exit(0)\n"
        "    kids.append(pid)\n"
        "codes = [os.waitpid(k, 0)[1] for k in kids]\n"
        "raise SystemExit(1 if any(os.WIFSIGNALED(c) for c in codes) else 0)\n"
    )
    r = run_python(forks, limits=_with(SMALL, memory_mb=128, wall_s=8), settings=STRICT)
    assert not r.ok and r.killed_reason == "memory" and not r.timed_out
    tmp_fill = (
        "with open('/tmp/fill', 'wb') as f:\n"
        "    for _ in range(150):\n"
        "        f.write(b'x' * 1024 * 1024)\n"
        "print('written')\n"
    )
    big_disk = _with(SMALL, memory_mb=128, disk_mb=512, file_size_mb=512)
    r = run_python(tmp_fill, limits=big_disk, settings=STRICT)
    assert not r.ok and r.killed_reason == "memory" and "written" not in r.stdout


def test_memory_is_bounded_in_total() -> None:
    parent = f"astraflow-sandbox-test-{uuid.uuid4().hex[:8]}"
    settings = SandboxSettings(total_memory_mb=96, cgroup_parent=parent)
    code = "block = b'x' * (150 * 1024 * 1024)\nprint('allocated')"
    try:
        r = run_python(code, limits=_with(SMALL, memory_mb=256), settings=settings)
        assert not r.ok and r.killed_reason == "memory" and "allocated" not in r.stdout
        assert run_python(code, limits=_with(SMALL, memory_mb=256), settings=STRICT).ok  # the run's own bound allows it
    finally:
        remove_cgroup(parent)


def test_cgroups_left_by_a_dead_process_are_removed() -> None:
    parent = f"astraflow-sandbox-test-{uuid.uuid4().hex[:8]}"
    dead_pid = 4_000_000  # above any pid_max: no such process
    stale = [directory / f"{dead_pid}-0-feedface" for directory in cgroup_dirs(parent)]
    try:
        cgroups.create(64, 8, 1024, parent)  # makes the parent (and a run cgroup, removed below)
        for directory in stale:
            directory.mkdir()
        code = (
            "from astraflow.sandbox import SandboxSettings, run_python\n"
            f"print(run_python('print(1)', settings=SandboxSettings(cgroup_parent={parent!r})).stdout)\n"
        )
        root = Path(__file__).resolve().parents[2]
        done = subprocess.run([sys.executable, "-c", code], cwd=root, capture_output=True, text=True, timeout=60,
                              env={**os.environ, "PYTHONPATH": str(root)}, check=False)  # fmt: skip
        assert done.stdout == "1\n\n", done.stderr  # a fresh process: its first run cleans up
        assert not any(directory.exists() for directory in stale)
    finally:
        remove_cgroup(parent)


def test_a_run_dies_with_the_process_that_started_it() -> None:
    marker = f"orphan-{uuid.uuid4().hex}"
    parent = f"astraflow-sandbox-test-{uuid.uuid4().hex[:8]}"
    code = (
        "import sys\n"
        "from astraflow.sandbox import SandboxLimits, SandboxSettings, run_python\n"
        "sleeper = 'import os, time\\nos.fork()\\nprint(\"up\", flush=True)\\ntime.sleep(60)'\n"
        f"run_python(sleeper, args=[{marker!r}], limits=SandboxLimits(wall_s=60),\n"
        f"           settings=SandboxSettings(cgroup_parent={parent!r}))\n"
    )
    root = Path(__file__).resolve().parents[2]
    host = subprocess.Popen([sys.executable, "-c", code], cwd=root, env={**os.environ, "PYTHONPATH": str(root)})
    try:
        deadline = time.monotonic() + 20
        # the host, bwrap, bwrap's reaper, the run and the run's child all carry the marker
        while processes_with(marker) < 5 and time.monotonic() < deadline:
            time.sleep(0.05)
        assert processes_with(marker) >= 5
        host.kill()  # SIGKILL: no cleanup code of ours runs
        host.wait()
        deadline = time.monotonic() + 5
        while processes_with(marker) and time.monotonic() < deadline:
            time.sleep(0.05)
        assert processes_with(marker) == 0  # bwrap died with its parent, the namespace with bwrap
    finally:
        host.kill()
        host.wait()
        remove_cgroup(parent)


@pytest.mark.skipif(os.geteuid() != 0, reason="as a non-root user bwrap maps the code to that user's own uid")
def test_as_root_the_code_runs_as_an_unprivileged_host_uid() -> None:
    """Seen from the host (/proc/<pid>/status of the run's interpreter, found by a marker in its
    command line), the code is not host uid 0 behind its user namespace (the launcher shell that
    moves itself into the run's cgroups and bwrap's own first process still are: they set the
    view up, then drop to the run's uid; a scan that caught the shell failed 1 full unit run)."""
    marker = f"uid-probe-{uuid.uuid4().hex}"
    seen: list[tuple[int, int]] = []  # (pid, host uid) of the run's interpreter

    def scan() -> None:
        for proc in Path("/proc").iterdir():
            try:
                if (proc.name.isdigit() and marker.encode() in (proc / "cmdline").read_bytes()
                        and (proc / "comm").read_text().strip() not in ("bwrap", "setpriv", "sh")):
                    uid = int((proc / "status").read_text().split("\nUid:")[1].split()[0])
                    seen.append((int(proc.name), uid))
            except (OSError, IndexError):
                continue

    import threading

    done = threading.Event()

    def poll() -> None:
        while not done.is_set() and not seen:
            scan()
            time.sleep(0.05)

    t = threading.Thread(target=poll)
    t.start()
    try:
        res = run_python("import os, time; time.sleep(2); print(os.getuid())", args=[marker], limits=_with(SMALL, wall_s=20))
    finally:
        done.set()
        t.join()
    assert res.ok and res.stdout.strip() == "1000", res  # what the code sees
    assert seen, "the run's interpreter was never seen from the host"
    low, high = isolation.SANDBOX_UIDS
    assert all(low <= uid < high for _, uid in seen), seen  # what the host sees: never 0
