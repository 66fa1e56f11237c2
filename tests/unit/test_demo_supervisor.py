"""The demo's supervisor: roles of a parent that dies by kill -9 do not outlive it (die_with_parent)."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

PARENT = textwrap.dedent("""
    import sys, time
    from pathlib import Path
    from astraflow.demo.supervisor import Role, Supervisor
    sup = Supervisor(Path(sys.argv[1]), die_with_parent=sys.argv[2] == "1")
    role = sup.start(Role("sleeper", [sys.executable, "-c", "import time; time.sleep(120)"]))
    print(role.proc.pid, flush=True)
    time.sleep(120)
""")


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    # a zombie (exited, not yet reaped by init) counts as gone
    try:
        return Path(f"/proc/{pid}/stat").read_text().split(") ", 1)[1][0] != "Z"
    except (FileNotFoundError, IndexError):
        return False


# A role that gets SIGTERM is gone well within a second; the control watches its role this long.
CONTROL_WATCH_S = 3.0


def _role_after_parent_killed(tmp_path: Path, die_with_parent: bool, watch_s: float = 10.0) -> tuple[int, bool]:
    parent = subprocess.Popen([sys.executable, "-c", PARENT, str(tmp_path), "1" if die_with_parent else "0"],
                              stdout=subprocess.PIPE, text=True, cwd=Path(__file__).resolve().parents[2],
                              env={**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parents[2])})
    pid = int(parent.stdout.readline())
    assert _alive(pid)
    parent.kill()  # kill -9: no cleanup code of the parent runs
    parent.wait()
    deadline = time.monotonic() + watch_s
    while time.monotonic() < deadline and _alive(pid):
        time.sleep(0.1)
    return pid, _alive(pid)


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="PR_SET_PDEATHSIG is Linux's")
def test_roles_get_sigterm_when_the_demo_process_is_killed(tmp_path: Path) -> None:
    _, alive = _role_after_parent_killed(tmp_path, die_with_parent=True)
    assert not alive


def test_without_die_with_parent_a_role_outlives_its_parent(tmp_path: Path) -> None:
    """The control: the check above can fail (the harnesses keep this behaviour)."""
    pid, alive = _role_after_parent_killed(tmp_path, die_with_parent=False, watch_s=CONTROL_WATCH_S)
    try:
        assert alive
    finally:
        if alive:
            os.killpg(pid, signal.SIGKILL)
