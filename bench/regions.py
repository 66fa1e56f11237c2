"""Across regions and mixed hardware: the learning pipeline with local nodes, a region-B node behind
a simulated WAN, nodes of different speeds (CPU quotas); nodes leaving and joining.

Setup (all real, on this machine): our own one-node Kafka (`--port`, default 27092) with a second
listener advertised through Toxiproxy (`astraflow.kafka.wan`: `--latency-ms` each way,
`--rate-kb-s` per connection and direction), the demo's roles (curator, reward, curate, trainer
publishing bf16 weights: every version a delta in the stream, a snapshot every `--snapshot-every`
versions beside it, which only joining nodes read) and
three RaaS nodes with the same settings and no per-node share: `raas-a1` and `raas-a2` (region A)
and `raas-b1` (region B: it bootstraps at the proxy, so tasks, weights and rollouts all cross the
WAN). Each node's speed is its CPU quota (`--node-cpus`: 0.3, 0.15 and 0.25 cores, each in a cgroup
with a high weight so it gets its quota however loaded the machine is), like accelerators of
different models: a node is as fast in the busy mixed phase as it was alone, and the rest of the
machine is left to the broker, the proxy, the trainer and the stream apps.

Phases:
1. **calibrate**: each node alone (the others not running), `--calib-s` from its first
   trajectory: its rollouts/s alone is its relative speed. Not with `--via mm2` (it needs
   `--no-calibrate`): there region B gets a fixed share of the tasks, which a node alone in
   region A leaves waiting until they fill the curator's window.
2. **mixed**: all three, `--mixed-s`: rollouts/s and share per node, against the share its
   calibrated speed predicts; idle: the fraction of its metric samples (every 5 s) with nothing
   in flight while the raas group had tasks waiting.
3. **elastic**: SIGTERM raas-b1 (region B), then start it again (join); kill -9 of the fastest
   node, raas-a1, while loaded, then start it again (with --via mm2, where region B has a second
   node raas-b2: SIGTERM raas-a1, kill -9 raas-b1). Nodes run with a `--node-session-s` group
   session (the broker allows 1 s). Join: time from the start of the process to its first
   trajectory, and until the total rate (5 s windows) is back to 90% of the mixed phase. Leave and
   kill: longest task wait after it (`_fault_report.longest_task_wait`, the fault harness's
   measure), and the rollouts the node had in flight at its last metric before.
4. **drain**: the curator paused until every issued task is trained or dead-lettered; tasks lost.

Weights: per version, the payload bytes from its stream manifest (what every follower pulls,
over the WAN in region B), against the snapshots written beside the stream; the WAN link's byte counters over the mixed phase
divided by the versions published meanwhile; a `KafkaWeightFollower` in this process, through the
WAN, gives the time from a version's manifest to its being applied in region B; each node's
own `policy_version` metric (every 5 s) against the newest version published by then gives its
version lag, in versions and in seconds (how long ago the first version it lacks was published),
for region A's nodes too, so that what the WAN adds is the difference.

    flock /work/notes/bench.lock python bench/regions.py --quick
"""

from __future__ import annotations

import argparse
import json
import signal
import sys
import tempfile
import threading
import time
import uuid
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

import _regions_outage
from _regions_run import RegionsRun, print_table


def parse(argv: list[str] | None = None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true", help="short phases (the test's settings)")
    ap.add_argument("--port", type=int, default=27092, help="our Kafka's port (controller +1, WAN proxy +2, WAN listener +3)")
    ap.add_argument("--api-port", type=int, default=27474, help="Toxiproxy's API")
    ap.add_argument("--latency-ms", type=int, default=150, help="WAN latency each way (RTT: twice)")
    ap.add_argument("--rate-kb-s", type=int, default=256, help="WAN bandwidth per connection and direction")
    ap.add_argument("--node-cpus", default="raas-a1=0.3,raas-a2=0.15,raas-b1=0.25,raas-b2=0.25",
                    help="each node's CPU quota in cores, from its first trajectory (its hardware's speed; 0: uncapped, "
                         "as fast as the machine's load lets it be)")
    ap.add_argument("--calib-s", type=float, default=None, help="each node alone (default 40; quick 20)")
    ap.add_argument("--mixed-s", type=float, default=None, help="all nodes (default 90; quick 40)")
    ap.add_argument("--hold-s", type=float, default=None, help="between elastic events (default 30; quick 20)")
    ap.add_argument("--snapshot-every", type=int, default=5, help="trainer: a snapshot every N versions")
    ap.add_argument("--group", type=int, default=4)
    ap.add_argument("--batch", type=int, default=16)
    ap.add_argument("--max-ahead", type=int, default=48,
                    help="curator: tasks ahead of the trainer; enough to cover every node's rate x refill delay "
                         "(the placement's reserves) and what the nodes hold, or some node runs short")
    ap.add_argument("--inflight", type=int, default=8, help="node: rollouts in flight")
    ap.add_argument("--prefetch", type=int, default=4, help="node: tasks fetched ahead")
    ap.add_argument("--via", choices=("wan", "mm2"), default="wan",
                    help="region B reaches A's cluster over the WAN (wan), or has its own cluster fed by MirrorMaker 2 "
                         "over the WAN (mm2: the curator gives it --region-share of the tasks)")
    ap.add_argument("--region-share", type=float, default=0.5,
                    help="with --via mm2: the fixed share of the tasks for region B (default: its share of the nodes, 2 of 4)")
    ap.add_argument("--node-session-s", type=float, default=3.0,
                    help="the nodes' group session (raas.group_session_timeout_s): how long a killed node's tasks wait")
    ap.add_argument("--tasks-partitions", type=int, default=12,
                    help="partitions of tasks (the curator places each task; a few per node)")
    ap.add_argument("--max-tokens", type=int, default=16)
    ap.add_argument("--prompts", type=int, default=512)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--no-calibrate", action="store_true",
                    help="skip phase 1 (no alone speeds, no expected shares: the test suite's short run)")
    ap.add_argument("--no-elastic", action="store_true")
    ap.add_argument("--outage", action="store_true",
                    help="with --via mm2: region A alone, then both, then every node of region B killed for "
                         "--outage-s and restarted (bench/_regions_outage.py; replaces the elastic phase)")
    ap.add_argument("--outage-s", type=float, default=None, help="the outage (default 120; quick 30)")
    ap.add_argument("--alone-s", type=float, default=None, help="--outage: region A alone (default 40; quick 30)")
    ap.add_argument("--region-dead-s", type=float, default=15.0,
                    help="curator: a region silent this long is dark (no new tasks, its tasks given back)")
    ap.add_argument("--work-dir", default=str(Path(tempfile.gettempdir()) / "astraflow-regions"))
    ap.add_argument("--json", default=None, help="where to write the figures (default bench/results/regions.json)")
    a = ap.parse_args(argv)
    if a.via == "mm2" and not a.no_calibrate and not a.outage:
        # Each node alone in region A would leave region B's fixed share of the tasks unconsumed:
        # they fill the curator's --max-ahead window and issuing stops (the next node then waits
        # 180 s for a task that never comes).
        ap.error("--via mm2 needs --no-calibrate: the curator sends region B its fixed --region-share "
                 "of the tasks, so a node calibrated alone leaves that share waiting and the curator's "
                 "--max-ahead window fills with it")
    if a.outage and a.via != "mm2":
        ap.error("--outage needs --via mm2 (over a direct WAN link region B's nodes are members of A's group: "
                 "their partitions go to A's nodes after the session, the elastic phase measures that)")
    if a.outage:
        a.no_calibrate = a.no_elastic = True
    a.outage_s = a.outage_s or (30.0 if a.quick else 120.0)
    a.alone_s = a.alone_s or (30.0 if a.quick else 40.0)
    a.calib_s = a.calib_s or (20.0 if a.quick else 40.0)
    a.mixed_s = a.mixed_s or (40.0 if a.quick else 90.0)
    a.hold_s = a.hold_s or (20.0 if a.quick else 30.0)
    return a


def main(argv: list[str] | None = None) -> dict:
    a = parse(argv)
    started = time.time()
    # SIGTERM (a deadline, a test's timeout) ends the run through the `finally` below: roles,
    # the proxy, the brokers and the CPU group are removed, not left behind.
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    run = RegionsRun(a, f"regions-{uuid.uuid4().hex[:8]}")
    stop = threading.Event()
    out = Path(a.json or Path(__file__).parent / "results" / "regions.json")
    report: dict | None = None
    try:
        run.setup()
        follower = threading.Thread(target=run.follow_wan, args=(stop,), daemon=True)
        follower.start()
        if not a.no_calibrate:
            run.calibrate()
        if a.outage:
            _regions_outage.alone(run)
        run.mixed()
        if not a.no_elastic:
            run.elastic()
        if a.outage:
            _regions_outage.outage(run)
        run.drain()
        stop.set()
        follower.join(timeout=10)
    finally:
        stop.set()
        # A deadline's SIGTERM while the figures are computed would lose them all (run 1 of this
        # session: stopped during the report, no JSON): from here on it waits for the report.
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
        try:
            if "mixed_end" in run.marks:  # stopped later (a deadline): the figures of what was run
                run.close_links()
                run.save_raw(out.with_suffix(".raw.pickle"))
                report = run.report()
                report["completed"] = "drained" in run.marks
                if a.outage:
                    o = _regions_outage.figures(run, report)
                    f = report["figures"]
                    report.update(outage=o, outage_a_vs_alone=o.get("outage_a_vs_alone"),
                                  rebalance_s=o.get("rebalance_s"), lost=f.get("samples_lost"),
                                  trained_twice=f.get("samples_trained_twice"))
                run.step("report")
                report["timing_s"] = dict(run.timing)
                out.parent.mkdir(parents=True, exist_ok=True)
                out.write_text(json.dumps(report, indent=1) + "\n")  # before printing, and when stopped early
        finally:
            run.close()
            run.step("close")
            print(f"timing (s): {run.timing}; {time.time() - started:.0f} s in all", flush=True)
    assert report is not None
    print_table(report)
    print(f"figures in {out}")
    return report


if __name__ == "__main__":
    main()
