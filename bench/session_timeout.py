"""Paired measurement: how long a task waits after its node's kill -9, per consumer session timeout.

    python bench/session_timeout.py                      # 45 s (librdkafka's default) then 6 s (ours)
    python bench/session_timeout.py --sessions 45,6,3 --kills 2 --phase-s 40

A dead node's partitions stay with it until the group coordinator gives up on its heartbeats
(`kafka.group_session_timeout_s`); only then does a rebalance hand its uncommitted tasks to a
live node. For each session value of the nodes (the stream apps keep theirs: Faust refuses a
session above its 40 s request timeout), one after the other in this one run, the fault harness
(`bench/faults.py`, its own broker) runs the `kill-nodes` phase: every node is killed `--kills`
times while tasks flow, and every task issued up to 30 s after a kill is timed from the later of
its issue and the kill to its first trajectory. Reported: the longest such wait per kill, and
whether the phase lost or trained anything twice (it must not, whatever the session).
"""

from __future__ import annotations

import argparse
import shutil
import sys
from dataclasses import asdict

from _common import write_json
from _harness import Harness
from faults import parse_args

TERMS = {  # what the figures compare (written into the results JSON)
    "ours": "the nodes' consumer session timeout of AstraFlow's config",
    "against": "librdkafka's default session timeout (45 s)",
    "settings": "the fault harness's kill-nodes phase, each node killed --kills times, one after the other",
}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--sessions", default="45,6", help="session timeouts to compare, seconds, comma-separated")
    ap.add_argument("--kills", type=int, default=2, help="kills of each node")
    ap.add_argument("--phase-s", type=float, default=40.0)
    ap.add_argument("--port", type=int, default=22200)
    ap.add_argument("--json", default=None, help="default bench/results/session_timeout.json")
    a = ap.parse_args(argv)
    rows, runs = [], []
    for session in (float(s) for s in a.sessions.split(",")):
        args = parse_args(["--only", "kill-nodes", "--session-s", f"{session:g}", "--kills", str(a.kills),
                           "--phase-s", f"{a.phase_s:g}", "--port", str(a.port), "--drain-idle-s", "30"])
        report = Harness(args).run()
        waits = [f["task_wait_s"] for r in report.phases for f in r.faults if f.get("task_wait_s") is not None]
        t = report.totals
        rows.append((session, waits, t["tasks_issued"], t["lost"], t["trained_twice"], report.clean))
        runs.append({"session_s": session, "task_waits_s": waits, **asdict(report)})
        if report.clean:
            shutil.rmtree(report.settings["work_dir"], ignore_errors=True)
        else:
            print(f"kept for a look: {report.settings['work_dir']}")
    print(f"{'session s':>9}  {'kills':>5}  {'task wait s (each kill)':<40}  {'max':>5}  issued  lost  twice  clean")
    for session, waits, issued, lost, twice, clean in rows:
        shown = ", ".join(f"{w:.1f}" for w in waits)
        top = f"{max(waits):.1f}" if waits else "-"
        print(f"{session:>9g}  {len(waits):>5}  {shown:<40}  {top:>5}  {issued:>6}  {lost:>4}  {twice:>5}  {clean}")
    write_json(a.json, "session_timeout", {"runs": runs}, terms=TERMS, quick=False)
    return 0 if all(r[-1] for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
