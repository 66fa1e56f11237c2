"""The sandbox contains what untrusted code tries: loops, fork bombs, memory hogs, network,
writes outside its directory, reading the parent's secrets, forbidden system calls. Every case
ends as a failed result within seconds. Limits are kept small so a containment failure cannot
hurt a shared machine; the fork bomb also arms `alarm()` in every process as a second safety net.
Cases run in both modes: bwrap (where this machine has it) and the opted-in weak process mode.
"""

from __future__ import annotations

import asyncio
import dataclasses
import os
import socket
import threading
import time
import uuid
from pathlib import Path

import pytest
from helpers import processes_with

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


_with = dataclasses.replace


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
            peak[0] = max(peak[0], processes_with(marker))
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
    # the run's processes, plus bwrap and its pid-1 reaper, and as root the outer bwrap's pid-1 reaper
    assert peak[0] <= SMALL.nproc + 3
    assert processes_with(marker) == 0  # the whole tree is gone, setsid() or not


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
    while processes_with(marker) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert processes_with(marker) == 0


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


@needs_weak
def test_weak_mode_still_refuses_network_below_python() -> None:
    # ctypes goes around the audit hook; the seccomp filter the prelude loaded does not let it through
    code = (
        "import ctypes, errno\nlibc = ctypes.CDLL(None, use_errno=True)\n"
        "for family in (2, 10, 16):  # AF_INET, AF_INET6, AF_NETLINK\n"
        "    print(family, libc.socket(family, 1 if family != 16 else 3, 0), errno.errorcode[ctypes.get_errno()])\n"
        "print('ptrace', libc.ptrace(0, 0, 0, 0), errno.errorcode[ctypes.get_errno()])\n"
    )
    r = run_python(code, limits=SMALL, settings=WEAK)
    assert r.ok and r.isolation == "process", r.stderr
    assert r.stdout.splitlines() == ["2 -1 EAFNOSUPPORT", "10 -1 EAFNOSUPPORT", "16 -1 EAFNOSUPPORT", "ptrace -1 EPERM"]
