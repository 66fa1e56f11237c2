"""bench/_pipeline.py: a benchmark ended by SIGTERM (`timeout`, `kill`) stops its role processes.

The roles run in sessions of their own (`Supervisor`), so nothing stops them when the benchmark
process dies unless its cleanup runs; `interrupt_on_sigterm` (on `run_pipeline` and
`run_pair_pipeline`) turns SIGTERM into the KeyboardInterrupt whose cleanup already stops them.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]

# The benchmark's shape: roles started inside a try whose finally stops them, in a function that
# is (or is not) decorated like run_pipeline.
CHILD = textwrap.dedent("""
    import sys, time
    from pathlib import Path
    sys.path.insert(0, "bench")
    import _pipeline
    from astraflow.demo.supervisor import Role, Supervisor

    def run(log_dir):
        sup = Supervisor(Path(log_dir))
        try:
            role = sup.start(Role("sleeper", [sys.executable, "-c", "import time; time.sleep(120)"]))
            print(role.proc.pid, flush=True)
            time.sleep(120)
        finally:
            sup.stop_all(timeout_s=10)

    if sys.argv[2] == "1":
        run = _pipeline.interrupt_on_sigterm()(run)
    try:
        run(sys.argv[1])
    except KeyboardInterrupt:
        sys.exit(130)
""")


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    try:  # a zombie (exited, not yet reaped) counts as gone
        return Path(f"/proc/{pid}/stat").read_text().split(") ", 1)[1][0] != "Z"
    except (FileNotFoundError, IndexError):
        return False


# A stopped role is gone well within a second; the control watches its role this long (waiting the
# full 10 s for a role that is meant to stay would only add time).
CONTROL_WATCH_S = 3.0


def _role_after_sigterm(tmp_path: Path, handled: bool, watch_s: float = 10.0) -> tuple[int, bool, int]:
    """(the role's pid, whether it is alive `watch_s` after the benchmark got SIGTERM, its exit code)."""
    child = subprocess.Popen([sys.executable, "-c", CHILD, str(tmp_path), "1" if handled else "0"],
                             stdout=subprocess.PIPE, text=True, cwd=ROOT, env={**os.environ, "PYTHONPATH": str(ROOT)})
    pid = int(child.stdout.readline())
    assert _alive(pid)
    child.send_signal(signal.SIGTERM)
    code = child.wait(timeout=60)
    deadline = time.monotonic() + watch_s
    while time.monotonic() < deadline and _alive(pid):
        time.sleep(0.1)
    alive = _alive(pid)
    if alive:
        os.kill(pid, signal.SIGKILL)
    return pid, alive, code


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc")
def test_sigterm_stops_the_benchmarks_roles(tmp_path: Path) -> None:
    _, alive, code = _role_after_sigterm(tmp_path, handled=True)
    assert code == 130  # the KeyboardInterrupt, after the finally ran
    assert not alive


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc")
def test_without_the_handler_sigterm_leaves_the_role_running(tmp_path: Path) -> None:
    """The control: the check above can fail (Python's default SIGTERM runs no finally)."""
    _, alive, code = _role_after_sigterm(tmp_path, handled=False, watch_s=CONTROL_WATCH_S)
    assert code == -signal.SIGTERM
    assert alive


def test_the_pipeline_runners_carry_the_handler() -> None:
    import _pipeline
    import _pipeline_pair

    def decorated(fn) -> bool:  # the context manager a ContextDecorator wrapper closes over
        made_by = getattr(_pipeline.interrupt_on_sigterm, "__wrapped__", None)
        return any(getattr(c.cell_contents, "func", None) is made_by for c in fn.__closure__ or ())

    assert decorated(_pipeline.run_pipeline)
    assert decorated(_pipeline_pair.run_pair_pipeline)
    assert not decorated(_pipeline.wait_ready)  # the check can fail
