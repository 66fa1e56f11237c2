"""Reward of the `coder_tester` workflow: the coder's function and the tester's asserts, run in the sandbox.

Reference JSON (a `code` dataset row): {"tests": [hidden asserts], "solution": "reference code"}.
Three split runs (`astraflow.sandbox.split`: the code in one sandbox, the tests in another),
concurrently: the coder's code against the hidden tests; the tester's asserts against the
reference solution; the tester's asserts against the coder's code.

* **coder**: 1 if its code passes every hidden test, else 0 (as `code_tests`).
* **tester**: the share of its asserts that hold for the reference solution (a test that
  fails on the right code is wrong), plus `catch_bonus` when the coder's code is wrong and one
  of those valid asserts fails on it (the tests caught the bug). No asserts: 0.

Each policy's reward is its component `policy.<name>`; the trajectory's `reward` is the
coder's. Metadata the workflow could not have written (coder or tester not among the
trajectory's policies, the same policy twice, `tests` not a JSON list of at most 8 strings)
raises `RewardError` (dead letter).
"""

from __future__ import annotations

import asyncio
import json
import re
from dataclasses import dataclass

from astraflow.dataflow.code_reward import HARNESS, extract_code, parse_report, tests_spec
from astraflow.dataflow.registry import register
from astraflow.dataflow.rewards import RewardResult, load_reference
from astraflow.errors import RewardError
from astraflow.records import Trajectory
from astraflow.sandbox import SandboxLimits
from astraflow.sandbox.split import run_split_async

MAX_TESTS, MAX_TEST_CHARS = 8, 1000
_FAILED = re.compile(r"test (\d+):")


def coder_tester_inputs(trajectory: Trajectory) -> tuple[str, str, list[str], list[str], str]:
    """(coder, tester, the tester's asserts, the hidden tests, the reference solution), validated."""
    meta, tid = trajectory.metadata, trajectory.trajectory_id
    policies = {seg.policy for seg in trajectory.segments}
    coder, tester = meta.get("coder", ""), meta.get("tester", "")
    if coder not in policies or tester not in policies or coder == tester:
        raise RewardError(f"trajectory {tid}: metadata coder={coder[:80]!r} tester={tester[:80]!r} must name two "
                          "policies of its segments; is it from the coder_tester workflow?")
    try:
        tests = json.loads(meta.get("tests", "[]"))
    except json.JSONDecodeError as exc:
        raise RewardError(f"trajectory {tid}: metadata 'tests' is not JSON ({exc})") from exc
    if (not isinstance(tests, list) or len(tests) > MAX_TESTS
            or not all(isinstance(t, str) and len(t) <= MAX_TEST_CHARS for t in tests)):
        raise RewardError(f"trajectory {tid}: metadata 'tests' must be a list of at most {MAX_TESTS} strings "
                          f"of at most {MAX_TEST_CHARS} characters")
    ref = load_reference(trajectory)
    hidden, solution = ref.get("tests"), ref.get("solution")
    if isinstance(hidden, str):
        hidden = [hidden]
    if not isinstance(hidden, list) or not hidden or not all(isinstance(t, str) for t in hidden) or not isinstance(solution, str):
        raise RewardError(f"trajectory {tid}: the coder_tester reward needs a reference with 'tests' (a non-empty list "
                          "of asserts) and 'solution' (the reference code)")
    return coder, tester, tests, hidden, solution


@register("reward", "coder_tester", version=1)
@dataclass(frozen=True, slots=True)
class CoderTester:
    """Per-policy rewards of the coder_tester workflow (see the module doc)."""

    catch_bonus: float = 0.5  # extra tester reward when its valid tests fail the coder's wrong code
    timeout_s: float = 10.0  # wall-clock limit of each run
    cpu_s: int = 5  # CPU seconds per process
    memory_mb: int = 512  # memory of each process

    async def _run(self, code: str, tests: list[str]) -> tuple[int, set[int]]:
        """(tests passed, indexes of the tests that failed); a run without a report failed them all."""
        _, harness = await run_split_async(code, HARNESS, driver_files={"tests.json": tests_spec(tests)},
                                           limits=SandboxLimits(wall_s=self.timeout_s, cpu_s=self.cpu_s,
                                                                memory_mb=self.memory_mb))
        report = parse_report(harness, len(tests))
        if report is None:
            return 0, set(range(len(tests)))
        failed = {int(m.group(1)) for f in report.get("failures", []) if isinstance(f, str) and (m := _FAILED.match(f))}
        return int(report["passed"]), {i for i in failed if 0 <= i < len(tests)}

    async def score_async(self, trajectory: Trajectory) -> RewardResult:
        coder, tester, tests, hidden, solution = coder_tester_inputs(trajectory)
        code = extract_code(trajectory.final_answer or "")
        runs = [self._run(code, hidden)]
        if tests:
            runs += [self._run(solution, tests), self._run(code, tests)]
        results = await asyncio.gather(*runs)
        passed_hidden = results[0][0]
        correct = float(bool(code.strip()) and passed_hidden == len(hidden))
        valid: set[int] = set()
        caught = 0.0
        if tests:
            valid = set(range(len(tests))) - results[1][1]
            caught = float(not correct and bool(valid & results[2][1]))
        valid_share = len(valid) / len(tests) if tests else 0.0
        tester_reward = valid_share + self.catch_bonus * caught
        return RewardResult(correct, {
            f"policy.{coder}": correct, f"policy.{tester}": tester_reward, "hidden_passed": float(passed_hidden),
            "hidden_total": float(len(hidden)), "tests_written": float(len(tests)), "tests_valid": float(len(valid)),
            "caught": caught,
        })

    def __call__(self, trajectory: Trajectory) -> RewardResult:
        try:
            asyncio.get_running_loop()
        except RuntimeError:
            return asyncio.run(self.score_async(trajectory))
        raise RewardError("CoderTester() was called inside a running event loop; await reward.score_async(t) instead")
