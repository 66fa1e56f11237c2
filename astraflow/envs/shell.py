"""Operating-system environment: a task in a sandboxed shell, checked by a script at the end.

The task's reference gives the starting files and the check (`{"files": {"data/log.txt":
"..."}, "check": "test \\"$ANSWER\\" = 3"}`). The agent's `bash` tool runs one command with
`/bin/sh -c` in `astraflow.sandbox` (bubblewrap + seccomp: no network, no host files, limits):
each command gets a fresh sandbox holding the rollout's files, and the files it leaves become
the next command's (`ShellState`, bounded to `MAX_STATE_BYTES` in `MAX_FILES` files). When the
agent stops, the check script runs the same way, with the agent's final answer in `$ANSWER`;
the task is solved when it exits 0. The check's exit status is the sandbox run's own, so
nothing the agent left behind can print a fake verdict.
"""

from __future__ import annotations

import base64
import json
from dataclasses import dataclass, field
from pathlib import PurePosixPath
from typing import Any

from astraflow.errors import AstraflowError
from astraflow.sandbox import SandboxLimits, run_python_async

MAX_FILES = 200  # files the state keeps
MAX_STATE_BYTES = 256 * 1024  # bytes of all files together
MAX_OUTPUT_CHARS = 4000  # of a command's output shown to the agent
HOME = "home"  # the agent's directory inside the sandbox's working directory

# main.py of a command run: the command runs in ./home; the files it leaves are reported on stdout.
_RUNNER = """\
import base64, json, os, subprocess, sys
spec = json.load(open("shell.json"))
os.makedirs("home", exist_ok=True)
for d in spec["dirs"]:
    os.makedirs(os.path.join("home", d), exist_ok=True)
for rel, mode in spec["modes"].items():
    os.chmod(os.path.join("home", rel), mode)
os.remove("shell.json")
env = {"PATH": "/usr/bin:/bin", "HOME": os.path.abspath("home"), "LANG": "C.UTF-8"}
try:
    p = subprocess.run(["/bin/sh", "-c", spec["command"]], cwd="home", env=env, stdin=subprocess.DEVNULL,
                       stdout=subprocess.PIPE, stderr=subprocess.STDOUT, timeout=spec["timeout"])
    code, out = p.returncode, p.stdout[-spec["max_output"]:]
except subprocess.TimeoutExpired as exc:
    code, out = None, (exc.stdout or b"")[-spec["max_output"]:] + b"\\n[command timed out]"
files, dirs, modes, total, dropped = {}, [], {}, 0, 0
for root, ds, fs in os.walk("home"):
    for d in ds:
        rel = os.path.relpath(os.path.join(root, d), "home")
        if not os.path.islink(os.path.join(root, d)):
            dirs.append(rel)
    for f in fs:
        path = os.path.join(root, f)
        rel = os.path.relpath(path, "home")
        if os.path.islink(path) or not os.path.isfile(path):
            dropped += 1
            continue
        size = os.path.getsize(path)
        if len(files) >= spec["max_files"] or total + size > spec["max_bytes"]:
            dropped += 1
            continue
        files[rel] = base64.b64encode(open(path, "rb").read()).decode()
        modes[rel] = os.stat(path).st_mode & 0o777
        total += size
print(json.dumps({"code": code, "output": out.decode("utf-8", "replace"), "files": files, "dirs": dirs,
                  "modes": modes, "dropped": dropped}))
"""

# main.py of the check: exec'd into the check script, so the run's exit status is the verdict.
_CHECK = """\
import json, os
spec = json.load(open("shell.json"))
os.makedirs("home", exist_ok=True)
for d in spec["dirs"]:
    os.makedirs(os.path.join("home", d), exist_ok=True)
os.remove("shell.json")
os.chdir("home")
os.execve("/bin/sh", ["sh", "-c", spec["command"]],
          {"PATH": "/usr/bin:/bin", "HOME": os.getcwd(), "LANG": "C.UTF-8", "ANSWER": spec["answer"]})
"""


class ShellSpecError(AstraflowError):
    """Raised when an OS task's reference (files, check) is malformed or over its limits."""


@dataclass
class ShellState:
    """The files of one rollout's shell, carried from one sandbox run to the next."""

    files: dict[str, bytes] = field(default_factory=dict)  # path under home -> content
    dirs: list[str] = field(default_factory=list)  # directories (empty ones included)
    modes: dict[str, int] = field(default_factory=dict)  # path -> permission bits

    @classmethod
    def from_reference(cls, ref: dict[str, Any]) -> ShellState:
        files = ref.get("files", {})
        if not isinstance(files, dict) or len(files) > MAX_FILES:
            raise ShellSpecError(f"files must map at most {MAX_FILES} relative paths to text")
        out: dict[str, bytes] = {}
        for name, text in files.items():
            rel = PurePosixPath(str(name))
            if rel.is_absolute() or not rel.parts or ".." in rel.parts or not isinstance(text, str):
                raise ShellSpecError(f"file {str(name)[:80]!r} must be a relative path inside home, with text")
            out["/".join(rel.parts)] = text.encode()
        if sum(len(v) for v in out.values()) > MAX_STATE_BYTES:
            raise ShellSpecError(f"the files hold more than {MAX_STATE_BYTES} bytes")
        return cls(out)

    def sandbox_files(self, command: str, extra: dict[str, Any]) -> dict[str, bytes]:
        spec = {"command": command, "dirs": self.dirs, "modes": {k: v for k, v in self.modes.items() if k in self.files},
                **extra}
        return {"shell.json": json.dumps(spec).encode(), **{f"{HOME}/{k}": v for k, v in self.files.items()}}


def _limits(wall_s: float) -> SandboxLimits:
    return SandboxLimits(wall_s=wall_s + 5, cpu_s=max(1, int(wall_s)), memory_mb=256, disk_mb=16,
                         max_output_bytes=1024 * 1024)  # the files come back base64 on stdout


async def run_command(state: ShellState, command: str, *, timeout_s: float = 5.0) -> tuple[str, ShellState]:
    """Runs `command` on `state`'s files; (what the agent sees, the files it left)."""
    extra = {"timeout": timeout_s, "max_output": MAX_OUTPUT_CHARS, "max_files": MAX_FILES, "max_bytes": MAX_STATE_BYTES}
    res = await run_python_async(_RUNNER, files=state.sandbox_files(command, extra), limits=_limits(timeout_s))
    try:
        report = json.loads(res.stdout.splitlines()[-1])
        new = ShellState({k: base64.b64decode(v) for k, v in report["files"].items()}, list(report["dirs"]),
                         {k: int(v) for k, v in report["modes"].items()})
    except (IndexError, ValueError, KeyError, TypeError, AttributeError):
        reason = res.killed_reason or f"exit code {res.exit_code}"
        return f"[the shell failed ({reason}); the files are unchanged]\n{res.stderr[-500:]}", state
    note = f"\n[{report['dropped']} files over the limits were not kept]" if report["dropped"] else ""
    code = "timed out" if report["code"] is None else f"exit code {report['code']}"
    return f"{report['output'].rstrip()}{note}\n[{code}]".strip(), new


async def run_check(state: ShellState, check: str, answer: str, *, timeout_s: float = 10.0) -> tuple[bool, str]:
    """(passed, what the check printed) for the final state and the agent's answer."""
    res = await run_python_async(_CHECK, files=state.sandbox_files(check, {"answer": answer[:10_000]}),
                                 limits=_limits(timeout_s))
    return res.exit_code == 0 and not res.timed_out, (res.stdout + res.stderr)[-500:]


__all__ = ["ShellSpecError", "ShellState", "run_check", "run_command"]
