"""bench/regions.py, short: region-B nodes behind a real WAN proxy, a CPU-capped node, nodes leaving
(SIGTERM, in region B) and dying (kill -9, the fastest node) and joining again, on the real pipeline.

Runs on its own Kafka (port 27200) and Toxiproxy (API 27274), never the shared broker. It needs
root (the cgroup v1 cpu controller) and Go or a cached Toxiproxy (the project builds it). It skips
the calibration phase (each node alone: the benchmark's speed figures, not a check). Checked:
every node worked in every phase it was up, region-B traffic crossed the proxy (the link's byte
counters), weights were published as bf16 deltas smaller than the snapshots, the WAN follower and
the region-B node applied new versions, and nothing was lost or trained twice. No timing is
asserted; the figures are the benchmark's (docs/deploy.md).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = [pytest.mark.e2e, pytest.mark.slow, pytest.mark.timeout(1800)]

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.skipif(not Path("/sys/fs/cgroup/cpu/cpu.cfs_quota_us").exists() or os.geteuid() != 0,
                    reason="needs root and the cgroup v1 cpu controller (the slowed node)")
def test_regions_short_run_keeps_every_task_and_ships_deltas_over_the_wan(tmp_path: Path) -> None:
    out = tmp_path / "regions.json"
    cmd = [sys.executable, str(ROOT / "bench" / "regions.py"), "--quick", "--port", "27200", "--api-port", "27274",
           "--no-calibrate", "--mixed-s", "20", "--hold-s", "12", "--json", str(out), "--work-dir", str(tmp_path / "w")]
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")])}
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, cwd=ROOT, env=env)
    try:
        text, _ = proc.communicate(timeout=1500)
    except subprocess.TimeoutExpired:
        proc.terminate()  # the benchmark cleans up on SIGTERM (roles, proxy, brokers, CPU group)
        text, _ = proc.communicate(timeout=180)
    summary = text[-5000:]
    assert out.exists() and proc.returncode == 0, summary
    r = json.loads(out.read_text())
    f = r["figures"]
    for n in r["nodes"]:
        assert n["mixed_rps"] > 0, (n, summary)
    assert f["wan_bytes_to_b_total"] > 0 and f["wan_bytes_from_b_total"] > 0, summary  # region B went through the proxy
    assert f["weights_delta_bytes_mean"] and f["weights_snapshot_bytes_mean"], summary
    assert f["weights_delta_bytes_mean"] < f["weights_snapshot_bytes_mean"], summary
    assert f["publish_to_live_b_s_median"] is not None, summary
    assert f["region_b_version_lag_max"] is not None, summary
    assert f["join_raas-a1_first_rollout_s"] is not None and f["join_raas-b1_first_rollout_s"] is not None, summary
    assert f["tasks_issued"] > 0 and f["samples_lost"] == 0 and f["samples_trained_twice"] == 0, summary
