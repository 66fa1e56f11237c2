"""Two sandboxes for one check: the untrusted code in one, the code that judges it in another.

    solution_run, driver_run = await run_split_async(solution_src, driver_src, driver_files=...)

The solution runs in its own sandbox as a server (`_remote.serve`); the driver (a test harness)
runs in a second sandbox, calls `_astraflow_remote.connect(int(sys.argv[1]), int(sys.argv[2]))`
to get the solution's names as plain values or proxies, and reports on its stdout. The two
share nothing but two pipes carrying JSON lines of plain data: separate interpreters, pid,
mount, network and ipc namespaces and working directories, so nothing the solution does to its
own interpreter (builtins, `sys.modules`, `unittest`, atexit, `os._exit`, its stdout) reaches
the driver's. Only the driver's stdout is read; the solution's output is kept for debugging.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
from collections.abc import Mapping
from pathlib import Path

from astraflow.sandbox.isolation import resolve_mode
from astraflow.sandbox.runner import run_python_async
from astraflow.sandbox.settings import SandboxSettings, current_settings
from astraflow.sandbox.types import SandboxLimits, SandboxResult

REMOTE_MODULE = "_astraflow_remote.py"
REMOTE_SOURCE = (Path(__file__).parent / "_remote.py").read_text()
_SERVER_MAIN = "import sys, _astraflow_remote\n_astraflow_remote.serve(int(sys.argv[1]), int(sys.argv[2]))\n"
_SOLUTION_GRACE_S = 1.0  # once the driver is done, how long the solution may take to exit


async def run_split_async(
    solution: str,
    driver: str,
    *,
    driver_files: Mapping[str, str | bytes] | None = None,
    limits: SandboxLimits = SandboxLimits(),
    settings: SandboxSettings | None = None,
) -> tuple[SandboxResult | None, SandboxResult]:
    """(solution run, driver run); the solution's is None when it had to be cancelled.

    Raises `SandboxUnavailableError` (before starting anything) where isolation is missing.
    """
    settings = settings or current_settings()
    resolve_mode(settings)
    to_solution_r, to_solution_w = os.pipe()
    to_driver_r, to_driver_w = os.pipe()
    solution_run = asyncio.ensure_future(
        run_python_async(
            _SERVER_MAIN,
            files={"solution.py": solution, REMOTE_MODULE: REMOTE_SOURCE},
            args=[str(to_solution_r), str(to_driver_w)],
            limits=limits,
            settings=settings,
            pass_fds=(to_solution_r, to_driver_w),
        )
    )
    try:
        driver_run = await run_python_async(
            driver,
            files={**(driver_files or {}), REMOTE_MODULE: REMOTE_SOURCE},
            args=[str(to_driver_r), str(to_solution_w)],
            limits=limits,
            settings=settings,
            pass_fds=(to_driver_r, to_solution_w),
        )
        done, _pending = await asyncio.wait([solution_run], timeout=_SOLUTION_GRACE_S)
        return (solution_run.result() if done else None), driver_run
    finally:
        if not solution_run.done():
            solution_run.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await solution_run
