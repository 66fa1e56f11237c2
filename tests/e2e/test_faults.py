"""The fault harness, short: kill -9 of every role and a broker restart lose nothing and train nothing twice.

Runs `bench/faults.py --quick` on its own broker (port 22100, never the shared one: it is
killed), with the real pipeline as processes: curator, reward, curate, trainer, two RaaS nodes.
One phase kills curate, the trainer, a node, reward and the curator (kill -9, restarted at
once) at random times while tasks flow; a second kills the broker and starts it again. Every
issued task's samples must be trained exactly once in the trainer's lineage (or be in the DLQ
with a reason), no sample may reach the train topic twice (exactly-once upstream, whatever the
trainer's sample-id guard would drop), no version number may carry two different weights, and
no role may exit on its own. The harness's counting is unit-tested in tests/unit/test_bench_faults_ledger.py; this test
also checks that the faults happened while work flowed (training resumed after every fault,
every issued task was trained), so a pass is not a run in which nothing happened.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

# About 5 minutes on a quiet machine; its own deadline is 25 minutes (10 were not enough at load 60).
pytestmark = [pytest.mark.e2e, pytest.mark.slow, pytest.mark.timeout(1800)]

ROOT = Path(__file__).resolve().parents[2]


def test_role_kills_and_a_broker_restart_lose_nothing_and_train_nothing_twice(tmp_path: Path) -> None:
    out = tmp_path / "faults.json"
    cmd = [sys.executable, str(ROOT / "bench" / "faults.py"), "--quick", "--port", "22100", "--json", str(out),
           "--work-dir", str(tmp_path / "work")]
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")])}
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd=ROOT, env=env)
    try:
        stdout, stderr = proc.communicate(timeout=1500)
    finally:
        if proc.poll() is None:  # a deadline: on SIGTERM the harness stops its roles and its broker, and reports
            proc.terminate()
            stdout, stderr = proc.communicate(timeout=300)
    res = subprocess.CompletedProcess(cmd, proc.returncode, stdout, stderr)
    assert out.exists(), f"no report:\n{res.stdout[-4000:]}\n{res.stderr[-4000:]}"
    report = json.loads(out.read_text())
    totals, phases = report["totals"], report["phases"]
    summary = "\n".join(res.stdout.splitlines()[-25:])

    kinds = [(f["kind"], f["target"]) for p in phases for f in p["faults"]]
    assert {t for k, t in kinds if k == "kill"} == {"curator", "reward", "curate", "trainer", "raas-1"}, kinds
    assert ("broker-restart", "all brokers") in kinds, kinds
    assert totals["tasks_issued"] > 0 and totals["samples_trained"] > 0, summary
    assert all(f["recovery_s"] is not None for p in phases for f in p["faults"]), f"training did not resume\n{summary}"

    for p in phases:
        assert p["lost"] == 0, f"{p['phase']}: {p['lost']} samples lost, e.g. {p['lost_ids']} (at {p['lost_at']})\n{summary}"
        assert p["trained_twice"] == 0, f"{p['phase']}: {p['trained_twice']} trained twice, e.g. {p['twice_ids']}\n{summary}"
        # Exactly-once upstream, not only the trainer's sample-id guard: no sample written twice to the train topic.
        assert p["train_topic_duplicates"] == 0, f"{p['phase']}: samples emitted twice to the train topic\n{summary}"
        assert p["version_conflicts"] == 0, f"{p['phase']}: a version number published with two weights\n{summary}"
        assert not p["exits"], f"{p['phase']}: roles exited on their own: {p['exits']}"
        assert p["drained"], f"{p['phase']} did not drain\n{summary}"
    assert totals["samples_trained"] + totals["accounted"] == totals["samples_expected"], summary
    assert totals["trained_never_issued"] == 0 and totals["tasks_written_twice"] == 0, summary
    assert res.returncode == 0, summary
