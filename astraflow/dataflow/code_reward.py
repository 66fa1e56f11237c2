"""Code reward: the model's code runs against the reference's unit tests, in two sandboxes.

Reference JSON: {"tests": ["assert add(1, 2) == 3", ...], "setup": "optional code run first",
"entry_points": ["add"]} ("tests" may also be one string: a single test; "entry_points", the
solution's names the tests may use, defaults to the names the setup and tests read that are not
builtins). The model's code is `final_answer`, or the last
fenced block in it.

The solution and the tests never share an interpreter (`astraflow.sandbox.split`): the solution
runs in one sandbox and answers calls; the tests run in another, where the solution's top-level
names are proxies and every value they get back is plain data rebuilt by the tests' own
interpreter. So a solution that patches builtins, `sys.modules`, `unittest` or `json`, returns an
object whose `__eq__` always says yes, prints a fake report, exits early or with code 0 from an
atexit hook, changes nothing in the process that counts passes: only the test sandbox's report
(its stdout) is read. The setup code runs before the tests, in the tests' namespace.

Scoring is slow (two processes per trajectory): use `await reward.score_async(t)` in stream
apps; `reward(t)` blocks and suits worker threads.
"""

from __future__ import annotations

import ast
import asyncio
import builtins
import json
import re
from dataclasses import dataclass

from astraflow.dataflow.registry import register
from astraflow.dataflow.rewards import RewardResult, load_reference
from astraflow.errors import RewardError
from astraflow.records import Trajectory
from astraflow.sandbox import SandboxLimits, SandboxResult
from astraflow.sandbox.split import run_split_async

_FENCE = re.compile(r"```[ \t]*([A-Za-z0-9_+-]*)[^\n]*\n(.*?)```", re.DOTALL)

# The test sandbox's main.py. Its stdout carries only the report; what the tests print goes to stderr.
HARNESS = """\
import json
import os
import sys

report_out = os.fdopen(os.dup(1), "w")
os.dup2(2, 1)
spec = json.load(open("tests.json"))
TESTS, SETUP = spec["tests"], spec["setup"]


def report(passed, failures):
    report_out.write(json.dumps({"passed": passed, "total": len(TESTS), "failures": failures}) + "\\n")
    report_out.flush()


from _astraflow_remote import SolutionGone, connect

try:
    namespace = {"__name__": "tests", **connect(int(sys.argv[1]), int(sys.argv[2]), spec["entry_points"])}
except SolutionGone as exc:
    report(0, [str(exc)[:300]])
    sys.exit(0)
if SETUP:
    exec(compile(SETUP, "setup", "exec"), namespace)
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


def entry_points_of(sources: list[str]) -> list[str]:
    """The names the tests read and do not get from Python's builtins: what they may take from the
    solution (a test that does not parse names nothing; it fails in the sandbox and says why)."""
    names: set[str] = set()
    for src in sources:
        try:
            tree = ast.parse(src)
        except (SyntaxError, ValueError):
            continue
        names |= {n.id for n in ast.walk(tree) if isinstance(n, ast.Name) and isinstance(n.ctx, ast.Load)}
    return sorted(n for n in names if not n.startswith("__") and not hasattr(builtins, n))


def tests_spec(tests: list[str], setup: str = "", entry_points: list[str] | None = None) -> str:
    """The tests sandbox's `tests.json` for HARNESS: the tests, the setup, and the solution's names
    they may use (`entry_points`, else `entry_points_of` the setup and tests)."""
    names = sorted(entry_points) if entry_points is not None else entry_points_of([setup, *tests])
    return json.dumps({"tests": tests, "setup": setup, "entry_points": names})


def parse_report(result: SandboxResult, total: int) -> dict | None:
    """The test sandbox's report, or None unless it is one well-formed line for `total` tests."""
    lines = result.stdout.splitlines()
    if result.exit_code != 0 or len(lines) != 1:
        return None
    try:
        report = json.loads(lines[0])
    except json.JSONDecodeError:
        return None
    ok = (
        isinstance(report, dict)
        and report.get("total") == total
        and type(report.get("passed")) is int
        and 0 <= report["passed"] <= total
    )
    return report if ok else None


@register("reward", "code_tests", version=1)
@dataclass(frozen=True, slots=True)
class CodeTests:
    """1 if the model's code passes every reference test in the sandbox (or the fraction passed)."""

    partial_credit: bool = False  # reward = fraction of tests passed instead of all-or-nothing
    timeout_s: float = 10.0  # wall-clock limit of the whole run
    cpu_s: int = 5  # CPU seconds per process
    memory_mb: int = 512  # memory of each of the two runs (cgroup), and RLIMIT_AS of each process

    @property
    def limits(self) -> SandboxLimits:
        return SandboxLimits(wall_s=self.timeout_s, cpu_s=self.cpu_s, memory_mb=self.memory_mb)

    def prepare(self, trajectory: Trajectory) -> tuple[str, str, int]:
        """(solution source, tests.json content, number of tests) for one trajectory."""
        ref = load_reference(trajectory)
        tests = ref.get("tests")
        if isinstance(tests, str):
            tests = [tests]
        if not isinstance(tests, list) or not tests or not all(isinstance(t, str) for t in tests):
            raise RewardError(
                f"trajectory {trajectory.trajectory_id}: code reference needs 'tests', a non-empty list of code strings"
            )
        setup = ref.get("setup") or ""
        if not isinstance(setup, str):
            raise RewardError(f"trajectory {trajectory.trajectory_id}: code reference 'setup' must be a string")
        named = ref.get("entry_points")
        if named is not None and not (isinstance(named, list) and all(isinstance(n, str) for n in named)):
            raise RewardError(f"trajectory {trajectory.trajectory_id}: code reference 'entry_points' must be a list of names")
        code = extract_code(trajectory.final_answer or "")
        return code, tests_spec(tests, setup, named), len(tests)

    def score(self, solution: SandboxResult | None, tests: SandboxResult, total: int) -> RewardResult:
        """Reward from the finished runs (the solution's is None when it was cancelled at the end)."""
        report = parse_report(tests, total)
        passed = int(report["passed"]) if report else 0
        fraction = passed / total
        reward = fraction if self.partial_credit else float(passed == total)
        runs = [r for r in (solution, tests) if r is not None]
        return RewardResult(
            reward,
            {
                "tests_passed": float(passed),
                "tests_total": float(total),
                "pass_fraction": fraction,
                "timed_out": float(any(r.timed_out for r in runs)),
                # a limit (wall, cpu, memory, ...) ended the solution or the tests
                "killed": float(any(r.killed_reason is not None for r in runs)),
                "reported": float(report is not None),
            },
        )

    def __call__(self, trajectory: Trajectory) -> RewardResult:
        try:
            asyncio.get_running_loop()
        except RuntimeError:
            return asyncio.run(self.score_async(trajectory))
        raise RewardError("CodeTests() was called inside a running event loop; await reward.score_async(t) instead")

    async def score_async(self, trajectory: Trajectory) -> RewardResult:
        if not (trajectory.final_answer or "").strip():
            return self._no_code(trajectory)
        code, tests, total = self.prepare(trajectory)
        solution, harness = await run_split_async(
            code, HARNESS, driver_files={"tests.json": tests}, limits=self.limits
        )
        return self.score(solution, harness, total)

    def _no_code(self, trajectory: Trajectory) -> RewardResult:
        total = self.prepare(trajectory)[2]  # a bad reference is still an error
        components = {"tests_passed": 0.0, "tests_total": float(total), "pass_fraction": 0.0}
        return RewardResult(0.0, {**components, "timed_out": 0.0, "killed": 0.0, "reported": 0.0})
