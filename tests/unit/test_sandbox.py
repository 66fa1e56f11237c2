"""The sandbox contains what untrusted code tries: loops, fork bombs, memory hogs, network,
writes outside its directory, reading the parent's secrets, forbidden system calls. Every case
ends as a failed result within seconds. Limits are kept small so a containment failure cannot
hurt a shared machine; the fork bomb also arms `alarm()` in every process as a second safety net.
Cases run in both modes: bwrap (where this machine has it) and the opted-in weak process mode.
"""

from __future__ import annotations

import asyncio
import os
import platform
import socket
import subprocess
import sys
import threading
import time
import uuid
from pathlib import Path

import pytest

from astraflow.errors import SandboxError, SandboxUnavailableError
from astraflow.sandbox import (
    SandboxLimits,
    SandboxSettings,
    current_settings,
    resolve_mode,
    run_python,
    run_python_async,
    unavailable_reason,
)
from astraflow.sandbox.settings import configure

pytestmark = [pytest.mark.unit, pytest.mark.timeout(60)]

SMALL = SandboxLimits(wall_s=5, cpu_s=2, memory_mb=192, nproc=8, file_size_mb=1, disk_mb=8)
STRICT = SandboxSettings()
# the weak mode as root runs the code under a uid of its own, which needs an interpreter it can read
WEAK_PYTHON = "/usr/bin/python3" if os.path.exists("/usr/bin/python3") else None
WEAK = SandboxSettings(allow_weak_isolation=True, bwrap="/nonexistent/bwrap", python=WEAK_PYTHON)
BWRAP_MISSING = unavailable_reason(STRICT)
needs_bwrap = pytest.mark.skipif(BWRAP_MISSING is not None, reason=f"bwrap mode unavailable: {BWRAP_MISSING}")


def _weak_missing() -> str | None:
    try:
        resolve_mode(WEAK)
    except SandboxUnavailableError as exc:
        return str(exc)
    return None


WEAK_MISSING = _weak_missing()
needs_weak = pytest.mark.skipif(WEAK_MISSING is not None, reason=f"weak mode unavailable: {WEAK_MISSING}")
MODES = [pytest.param(STRICT, id="bwrap", marks=needs_bwrap), pytest.param(WEAK, id="process", marks=needs_weak)]
BEST = STRICT if BWRAP_MISSING is None else WEAK  # for cases that do not depend on the mode


def _with(limits: SandboxLimits, **changes: object) -> SandboxLimits:
    fields = {name: getattr(limits, name) for name in SandboxLimits.__slots__}
    return SandboxLimits(**{**fields, **changes})  # type: ignore[arg-type]


def _processes_with(marker: str) -> int:
    """Processes on this machine whose command line contains `marker`."""
    n = 0
    for pid in os.listdir("/proc"):
        if pid.isdigit():
            try:
                n += marker.encode() in Path(f"/proc/{pid}/cmdline").read_bytes()
            except OSError:
                continue
    return n


@pytest.mark.parametrize("mode", MODES)
def test_runs_code_with_files_and_args(mode: SandboxSettings) -> None:
    code = "import sys, helper\nprint(helper.double(int(sys.argv[1])), sys.stdin.read() == '')"
    r = run_python(
        code, files={"helper.py": "def double(x):\n    return 2 * x\n"}, args=["21"], limits=SMALL, settings=mode
    )
    assert r.ok and r.exit_code == 0 and r.signal is None and not r.timed_out
    assert r.stdout == "42 True\n"
    assert r.killed_reason is None


@pytest.mark.parametrize("mode", MODES)
def test_exception_and_exit_code_are_reported(mode: SandboxSettings) -> None:
    r = run_python("raise ValueError('boom')", limits=SMALL, settings=mode)
    assert not r.ok and r.exit_code == 1 and "ValueError: boom" in r.stderr
    assert run_python("import sys; sys.exit(3)", limits=SMALL, settings=mode).exit_code == 3


@pytest.mark.parametrize("mode", MODES)
def test_infinite_loop_hits_cpu_limit(mode: SandboxSettings) -> None:
    r = run_python("while True:\n    pass", limits=_with(SMALL, cpu_s=1, wall_s=10), settings=mode)
    assert not r.ok and r.killed_reason == "cpu"  # the CPU limit, not the 10 s wall timeout


@pytest.mark.parametrize("mode", MODES)
def test_sleeping_code_hits_wall_timeout(mode: SandboxSettings) -> None:
    r = run_python("import time\ntime.sleep(60)", limits=_with(SMALL, wall_s=1), settings=mode)
    assert not r.ok and r.timed_out and r.killed_reason == "timeout" and r.exit_code is None


@pytest.mark.parametrize("mode", MODES)
def test_memory_hog_fails(mode: SandboxSettings) -> None:
    code = "chunks = []\nwhile True:\n    chunks.append(bytearray(16 * 1024 * 1024))"
    r = run_python(code, limits=SMALL, settings=mode)
    assert not r.ok and r.killed_reason == "memory"


@pytest.mark.parametrize("mode", MODES)
def test_file_size_limit(mode: SandboxSettings) -> None:
    r = run_python("open('big', 'wb').write(b'x' * 4 * 1024 * 1024)", limits=SMALL, settings=mode)
    assert not r.ok and r.killed_reason == "file_size"


@pytest.mark.parametrize("mode", MODES)
def test_socket_connect_is_refused(mode: SandboxSettings) -> None:
    with socket.socket() as server:
        server.bind(("127.0.0.1", 0))
        server.listen(1)
        server.setblocking(False)
        port = server.getsockname()[1]
        code = (
            "import socket\n"
            f"s = socket.create_connection(('127.0.0.1', {port}), timeout=2)\n"
            "print('CONNECTED')\n"
        )
        r = run_python(code, limits=SMALL, settings=mode)
        assert not r.ok and "CONNECTED" not in r.stdout
        assert "PermissionError" in r.stderr or "Network is unreachable" in r.stderr
        with pytest.raises(BlockingIOError):
            server.accept()


@pytest.mark.parametrize("mode", MODES)
def test_parent_environment_is_not_inherited(mode: SandboxSettings, monkeypatch: pytest.MonkeyPatch) -> None:
    secret = f"s3cr3t-{uuid.uuid4().hex}"
    monkeypatch.setenv("ASTRAFLOW_FAKE_SECRET", secret)
    r = run_python("import os\nprint(dict(os.environ))", limits=SMALL, settings=mode)
    assert r.ok and secret not in r.stdout and "ASTRAFLOW_FAKE_SECRET" not in r.stdout


@needs_bwrap
def test_other_processes_environments_are_invisible(monkeypatch: pytest.MonkeyPatch) -> None:
    secret = f"s3cr3t-{uuid.uuid4().hex}"
    monkeypatch.setenv("ASTRAFLOW_FAKE_SECRET", secret)
    code = (
        "import os\n"
        "pids = [p for p in os.listdir('/proc') if p.isdigit()]\n"
        "for p in pids:\n"
        "    try:\n"
        "        print(p, open(f'/proc/{p}/environ', 'rb').read())\n"
        "    except OSError as e:\n"
        "        print(p, 'unreadable', e.errno)\n"
        "print('pids', len(pids))\n"
    )
    r = run_python(code, limits=SMALL, settings=STRICT)
    assert r.ok and secret not in r.stdout
    assert r.isolation == "bwrap"


@needs_bwrap
def test_writes_outside_the_work_directory_are_confined_or_fail() -> None:
    name = f"astraflow-escape-{uuid.uuid4().hex}"
    repo = Path(__file__).resolve().parents[2]
    targets = [Path("/tmp") / name, repo / name, Path("/var/tmp") / name, Path.home() / name]
    code = "import sys\nfor path in sys.argv[1:]:\n    try:\n        open(path, 'w').write('x')\n"
    code += (
        "        print('wrote', path)\n    except OSError as e:\n        print('refused', path, e.errno)\n"
    )
    try:
        r = run_python(code, args=[str(t) for t in targets], limits=SMALL, settings=STRICT)
        assert r.ok, r.stderr
        assert f"wrote /tmp/{name}" in r.stdout  # its own private /tmp ...
        for target in targets:
            assert not target.exists()  # ... and nothing reached the host
        assert f"refused {repo / name}" in r.stdout
    finally:
        for target in targets:
            target.unlink(missing_ok=True)


@needs_bwrap
def test_fork_bomb_is_contained() -> None:
    marker = f"bomb-{uuid.uuid4().hex}"
    code = (
        "import os, signal, time\n"
        "signal.alarm(5)  # safety net: no process of this bomb outlives 5 s, contained or not\n"
        "while True:\n"
        "    try:\n"
        "        if os.fork() == 0:\n"
        "            signal.alarm(5)\n"
        "            os.setsid()\n"
        "    except OSError as e:\n"
        "        print('refused', e.errno, flush=True)\n"
        "        time.sleep(0.02)\n"
    )
    peak, stop = [0], threading.Event()

    def watch() -> None:
        while not stop.is_set():
            peak[0] = max(peak[0], _processes_with(marker))
            time.sleep(0.05)

    watcher = threading.Thread(target=watch)
    watcher.start()
    try:
        r = run_python(code, args=[marker], limits=_with(SMALL, wall_s=2), settings=STRICT)
    finally:
        stop.set()
        watcher.join()
    assert not r.ok and r.timed_out
    assert "refused 11" in r.stdout  # EAGAIN: the pids cgroup stopped it
    assert peak[0] <= SMALL.nproc + 2  # the run's processes, plus bwrap and its pid-1 reaper
    assert _processes_with(marker) == 0  # the whole tree is gone, setsid() or not


def test_async_runs_concurrently_and_cancellation_kills_the_run() -> None:
    marker = f"cancel-{uuid.uuid4().hex}"

    async def scenario() -> list[str]:
        outs = await asyncio.gather(*(run_python_async(f"print({i} * 2)", limits=SMALL, settings=BEST) for i in range(3)))
        slow = asyncio.ensure_future(
            run_python_async("import time\ntime.sleep(30)", args=[marker], limits=SMALL, settings=BEST)
        )
        await asyncio.sleep(1.0)
        slow.cancel()
        with pytest.raises(asyncio.CancelledError):
            await slow
        return [o.stdout for o in outs]

    assert asyncio.run(scenario()) == ["0\n", "2\n", "4\n"]
    deadline = time.monotonic() + 3
    while _processes_with(marker) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert _processes_with(marker) == 0


def test_output_is_bounded_head_and_tail() -> None:
    code = "print('START' + 'x' * 300000)\nprint('END')"
    r = run_python(code, limits=_with(SMALL, max_output_bytes=1000), settings=BEST)
    assert r.ok and r.stdout_truncated
    assert r.stdout.startswith("START") and r.stdout.rstrip().endswith("END") and len(r.stdout) < 6000


def test_bad_file_names_and_event_loop_misuse_raise() -> None:
    with pytest.raises(SandboxError, match="relative path"):
        run_python("pass", files={"../evil.py": "x"}, settings=BEST)

    async def inside_loop() -> None:
        run_python("pass", settings=BEST)

    with pytest.raises(SandboxError, match="run_python_async"):
        asyncio.run(inside_loop())


def test_missing_isolation_refuses_unless_the_operator_allows_weak_isolation(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    configure(None)  # an earlier CLI test in this process may have configured the defaults
    missing = SandboxSettings(bwrap="/nonexistent/bwrap", python=WEAK_PYTHON)
    with pytest.raises(SandboxUnavailableError, match="bubblewrap .* not installed.*ALLOW_WEAK_ISOLATION"):
        run_python("print('ran')", limits=SMALL, settings=missing)
    monkeypatch.setenv("ASTRAFLOW__SANDBOX__BWRAP", "/nonexistent/bwrap")
    if WEAK_PYTHON is not None:
        monkeypatch.setenv("ASTRAFLOW__SANDBOX__PYTHON", WEAK_PYTHON)
    assert current_settings() == missing  # the operator's settings come from the environment
    with pytest.raises(SandboxUnavailableError, match="scripts/system-deps.sh"):
        run_python("print('ran')", limits=SMALL)
    configure(WEAK)  # what `astraflow --config FILE ...` does with the file's sandbox section
    try:
        assert current_settings() == WEAK
    finally:
        configure(None)
    assert current_settings() == missing
    monkeypatch.setenv("ASTRAFLOW__SANDBOX__ALLOW_WEAK_ISOLATION", "true")
    if WEAK_MISSING is None:
        r = run_python("import os\nprint('ran', os.getuid() != 0)", limits=SMALL)
        assert r.ok and r.stdout == "ran True\n" and r.isolation == "process"


@pytest.mark.skipif(os.geteuid() != 0, reason="the case is about running as root")
def test_weak_mode_never_runs_untrusted_code_as_root(tmp_path: Path) -> None:
    hidden = tmp_path / "hidden"
    hidden.mkdir(mode=0o700)
    (hidden / "bin").mkdir()
    python = hidden / "bin" / "python3"  # never started: the refusal comes first
    python.write_text("#!/bin/sh\n")
    python.chmod(0o755)
    weak_root = SandboxSettings(allow_weak_isolation=True, bwrap="/nonexistent/bwrap", python=str(python))
    with pytest.raises(SandboxUnavailableError, match="would run as root.*ASTRAFLOW__SANDBOX__PYTHON"):
        run_python("print('ran')", limits=SMALL, settings=weak_root)


@needs_bwrap
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


@needs_bwrap
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


@needs_bwrap
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


@needs_bwrap
def test_memory_is_bounded_in_total() -> None:
    parent = f"astraflow-sandbox-test-{uuid.uuid4().hex[:8]}"
    settings = SandboxSettings(total_memory_mb=96, cgroup_parent=parent)
    code = "block = b'x' * (150 * 1024 * 1024)\nprint('allocated')"
    try:
        r = run_python(code, limits=_with(SMALL, memory_mb=256), settings=settings)
        assert not r.ok and r.killed_reason == "memory" and "allocated" not in r.stdout
        assert run_python(code, limits=_with(SMALL, memory_mb=256), settings=STRICT).ok  # the run's own bound allows it
    finally:
        for controller in ("memory", "pids"):
            Path(f"/sys/fs/cgroup/{controller}/{parent}").rmdir()


@needs_bwrap
def test_cgroups_left_by_a_dead_process_are_removed() -> None:
    parent = f"astraflow-sandbox-test-{uuid.uuid4().hex[:8]}"
    dead_pid = 4_000_000  # above any pid_max: no such process
    stale = [Path(f"/sys/fs/cgroup/{c}/{parent}/{dead_pid}-0-feedface") for c in ("memory", "pids")]
    try:
        for directory in stale:
            directory.mkdir(parents=True)
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
        for c in ("memory", "pids"):
            for directory in [*Path(f"/sys/fs/cgroup/{c}/{parent}").glob("*-*-*"), Path(f"/sys/fs/cgroup/{c}/{parent}")]:
                if directory.is_dir():
                    directory.rmdir()
