"""Per-run cost of the code sandbox: bubblewrap + seccomp + cgroups vs the `unshare` sandbox it replaced.

Both run in this one process, on the same programs; the sequential runs take turns (old, new,
weak, old, ...) so that each sees the same machine load. The old implementation is taken from git (the parent of the commit that deleted
`astraflow/sandbox/_nsinit.py`, or `--old-ref`), copied into a temporary package and imported
beside the new one.

Figures (seconds, median and p90 over `--runs` sequential runs, plus runs per second with
`--concurrency` at once):

* `run:<impl>`: `run_python("print(sum(range(1000)))")`, one sandboxed interpreter;
* `reward:<impl>`: `CodeTests.score_async` on a correct 3-test solution: the old reward runs
  solution and tests in one sandboxed interpreter; the new one runs two sandboxes joined by a
  pipe (so its cost is about two runs);
* `run:weak` for scale: the new code in the opted-in weak process mode (no namespaces: about
  the cost of starting the interpreter; as root it needs an interpreter other users can read,
  `--weak-python`, the system one by default).

Usage: python bench/sandbox.py [--runs 20] [--concurrency 8] [--json OUT] [--old-ref REV]
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import importlib
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import _common

TERMS = {  # what the figures compare (written into the results JSON)
    "ours": "the bubblewrap + seccomp + cgroups sandbox",
    "against": "the unshare sandbox it replaced (taken from git), and the weak process mode for scale",
    "settings": "the same programs, sequential runs taking turns, and --concurrency runs at once",
}


ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from astraflow.dataflow.code_reward import CodeTests  # noqa: E402
from astraflow.sandbox import SandboxLimits, SandboxSettings, run_python_async  # noqa: E402
from astraflow.testing import make_trajectory  # noqa: E402

PROGRAM = "print(sum(range(1000)))"
SOLUTION = "def add(a, b):\n    return a + b\n"
REFERENCE = json.dumps({"tests": ["assert add(1, 2) == 3", "assert add(-1, 1) == 0", "assert add(2, 2) == 4"]})
LIMITS = SandboxLimits(wall_s=20, cpu_s=10, memory_mb=256)


def old_ref(arg: str | None) -> str:
    if arg:
        return arg
    out = subprocess.run(
        ["git", "log", "-1", "--format=%H", "--diff-filter=D", "--", "astraflow/sandbox/_nsinit.py"],
        cwd=ROOT, capture_output=True, text=True, check=True,
    ).stdout.strip()
    if not out:
        raise SystemExit("cannot find the commit that deleted _nsinit.py; pass --old-ref")
    return out + "^"


def load_old(ref: str, into: Path) -> tuple[Any, Any]:
    """(old sandbox package, old code_reward module), imported as `old_sandbox` / `old_code_reward`."""
    pkg = into / "old_sandbox"
    pkg.mkdir()
    names = subprocess.run(
        ["git", "ls-tree", "--name-only", ref, "astraflow/sandbox/"], cwd=ROOT, capture_output=True, text=True, check=True
    ).stdout.split()
    for name in names:
        text = subprocess.run(["git", "show", f"{ref}:{name}"], cwd=ROOT, capture_output=True, text=True, check=True).stdout
        (pkg / Path(name).name).write_text(text.replace("astraflow.sandbox", "old_sandbox"))
    reward = subprocess.run(
        ["git", "show", f"{ref}:astraflow/dataflow/code_reward.py"], cwd=ROOT, capture_output=True, text=True, check=True
    ).stdout
    reward = reward.replace("astraflow.sandbox", "old_sandbox").replace('@register("reward", "code_tests", version=1)\n', "")
    (into / "old_code_reward.py").write_text(reward)
    sys.path.insert(0, str(into))
    return importlib.import_module("old_sandbox"), importlib.import_module("old_code_reward")


async def timed(cases: dict[str, Any], runs: int, concurrency: int) -> dict[str, dict[str, float]]:
    """Per case: median and p90 latency of sequential calls (cases taking turns), then
    throughput with `concurrency` calls at once (one case after the other)."""
    lat: dict[str, list[float]] = {name: [] for name in cases}
    for _ in range(runs):
        for name, make in cases.items():
            t = time.perf_counter()
            await make()
            lat[name].append(time.perf_counter() - t)
    out = {}
    for name, make in cases.items():
        sem = asyncio.Semaphore(concurrency)

        async def one(make: Any = make, sem: asyncio.Semaphore = sem) -> None:
            async with sem:
                await make()

        t = time.perf_counter()
        await asyncio.gather(*(one() for _ in range(runs)))
        xs = sorted(lat[name])
        out[name] = {"median_s": statistics.median(xs), "p90_s": xs[int(0.9 * (len(xs) - 1))],
                     "per_s_concurrent": runs / (time.perf_counter() - t)}
    return out


def checked(result: Any, what: str) -> Any:
    if not result.ok:
        raise SystemExit(f"{what} failed: {result.stderr[-500:]}")
    return result


async def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--runs", type=int, default=20)
    ap.add_argument("--concurrency", type=int, default=8)
    ap.add_argument("--json", default=None, help="where to write the figures (default bench/results/sandbox.json)")
    ap.add_argument("--old-ref", default=None, help="git revision of the old sandbox (default: before _nsinit.py was deleted)")
    ap.add_argument("--weak-python", default="/usr/bin/python3", help="interpreter of the weak-mode case")
    args = ap.parse_args()
    ref = old_ref(args.old_ref)
    strict = SandboxSettings()
    # the weak mode as root needs an interpreter its own uid can read: the system one
    weak = SandboxSettings(allow_weak_isolation=True, bwrap="/nonexistent/bwrap", python=args.weak_python)
    traj = dataclasses.replace(make_trajectory(), final_answer=SOLUTION, reference=REFERENCE)
    with tempfile.TemporaryDirectory(prefix="astraflow-bench-old-") as tmp:
        old, old_reward = load_old(ref, Path(tmp))
        old_limits = old.SandboxLimits(wall_s=20, cpu_s=10, memory_mb=256, isolation="namespaces")
        new_reward, old_reward_fn = CodeTests(timeout_s=20, cpu_s=10, memory_mb=256), old_reward.CodeTests(timeout_s=20, cpu_s=10, memory_mb=256)

        async def reward_new() -> None:
            assert (await new_reward.score_async(traj)).reward == 1.0

        async def reward_old() -> None:
            assert (await old_reward_fn.score_async(traj)).reward == 1.0

        cases = {
            "run:old-unshare": lambda: old.run_python_async(PROGRAM, limits=old_limits),
            "run:new-bwrap": lambda: run_python_async(PROGRAM, limits=LIMITS, settings=strict),
            "run:weak": lambda: run_python_async(PROGRAM, limits=LIMITS, settings=weak),
        }
        for name, make in cases.items():  # warm up, and check each works here
            r = checked(await make(), name)
            print(f"{name}: isolation={r.isolation}")
        figures: dict[str, Any] = await timed(cases, args.runs, args.concurrency)
        rewards = {"reward:old-one-sandbox": reward_old, "reward:new-two-sandboxes": reward_new}
        figures.update(await timed(rewards, args.runs, args.concurrency))
    over = figures["run:new-bwrap"]["median_s"] - figures["run:old-unshare"]["median_s"]
    figures["new_minus_old_run_median_s"] = over
    rows = [(k, f"median {v['median_s'] * 1000:.0f} ms, p90 {v['p90_s'] * 1000:.0f} ms, "
                f"{v['per_s_concurrent']:.1f}/s at {args.concurrency} at once") for k, v in figures.items() if isinstance(v, dict)]
    rows.append(("new - old, per run (median)", f"{over * 1000:+.0f} ms"))
    rows.append(("load average (1 min) at the end", f"{os.getloadavg()[0]:.1f} on {os.cpu_count()} cores"))
    _common.print_rows(rows)
    _common.write_json(args.json, "sandbox", {"runs": args.runs, "concurrency": args.concurrency, "old_ref": ref,
                                              "program": PROGRAM, "figures": figures}, terms=TERMS, quick=False)


if __name__ == "__main__":
    asyncio.run(main())
