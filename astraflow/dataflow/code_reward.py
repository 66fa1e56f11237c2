"""Code reward: the model's code runs against the reference's unit tests in the sandbox.

Reference JSON: {"tests": ["assert add(1, 2) == 3", ...], "setup": "optional code run first"}
("tests" may also be one string: a single test). The model's code is `final_answer`, or the last
fenced block in it. A harness loads the solution, runs every test in its namespace, and prints a
report line tagged with a random nonce; no valid report (the solution exited, crashed the
interpreter, or ran out of time) means nothing passed, so `sys.exit(0)` in the solution earns
nothing. The nonce stops accidental and simple forgeries; a policy that deliberately inspects the
harness's frames could still forge one, so watch the pass rate for jumps that the tests cannot
explain.

Scoring is slow (a process per trajectory): use `await reward.score_async(t)` in stream apps;
`reward(t)` blocks and suits worker threads.
"""

from __future__ import annotations

import json
import re
import secrets
from dataclasses import dataclass

from astraflow.dataflow.registry import register
from astraflow.dataflow.rewards import RewardResult, load_reference
from astraflow.errors import RewardError
from astraflow.records import Trajectory
from astraflow.sandbox import SandboxLimits, SandboxResult, run_python, run_python_async

_FENCE = re.compile(r"```[ \t]*([A-Za-z0-9_+-]*)[^\n]*\n(.*?)```", re.DOTALL)

_HARNESS = """\
import json
import sys

NONCE = {nonce!r}
TESTS = json.loads({tests!r})
SETUP = {setup!r}


def report(passed, failures):
    print("\\n" + NONCE + json.dumps({{"passed": passed, "total": len(TESTS), "failures": failures}}), flush=True)


namespace = {{"__name__": "solution"}}
try:
    with open("solution.py") as f:
        exec(compile(f.read(), "solution.py", "exec"), namespace)
    if SETUP:
        exec(compile(SETUP, "setup", "exec"), namespace)
except BaseException as exc:  # SystemExit too: the solution must not end the harness
    report(0, ["solution failed to load: %s: %s" % (type(exc).__name__, exc)])
    sys.exit(1)
passed, failures = 0, []
for i, test in enumerate(TESTS):
    try:
        exec(compile(test, "test_%d" % i, "exec"), namespace)
        passed += 1
    except BaseException as exc:
        failures.append("test %d: %s: %s" % (i, type(exc).__name__, str(exc)[:200]))
report(passed, failures[:20])
"""


def extract_code(text: str) -> str:
    """The last ```python block of `text`, else its last fenced block, else the whole text."""
    blocks = _FENCE.findall(text)
    if not blocks:
        return text
    python = [body for lang, body in blocks if lang.lower() in ("python", "py", "python3")]
    return (python or [body for _, body in blocks])[-1]


def build_harness(tests: list[str], setup: str, nonce: str) -> str:
    """Source of the harness main.py that runs `tests` against solution.py."""
    return _HARNESS.format(nonce=nonce, tests=json.dumps(tests), setup=setup)


def parse_report(result: SandboxResult, nonce: str) -> dict | None:
    """The harness's report from the run's stdout, or None if it never printed a valid one."""
    for line in reversed(result.stdout.splitlines()):
        if line.startswith(nonce):
            try:
                report = json.loads(line[len(nonce) :])
            except json.JSONDecodeError:
                return None
            return report if isinstance(report, dict) else None
    return None


@register("reward", "code_tests", version=1)
@dataclass(frozen=True, slots=True)
class CodeTests:
    """1 if the model's code passes every reference test in the sandbox (or the fraction passed)."""

    partial_credit: bool = False  # reward = fraction of tests passed instead of all-or-nothing
    timeout_s: float = 10.0  # wall-clock limit of the whole run
    cpu_s: int = 5  # CPU seconds per process
    memory_mb: int = 512  # address-space limit per process

    @property
    def limits(self) -> SandboxLimits:
        return SandboxLimits(wall_s=self.timeout_s, cpu_s=self.cpu_s, memory_mb=self.memory_mb)

    def prepare(self, trajectory: Trajectory) -> tuple[str, dict[str, str], str, int]:
        """(harness source, files, nonce, number of tests) for one trajectory."""
        ref = load_reference(trajectory)
        tests = ref.get("tests")
        if isinstance(tests, str):
            tests = [tests]
        if not isinstance(tests, list) or not tests or not all(isinstance(t, str) for t in tests):
            raise RewardError(
                f"trajectory {trajectory.trajectory_id}: code reference needs 'tests', a non-empty list of code strings"
            )
        setup = ref.get("setup") or ""
        nonce = "@@astraflow-report-" + secrets.token_hex(16) + "@@"
        code = extract_code(trajectory.final_answer or "")
        return build_harness(tests, str(setup), nonce), {"solution.py": code}, nonce, len(tests)

    def score(self, result: SandboxResult, nonce: str, total: int) -> RewardResult:
        """Reward from a finished run."""
        report = parse_report(result, nonce)
        passed = int(report["passed"]) if report and report.get("total") == total else 0
        fraction = passed / total
        reward = fraction if self.partial_credit else float(passed == total)
        return RewardResult(
            reward,
            {
                "tests_passed": float(passed),
                "tests_total": float(total),
                "pass_fraction": fraction,
                "timed_out": float(result.timed_out),
                "killed": float(result.killed_reason is not None),  # a limit (wall, cpu, memory, ...) ended it
                "reported": float(report is not None),
            },
        )

    def __call__(self, trajectory: Trajectory) -> RewardResult:
        if not (trajectory.final_answer or "").strip():
            return self._no_code(trajectory)
        main, files, nonce, total = self.prepare(trajectory)
        return self.score(run_python(main, files=files, limits=self.limits), nonce, total)

    async def score_async(self, trajectory: Trajectory) -> RewardResult:
        if not (trajectory.final_answer or "").strip():
            return self._no_code(trajectory)
        main, files, nonce, total = self.prepare(trajectory)
        return self.score(await run_python_async(main, files=files, limits=self.limits), nonce, total)

    def _no_code(self, trajectory: Trajectory) -> RewardResult:
        total = self.prepare(trajectory)[3]  # a bad reference is still an error
        components = {"tests_passed": 0.0, "tests_total": float(total), "pass_fraction": 0.0}
        return RewardResult(0.0, {**components, "timed_out": 0.0, "killed": 0.0, "reported": 0.0})
