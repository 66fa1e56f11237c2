"""Serde throughput: encode + decode of a 4,096-token trajectory, and of a task, on one core.

Compares, in the same run, AstraFlow's typed path (Trajectory -> framed bytes -> Trajectory with
zero-copy numpy arrays; Task -> bytes -> Task) against a bare fastavro round trip of the same
record as a dict (schemaless_writer/reader with the parsed schema: no framing, no typed objects,
no dict building). Usage: python bench/serde.py [--quick] [--json OUT]
"""

from __future__ import annotations

import argparse
import io
import os
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _common import write_json
from fastavro import schemaless_reader, schemaless_writer

from astraflow.records import Task, Trajectory
from astraflow.serde import AvroSerde
from astraflow.testing import make_task, make_trajectory

TERMS = {  # what the figures compare (written into the results JSON)
    "ours": "AstraFlow's typed path: record -> framed Avro bytes -> record with zero-copy numpy arrays",
    "against": "a bare fastavro round trip of the same record as a dict (schemaless_writer/reader: no framing, no typed objects)",
    "settings": "one core; a 4,096-token Trajectory and a Task; 4 s per measurement (quick 1 s)",
}


def rate(fn, seconds: float) -> float:
    n, t0 = 0, time.perf_counter()
    while (elapsed := time.perf_counter() - t0) < seconds:
        for _ in range(200):
            fn()
        n += 200
    return n / elapsed


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="1 s per measurement instead of 4")
    ap.add_argument("--json", default=None, help="where to write the figures (default bench/results/[quick/]serde.json)")
    ap.add_argument("--tokens", type=int, default=4096)
    args = ap.parse_args()
    if hasattr(os, "sched_setaffinity"):
        os.sched_setaffinity(0, {sorted(os.sched_getaffinity(0))[0]})  # one core
    secs = 1.0 if args.quick else 4.0

    serde = AvroSerde()
    traj = make_trajectory(args.tokens)
    data = serde.dumps(traj)
    task = make_task(3)
    task_data = serde.dumps(task)

    def bare_fn(record):
        parsed = serde.catalog.latest(record.SCHEMA).parsed
        datum = record.to_avro()

        def bare() -> None:
            buf = io.BytesIO()
            schemaless_writer(buf, parsed, datum)
            buf.seek(0)
            schemaless_reader(buf, parsed, None)
        return bare

    def ours() -> None:
        serde.loads(serde.dumps(traj), Trajectory)

    def ours_task() -> None:
        serde.loads(serde.dumps(task), Task)

    # Interleave repeats so machine noise hits both sides alike; report the best of each.
    bare_r, ours_r, bare_t, ours_t = [], [], [], []
    bare, bare_task = bare_fn(traj), bare_fn(task)
    for _ in range(3):
        bare_r.append(rate(bare, secs))
        ours_r.append(rate(ours, secs))
        bare_t.append(rate(bare_task, secs / 2))
        ours_t.append(rate(ours_task, secs / 2))
    b, o, bt, ot = max(bare_r), max(ours_r), max(bare_t), max(ours_t)
    passthrough = rate(lambda: serde.dumps(serde.loads(data, Trajectory)), secs)  # what reward/curate do
    enc = rate(lambda: serde.dumps(traj), secs)
    dec = rate(lambda: serde.loads(data, Trajectory), secs)
    task_dec = rate(lambda: serde.loads(task_data, Task), secs / 2)  # what a RaaS node does per task
    rows = [
        ("record", f"Trajectory, {args.tokens} tokens, {len(data):,} bytes framed"),
        ("bare fastavro round trip /s", f"{b:,.0f}"),
        ("astraflow encode /s", f"{enc:,.0f}"),
        ("astraflow decode /s", f"{dec:,.0f}"),
        ("astraflow decode + re-encode (pass-through) /s", f"{passthrough:,.0f}"),
        ("astraflow encode+decode /s", f"{o:,.0f}"),
        ("astraflow vs bare (1.0 = as fast)", f"{o / b:.2f}x"),
        ("Task: bare fastavro round trip /s", f"{bt:,.0f}"),
        ("Task: astraflow encode+decode /s", f"{ot:,.0f}"),
        ("Task: astraflow decode /s", f"{task_dec:,.0f}"),
        ("Task: astraflow vs bare", f"{ot / bt:.2f}x"),
        ("load average (1 min) at the end", f"{os.getloadavg()[0]:.2f}"),
    ]
    w = max(len(r[0]) for r in rows)
    for k, v in rows:
        print(f"{k:<{w}}  {v}")
    write_json(args.json, "serde", {
        "tokens": args.tokens, "bytes": len(data), "bare_roundtrip_per_s": b, "encode_per_s": enc,
        "decode_per_s": dec, "passthrough_per_s": passthrough, "roundtrip_per_s": o, "ratio_vs_bare": o / b,
        "task": {"bytes": len(task_data), "bare_roundtrip_per_s": bt, "roundtrip_per_s": ot, "decode_per_s": task_dec,
                 "ratio_vs_bare": ot / bt},
    }, terms=TERMS, quick=args.quick)


if __name__ == "__main__":
    main()
