"""Helpers shared by the benchmarks: machine description and JSON output.

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


def machine() -> dict[str, Any]:
    cpu = "unknown"
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    try:
        commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True).stdout.strip()
    except OSError:
        commit = ""
    return {"cpu": cpu, "cores": os.cpu_count(), "python": platform.python_version(), "commit": commit,
            "when": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())}


def write_json(path: str | None, name: str, figures: dict[str, Any]) -> None:
    out = Path(path) if path else Path("bench/results") / f"{name}.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps({"benchmark": name, "machine": machine(), **figures}, indent=2) + "\n")
    print(f"wrote {out}")
