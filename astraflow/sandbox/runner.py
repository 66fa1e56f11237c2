"""Runs untrusted Python in the sandbox: `run_python_async` (asyncio) and `run_python` (blocking).

One implementation, asyncio-based, so a stream processor can await many runs at once without a
thread per run; the blocking form wraps it with `asyncio.run`. Output is read incrementally and
bounded (head and tail kept), the wall-clock timeout kills the whole process tree, and the
temporary working directory is removed whatever happens, cancellation included.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import shutil
import signal
import tempfile
import time
from collections.abc import Mapping, Sequence
from pathlib import Path, PurePosixPath

from astraflow.errors import SandboxError
from astraflow.sandbox.isolation import MAIN_SCRIPT, Launch, build_launch, resolve_mode
from astraflow.sandbox.types import SandboxLimits, SandboxResult, killed_reason

_TAIL_BYTES = 4096  # end of each stream kept even when the middle is cut (tracebacks live there)
_DRAIN_GRACE_S = 1.0  # how long to wait for pipes after the process tree is dead
_DEFAULT_LIMITS = SandboxLimits()


class _Capture:
    """Keeps the first `cap` bytes of a stream and its last `_TAIL_BYTES`, counting the rest."""

    def __init__(self, cap: int) -> None:
        self.cap = cap  # bytes kept from the start
        self.head = bytearray()  # first bytes
        self.tail = bytearray()  # last bytes after the head filled up
        self.total = 0  # bytes seen

    def feed(self, chunk: bytes) -> None:
        self.total += len(chunk)
        room = self.cap - len(self.head)
        if room > 0:
            self.head += chunk[:room]
            chunk = chunk[room:]
        if chunk:
            self.tail += chunk
            del self.tail[:-_TAIL_BYTES]

    @property
    def truncated(self) -> bool:
        return self.total > len(self.head) + len(self.tail)

    def text(self) -> str:
        if not self.truncated:
            return (self.head + self.tail).decode("utf-8", "replace")
        cut = self.total - len(self.head) - len(self.tail)
        marker = f"\n... [{cut} bytes cut] ...\n".encode()
        return (self.head + marker + self.tail).decode("utf-8", "replace")

    def tail_text(self) -> str:
        return bytes((self.head + self.tail)[-_TAIL_BYTES:]).decode("utf-8", "replace")


async def _drain(stream: asyncio.StreamReader | None, capture: _Capture) -> None:
    if stream is None:
        return
    while chunk := await stream.read(65536):
        capture.feed(chunk)


def _write_files(workdir: Path, code: str, files: Mapping[str, str | bytes]) -> None:
    """Writes main.py and the extra files; names must be relative and stay inside the directory."""
    for name, content in {**files, MAIN_SCRIPT: code}.items():
        rel = PurePosixPath(name)
        if rel.is_absolute() or ".." in rel.parts or not rel.parts:
            raise SandboxError(
                f"sandbox file name {name!r} must be a relative path inside the work directory"
            )
        path = workdir.joinpath(*rel.parts)
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_bytes(content.encode() if isinstance(content, str) else content)


def _chown_tree(root: Path, uid: int) -> None:
    for path in [root, *root.rglob("*")]:
        os.chown(path, uid, uid)


def _kill_tree(pgid: int) -> None:
    """SIGKILLs the process group of the launched process (namespace mode: its whole namespace)."""
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(pgid, signal.SIGKILL)


def _read_status(fd: int) -> dict | None:
    """The init's JSON report, or None when it wrote none (killed on timeout)."""
    os.set_blocking(fd, False)
    data = b""
    with contextlib.suppress(BlockingIOError):
        while chunk := os.read(fd, 65536):
            data += chunk
    return json.loads(data) if data else None


async def _spawn(launch: Launch) -> asyncio.subprocess.Process:
    kwargs: dict = {}
    if launch.user is not None:
        kwargs = {"user": launch.user, "group": launch.user, "extra_groups": []}
    try:
        return await asyncio.create_subprocess_exec(
            *launch.argv,
            stdin=asyncio.subprocess.DEVNULL,
            stdout=asyncio.subprocess.PIPE,
            stderr=asyncio.subprocess.PIPE,
            env=launch.env,
            cwd=launch.cwd,
            start_new_session=True,
            pass_fds=launch.pass_fds,
            **kwargs,
        )
    except OSError as exc:
        raise SandboxError(f"could not start the sandbox ({launch.argv[0]}): {exc}") from exc


async def run_python_async(
    code: str,
    *,
    files: Mapping[str, str | bytes] | None = None,
    args: Sequence[str] = (),
    limits: SandboxLimits = _DEFAULT_LIMITS,
) -> SandboxResult:
    """Runs `code` as `main.py` in a fresh working directory with `files` beside it.

    Returns a failed result (never raises) for anything the code does; raises `SandboxError`
    only when the sandbox itself cannot be set up.
    """
    mode = resolve_mode(limits)
    workdir = Path(tempfile.mkdtemp(prefix="astraflow-sbx-"))
    status_r = status_w = None
    proc = None
    try:
        _write_files(workdir, code, files or {})
        if mode == "namespaces":
            status_r, status_w = os.pipe()
        launch = build_launch(limits, str(workdir), list(args), status_w)
        if launch.user is not None:
            _chown_tree(workdir, launch.user)
        out, err = _Capture(limits.max_output_bytes), _Capture(limits.max_output_bytes)
        start = time.monotonic()
        proc = await _spawn(launch)
        if status_w is not None:
            os.close(status_w)
            status_w = None
        readers = [
            asyncio.ensure_future(_drain(proc.stdout, out)),
            asyncio.ensure_future(_drain(proc.stderr, err)),
        ]
        timed_out = False
        try:
            await asyncio.wait_for(proc.wait(), timeout=limits.wall_s)
        except TimeoutError:
            timed_out = True
        _kill_tree(proc.pid)  # also reaps what the code left running in the background
        returncode = await proc.wait()
        duration = time.monotonic() - start
        _done, pending = await asyncio.wait(readers, timeout=_DRAIN_GRACE_S)
        for task in pending:
            task.cancel()
        exit_code, sig = _exit_status(mode, returncode, status_r, timed_out)
        reason = killed_reason(
            timed_out=timed_out, exit_code=exit_code, signal=sig, stderr_tail=err.tail_text()
        )
        return SandboxResult(
            ok=exit_code == 0 and sig is None and not timed_out,
            exit_code=exit_code,
            signal=sig,
            stdout=out.text(),
            stderr=err.text(),
            stdout_truncated=out.truncated,
            stderr_truncated=err.truncated,
            timed_out=timed_out,
            killed_reason=reason,
            duration_s=duration,
            isolation=mode,
        )
    finally:
        if proc is not None and proc.returncode is None:
            _kill_tree(proc.pid)
        for fd in (status_r, status_w):
            if fd is not None:
                os.close(fd)
        shutil.rmtree(workdir, ignore_errors=True)


def _exit_status(
    mode: str, returncode: int, status_fd: int | None, timed_out: bool
) -> tuple[int | None, int | None]:
    """(exit code, signal) of the untrusted process."""
    if timed_out:
        return None, signal.SIGKILL
    if mode == "process":
        return (None, -returncode) if returncode < 0 else (returncode, None)
    assert status_fd is not None
    status = _read_status(status_fd)
    if status is None:
        raise SandboxError(f"the sandbox init exited ({returncode}) without reporting the run's status")
    if "error" in status:
        raise SandboxError(status["error"])
    return status["exit_code"], status["signal"]


def run_python(
    code: str,
    *,
    files: Mapping[str, str | bytes] | None = None,
    args: Sequence[str] = (),
    limits: SandboxLimits = _DEFAULT_LIMITS,
) -> SandboxResult:
    """Blocking form of `run_python_async`; call it from threads or scripts, not inside an event loop."""
    try:
        asyncio.get_running_loop()
    except RuntimeError:
        return asyncio.run(run_python_async(code, files=files, args=args, limits=limits))
    raise SandboxError(
        "run_python was called inside a running event loop; await run_python_async(...) instead"
    )
