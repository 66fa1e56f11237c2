"""Fault harness: the real pipeline under kill -9, broker restarts, outages and rebalances, counted.

    python bench/faults.py                 # every fault, ~25 min (a 5-minute broker outage included)
    python bench/faults.py --quick         # a few role kills and one broker restart, ~5 min
    python bench/faults.py --only kill-curate,broker-restart --phase-s 60

It starts its OWN Kafka (`--port`, default 22000, below the ephemeral port range so that no
client's reconnect can take it while the broker is down; never the shared broker: it kills it) and the
pipeline of `_pipeline.pipeline_roles` as processes (curator, reward, curate, trainer, two RaaS
nodes) on a **counted workload**: the curator issues tasks of 4 samples each from a fixed
arithmetic dataset, curate's dropping filters are off (zero-variance, length, staleness), so
every sample of every task must reach the trainer, and the trainer logs every sample it trains
(`trainer.trained_log`). `_ledger` turns that into exact counts.

The run is a sequence of **phases**, one per fault kind. A phase resumes the curator, injects
its faults at random times (the harness is the supervisor: a killed role is started again at
once, as systemd or Kubernetes would; a role is killed again only once it is back at work, a
random 0.5-4 s after it wrote something, and a broker fault waits until the trainer trained
again since the last one, so every fault hits work in flight), pauses the curator at its end and drains (waits until
every task issued so far is trained or accounted for, or nothing moved for `--drain-idle-s`).
So each phase's tasks are counted against that phase's faults:

* `kill-<role>`: kill -9 of the role's process group, `--kills` times (nodes: each node);
* `broker-restart`: kill -9 of the broker, started again at once on the same data;
* `broker-outage`: every broker SIGSTOPped (or killed, `--outage-mode kill`) for `--outage-s`;
  every role must survive it without exiting;
* `rebalance`: a second curate and reward worker and a third node join mid-phase and leave
  (SIGTERM) later: two rebalances of each group.

Reported per phase (table, and JSON in bench/results/faults.json): tasks issued and fully
trained, samples **lost** and **trained twice**, samples accounted for (DLQ, with reasons),
versions published, version numbers published with two different weights, the largest version
gap at the nodes (from their `policy_version` metric against the trainer's latest manifest),
recovery time (from the end of each fault to the first trainer step after it; the worst of the
phase), the longest wait of a task after a node's kill and roles that exited on their own.
`_fault_report` computes them from the topics; `_harness` runs the phases.
"""

from __future__ import annotations

import argparse
import shutil
import signal
import sys
import tempfile
from dataclasses import asdict
from pathlib import Path

from _fault_report import print_report
from _harness import Harness

TERMS = {  # what the figures compare (written into the results JSON)
    "ours": "the real pipeline as processes under kill -9, broker restarts, outages and rebalances",
    "against": "exact counts: tasks issued vs samples trained, lost, trained twice and dead-lettered",
    "settings": "the harness's own Kafka (--brokers), curate's dropping filters off, one phase per fault kind",
}


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true", help="one phase of 5 role kills, one broker restart")
    ap.add_argument("--json", default=None, help="where to write the figures (default bench/results/[quick/]faults.json)")
    ap.add_argument("--only", type=lambda s: s.split(","), default=None, help="phases to run, comma-separated, in that order")
    ap.add_argument("--port", type=int, default=22000,
                    help="the harness's own Kafka: node i on port + 2(i-1), its controller one above")
    ap.add_argument("--brokers", type=int, choices=(1, 3), default=1,
                    help="3: a three-node cluster (RF 3, min ISR 2), which adds the broker-1-of-3 phase")
    ap.add_argument("--work-dir", default=str(Path(tempfile.gettempdir()) / "astraflow-faults"))
    ap.add_argument("--keep", action="store_true",
                    help="keep the work dir (broker data, role logs, trained log); kept anyway when the run is not clean")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--phase-s", type=float, default=None, help="length of a phase before its drain (90; quick 60)")
    ap.add_argument("--kills", type=int, default=3, help="kills of each role per kill phase")
    ap.add_argument("--broker-restarts", type=int, default=2, help="broker kill -9 and restarts in the broker-restart phase")
    ap.add_argument("--outage-s", type=float, default=300.0, help="broker outage length")
    ap.add_argument("--outage-mode", choices=("kill", "stop"), default="stop",
                    help="stop: SIGSTOP, SIGCONT after it (the broker hangs, its ports stay bound); kill: kill -9, "
                         "restarted after it (on ports in the ephemeral range, clients' self-connects may hold them)")
    ap.add_argument("--one-down-s", type=float, default=60.0, help="how long one broker of three stays down")
    ap.add_argument("--rebalance-hold-s", type=float, default=40.0, help="how long the extra workers stay")
    ap.add_argument("--busy-timeout-s", type=float, default=120.0,
                    help="longest wait for a restarted role to be at work before it is killed again")
    ap.add_argument("--session-s", type=float, default=None,
                    help="the nodes' kafka.group_session_timeout_s (default: the config's, 6 s); the stream apps keep "
                         "theirs (aiokafka needs a session below its 40 s request timeout)")
    ap.add_argument("--drain-idle-s", type=float, default=60.0)
    ap.add_argument("--drain-timeout-s", type=float, default=300.0)
    ap.add_argument("--ready-timeout-s", type=float, default=300.0)
    ap.add_argument("--prompts", type=int, default=512, help="dataset size (the curator cycles through it)")
    ap.add_argument("--group", type=int, default=4, help="samples per task")
    ap.add_argument("--max-ahead", type=int, default=8, help="curator: tasks ahead of the trainer")
    ap.add_argument("--batch", type=int, default=16, help="trainer batch (samples)")
    ap.add_argument("--max-wait-s", type=float, default=3.0, help="trainer: longest wait for a full batch")
    ap.add_argument("--max-tokens", type=int, default=16)
    ap.add_argument("--nodes", type=int, default=2)
    ap.add_argument("--group-timeout-s", type=float, default=300.0, help="curate's group timeout (its default)")
    ap.add_argument("--curate-arg", action="append", default=[], help="extra `app run curate` argument (repeatable)")
    ap.add_argument("--trainer-set", action="append", default=[], help="extra trainer --set key=value (repeatable)")
    args = ap.parse_args(argv)
    if args.phase_s is None:
        args.phase_s = 60.0 if args.quick else 90.0
    return args


def _exit_on_signal(signum: int, frame: object) -> None:
    raise SystemExit(f"stopped by signal {signum}")  # so `run` stops every role and the broker


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    for sig in (signal.SIGTERM, signal.SIGHUP):
        signal.signal(sig, _exit_on_signal)
    report = Harness(args).run()
    print_report(report)
    from _common import write_json

    write_json(args.json, "faults", asdict(report), terms=TERMS, quick=args.quick)
    if not args.keep and report.clean:
        shutil.rmtree(Path(report.settings["work_dir"]), ignore_errors=True)
    elif not report.clean:
        print(f"kept for a look: {report.settings['work_dir']} (broker data, role logs, trained log)")
    return 0 if report.clean else 1


if __name__ == "__main__":
    sys.exit(main())
