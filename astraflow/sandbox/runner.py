"""Runs untrusted Python in the sandbox: `run_python_async` (asyncio) and `run_python` (blocking).

One implementation, asyncio-based, so a stream processor can await many runs at once without a
thread per run; the blocking form wraps it with `asyncio.run`. Output is read incrementally and
bounded (head and tail kept), the wall-clock timeout kills the whole process tree, and whatever
the run made (cgroups, the weak mode's temporary directory) is removed whatever happens,
cancellation included.
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
from astraflow.sandbox import cgroups
from astraflow.sandbox.isolation import MAIN_SCRIPT, Launch, bwrap_launch, process_launch, resolve_mode
from astraflow.sandbox.settings import SandboxSettings, current_settings
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


def _check_files(code: str, files: Mapping[str, str | bytes]) -> dict[str, bytes]:
    """main.py and the extra files by relative path; names must stay inside the directory."""
    out: dict[str, bytes] = {}
    for name, content in {**files, MAIN_SCRIPT: code}.items():
        rel = PurePosixPath(name)
        if rel.is_absolute() or ".." in rel.parts or not rel.parts or "." in rel.parts:
            raise SandboxError(
                f"sandbox file name {name!r} must be a relative path inside the work directory"
            )
        out["/".join(rel.parts)] = content.encode() if isinstance(content, str) else content
    return out


def _write_files(workdir: Path, files: dict[str, bytes], uid: int | None) -> None:
    for rel, content in files.items():
        path = workdir.joinpath(*rel.split("/"))
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_bytes(content)
    if uid is not None:
        for path in [workdir, *workdir.rglob("*")]:
            os.chown(path, uid, uid)


def _kill_tree(pgid: int) -> None:
    """SIGKILLs the process group of the launched process (bwrap mode: its whole pid namespace)."""
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(pgid, signal.SIGKILL)


def _bwrap_exit_code(fd: int) -> int | None:
    """The command's exit code from bwrap's JSON status documents, None if it wrote none."""
    os.set_blocking(fd, False)
    data = b""
    with contextlib.suppress(BlockingIOError):
        while chunk := os.read(fd, 65536):
            data += chunk
    text, decoder, pos, code = data.decode(errors="replace"), json.JSONDecoder(), 0, None
    while pos < len(text):
        if text[pos].isspace():
            pos += 1
            continue
        try:
            doc, pos = decoder.raw_decode(text, pos)
        except json.JSONDecodeError:
            break
        if isinstance(doc, dict) and isinstance(doc.get("exit-code"), int):
            code = doc["exit-code"]
    return code


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


def _close(fds: list[int]) -> None:
    while fds:
        with contextlib.suppress(OSError):
            os.close(fds.pop())


async def run_python_async(
    code: str,
    *,
    files: Mapping[str, str | bytes] | None = None,
    args: Sequence[str] = (),
    limits: SandboxLimits = _DEFAULT_LIMITS,
    settings: SandboxSettings | None = None,
    pass_fds: Sequence[int] = (),
) -> SandboxResult:
    """Runs `code` as `main.py` in a fresh working directory with `files` beside it.

    `pass_fds` are host descriptors the code keeps under the same numbers (pipes to another
    run, say); they are closed here once the run has started or failed to. `settings` default
    to the operator's (`ASTRAFLOW__SANDBOX__*`). Returns a failed result (never raises) for
    anything the code does; raises `SandboxError` when the sandbox itself cannot be set up, and
    `SandboxUnavailableError` where its isolation is missing and weak isolation is not allowed.
    """
    handed = list(pass_fds)  # ours to close from here on
    settings = settings or current_settings()
    try:
        mode = resolve_mode(settings)
        checked = _check_files(code, files or {})
    except BaseException:
        _close(handed)
        raise
    workdir: Path | None = None
    cgroup: cgroups.RunCgroup | None = None
    owned: list[int] = []  # descriptors to close once the run has started
    status_r: int | None = None
    proc = None
    try:
        if mode == "bwrap":
            cgroup = cgroups.create(
                limits.memory_mb, limits.nproc, settings.total_memory_mb, settings.cgroup_parent
            )
            status_r, status_w = os.pipe()
            owned.append(status_w)
            launch, files_fds = bwrap_launch(
                settings, limits, checked, list(args), status_w, cgroup, tuple(handed)
            )
            owned += files_fds
        else:
            workdir = Path(tempfile.mkdtemp(prefix="astraflow-sbx-"))
            launch = process_launch(settings, limits, str(workdir), list(args), tuple(handed))
            _write_files(workdir, checked, launch.user)
        out, err = _Capture(limits.max_output_bytes), _Capture(limits.max_output_bytes)
        start = time.monotonic()
        try:
            proc = await _spawn(launch)
        finally:
            _close(owned)
            _close(handed)
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
        if timed_out:
            exit_code, sig = None, int(signal.SIGKILL)
        elif mode == "process":
            exit_code, sig = (None, -returncode) if returncode < 0 else (returncode, None)
        else:
            assert status_r is not None
            assert cgroup is not None
            exit_code, sig = _bwrap_status(_bwrap_exit_code(status_r), returncode, err, cgroup.oom_killed())
        reason = killed_reason(
            timed_out=timed_out, exit_code=exit_code, signal=sig, stderr_tail=err.tail_text()
        )
        if cgroup is not None and cgroup.oom_killed() and not timed_out:
            reason = "memory"
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
        _close(owned)
        _close(handed)
        if status_r is not None:
            os.close(status_r)
        if cgroup is not None:
            await asyncio.shield(cgroup.remove())
        if workdir is not None:
            shutil.rmtree(workdir, ignore_errors=True)


def _bwrap_status(
    code: int | None, returncode: int, err: _Capture, oom_killed: bool
) -> tuple[int | None, int | None]:
    """(exit code, signal) of the code under bwrap, which reports a death by signal N as 128 + N.

    No status at all means bwrap died before the code ended: the kernel's OOM killer chose it
    (the run's memory, so a result), or it never started the code (a sandbox failure, raised).
    """
    if code is None:
        if oom_killed:
            return None, int(signal.SIGKILL)
        raise SandboxError(
            f"bwrap exited ({returncode}) without starting the code: {err.tail_text().strip()[-500:]}"
        )
    if 128 < code <= 128 + 64:
        return None, code - 128
    return code, None


def run_python(
    code: str,
    *,
    files: Mapping[str, str | bytes] | None = None,
    args: Sequence[str] = (),
    limits: SandboxLimits = _DEFAULT_LIMITS,
    settings: SandboxSettings | None = None,
) -> SandboxResult:
    """Blocking form of `run_python_async`; call it from threads or scripts, not inside an event loop."""
    try:
        asyncio.get_running_loop()
    except RuntimeError:
        return asyncio.run(run_python_async(code, files=files, args=args, limits=limits, settings=settings))
    raise SandboxError(
        "run_python was called inside a running event loop; await run_python_async(...) instead"
    )
