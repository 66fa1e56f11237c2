"""Helpers shared by the benchmarks: machine description and JSON output.

Importing this module also takes the `bench/` folder off `sys.path`: `bench/stream_apps.py` is
named like the `stream_apps` package, and a benchmark run as `python bench/NAME.py` would
otherwise import that script instead of the package.
"""

from __future__ import annotations

import json
import os
import platform
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

_HERE = Path(__file__).resolve().parent
sys.path[:] = [p for p in sys.path if Path(p or ".").resolve() != _HERE]


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
