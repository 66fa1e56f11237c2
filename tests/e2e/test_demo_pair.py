"""A shortened `astraflow demo --scenario solver-verifier`: two policies, two trainers, every role its own process.

Asserts on the run directory and on what the topics hold, not on timings or learning: both
trainers published versions of their own policy, the node generated with both, each train
topic holds only its policy's sequences, both held-out curves were recorded, nothing was
dead-lettered.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from astraflow.config import KafkaSettings
from astraflow.kafka.topics import Topics

pytestmark = [pytest.mark.e2e, pytest.mark.slow, pytest.mark.timeout(1500)]


def test_short_solver_verifier_demo(kafka: KafkaSettings, tmp_path: Path) -> None:
    from test_demo import _read_all

    run_dir = tmp_path / "run"
    cmd = [sys.executable, "-m", "astraflow_cli.main", "demo", "--scenario", "solver-verifier", "--bootstrap",
           kafka.bootstrap_servers, "--minutes", "15", "--versions", "1", "--out", str(run_dir), "--sft-steps", "300", "--n-samples", "4",
           "--batch-size", "8"]
    res = subprocess.run(cmd, capture_output=True, text=True, timeout=1200, env={**os.environ, "COLUMNS": "120"})
    assert res.returncode == 0, f"{res.stdout[-3000:]}\n{res.stderr[-3000:]}"
    summary = json.loads((run_dir / "summary.json").read_text())
    assert (run_dir / "learning.png").exists() and (run_dir / "eval.csv").exists()
    assert set(summary["policies"]) == {"solver", "verifier"}
    assert summary["stopped_by"] == "version 1 of every policy", summary["stopped_by"]
    topics = Topics(summary["experiment"])
    for policy in ("solver", "verifier"):
        mine = summary["policies"][policy]
        assert mine["eval_points"] >= 1 and mine["eval_warm_start"] is not None, mine
        versions = [r.version for r in _read_all(kafka, topics.weights(policy)) if type(r).__name__ == "PolicyVersion"]
        assert versions and max(versions) >= 1, (policy, versions)
        samples = _read_all(kafka, topics.train(policy))
        assert samples and all(s.policy == policy and s.sample_id.endswith(f"#{policy}") for s in samples)
    scored = _read_all(kafka, topics.scored)
    assert scored and all({"policy.solver", "policy.verifier"} <= set(t.reward_components) for t in scored)
    assert all({s.policy for s in t.segments} == {"solver", "verifier"} for t in scored)
    dead = _read_all(kafka, topics.dlq, idle_s=1.0)
    others = [(d.component, d.error_class, d.error) for d in dead
              if not (d.component == "trainer" and d.error_class == "InvalidSampleError" and d.error.startswith("stale:"))]
    assert others == []
