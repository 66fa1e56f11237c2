"""Helpers shared by the benchmarks: the results file (figures with commit, machine, terms) and data.

A benchmark runs as `python bench/NAME.py`, so `bench/` comes first on `sys.path`: no file here
may be named like a package the benchmarks import (`stream_apps`, `trainers`, `astraflow`).
"""

from __future__ import annotations

import json
import os
import platform
import subprocess
import time
from pathlib import Path
from typing import Any

RESULTS = Path("bench/results")  # full runs: the results behind the docs' figures, committed
QUICK_RESULTS = RESULTS / "quick"  # --quick runs: git-ignored, never overwrite the full results


def machine() -> dict[str, Any]:
    """What ran the benchmark: cores, CPU model, memory and Python."""
    cpu, mem_kib = "unknown", None
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemTotal:"):
                mem_kib = int(line.split()[1])
                break
    except (OSError, ValueError):
        pass
    return {"cores": os.cpu_count(), "cpu": cpu, "memory_gib": round(mem_kib / 2**20, 1) if mem_kib else None,
            "python": platform.python_version()}


# What a benchmark runs: a change outside these (docs, results, scripts) does not make a result "+dirty".
CODE_PATHS = ("astraflow", "astraflow_cli", "stream_apps", "trainers", "bench", ":(exclude)bench/results", "schemas",
              "pyproject.toml")


def process_age_s() -> float | None:
    """Seconds since this process started (Linux /proc; None elsewhere): a benchmark's wall time."""
    try:
        start_ticks = int(Path("/proc/self/stat").read_text().rsplit(")", 1)[1].split()[19])  # field 22, starttime
        return round(float(Path("/proc/uptime").read_text().split()[0]) - start_ticks / os.sysconf("SC_CLK_TCK"), 1)
    except (OSError, ValueError, IndexError):
        return None


def commit() -> str:
    """`git rev-parse HEAD` of the code that ran, with "+dirty" when that code had uncommitted changes."""
    def git(*args: str) -> str:
        try:
            return subprocess.run(["git", *args], capture_output=True, text=True, check=True).stdout.strip()
        except (OSError, subprocess.CalledProcessError):
            return ""

    head = git("rev-parse", "HEAD") or "unknown"
    return head + ("+dirty" if git("status", "--porcelain", "--untracked-files=no", "--", *CODE_PATHS) else "")


def write_json(path: str | None, name: str, figures: dict[str, Any], *, terms: dict[str, str], quick: bool) -> Path:
    """Write a benchmark's figures with what they need to be trusted: the code (`commit`), the
    `machine`, the `terms` of the comparison (the benchmark's TERMS: what against what, on what
    settings) and whether it was a `--quick` run. Default path: bench/results/NAME.json for a full
    run, bench/results/quick/NAME.json for a quick one. Benchmarks with seeds put their per-seed
    values in `figures` (key `per_seed`)."""
    if not {"ours", "against", "settings"} <= set(terms):
        raise ValueError(f"{name}: terms need 'ours', 'against' and 'settings', got {sorted(terms)}")
    out = Path(path) if path else (QUICK_RESULTS if quick else RESULTS) / f"{name}.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    head = {"benchmark": name, "commit": commit(), "machine": machine(), "terms": terms, "quick": bool(quick),
            "when": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()), "wall_s": process_age_s(),
            "load_avg_1m": round(os.getloadavg()[0], 2) if hasattr(os, "getloadavg") else None}
    out.write_text(json.dumps({**head, **figures}, indent=2) + "\n")
    print(f"wrote {out}")
    return out


def trajectories(n: int, tokens: int, group_size: int) -> list[Any]:
    """n distinct Trajectories in groups of `group_size` (own random tokens each, so compression
    sees realistic data), half of them with the right answer so curate keeps every group."""
    from astraflow.testing import make_trajectory

    out = []
    for i in range(n):
        g = i // group_size
        t = make_trajectory(tokens, task_id=f"t{g}", sample_index=i % group_size, group_size=group_size, seed=i)
        t.group_id, t.prompt_id, t.reference = f"g{g}", f"p{g % 97}", '{"answer": "4"}'
        t.final_answer = "4" if i % 2 == 0 else "5"
        out.append(t)
    return out


def stream_args(ap: Any, name: str, what: str) -> tuple[Any, int, int, Any]:
    """The options of the Kafka throughput benchmarks; returns (args, records, repeats, KafkaSettings)."""
    from astraflow.config import KafkaSettings

    ap.add_argument("--quick", action="store_true", help=f"512 {what} instead of 2,048, one repeat")
    ap.add_argument("--json", default=None, help=f"where to write the figures (default bench/results/{name}.json)")
    ap.add_argument("--records", type=int, default=None)
    ap.add_argument("--tokens", type=int, default=4096)
    ap.add_argument("--group-size", type=int, default=8)
    ap.add_argument("--repeats", type=int, default=None, help="runs of each side, best counts (default 3, quick 1)")
    ap.add_argument("--bootstrap", default=None, help="Kafka bootstrap servers (default: the local broker)")
    args = ap.parse_args()
    n = args.records or (512 if args.quick else 2048)
    n -= n % args.group_size
    repeats = args.repeats or (1 if args.quick else 3)
    kafka = KafkaSettings(bootstrap_servers=args.bootstrap) if args.bootstrap else KafkaSettings()
    return args, n, repeats, kafka


def print_rows(rows: list[tuple[str, Any]]) -> None:
    """A two-column table: label, figure."""
    w = max(len(r[0]) for r in rows)
    for k, v in rows:
        print(f"{k:<{w}}  {v}")


def produce_blocking(producer: Any, topic: str, value: bytes, key: Any) -> None:
    """`producer.produce`, waiting for room while librdkafka's queue is full."""
    while True:
        try:
            producer.produce(topic, value, key)
            return
        except BufferError:
            producer.poll(0.05)
