"""A shortened `astraflow demo --scenario db`: the SQL agent through the OpenAI endpoint, every role its own process.

Asserts on the run directory and on what the topics hold, not on timings or on learning: the
trainer published versions, later trajectories came from newer versions, the trajectories ran
SQL through the tool and were scored by `sql_result`, advantages reached the train topic, the
held-out evaluation scored the warm start and the final version on the same tasks (with their
standard errors), and nothing but stale samples was dead-lettered.
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


def test_short_db_scenario(kafka: KafkaSettings, tmp_path: Path) -> None:
    from test_demo import _read_all

    run_dir = tmp_path / "run"
    cmd = [sys.executable, "-m", "astraflow_cli.main", "demo", "--scenario", "db", "--bootstrap",
           kafka.bootstrap_servers, "--minutes", "10", "--versions", "2", "--out", str(run_dir), "--heldout", "16",
           "--sft-steps", "200"]
    res = subprocess.run(cmd, capture_output=True, text=True, timeout=1300, env={**os.environ, "COLUMNS": "120"})
    assert res.returncode == 0, f"{res.stdout[-3000:]}\n{res.stderr[-3000:]}"
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["scenario"] == "db" and summary["reward"] == "sql_result"
    assert summary["stopped_by"] == "2 versions published", summary["stopped_by"]
    topics = Topics(summary["experiment"])

    versions = [r.version for r in _read_all(kafka, topics.weights("policy")) if type(r).__name__ == "PolicyVersion"]
    assert versions and max(versions) >= 2, versions
    scored = _read_all(kafka, topics.scored)
    assert scored and all(t.workflow == "db_agent" and t.reward in (0.0, 1.0) for t in scored)
    assert any(c.name == "sql" for t in scored for c in t.tool_calls), "the agent should run SQL through its tool"
    assert any(t.reward == 1.0 for t in scored) and any(t.reward == 0.0 for t in scored)
    gen_versions = [int(s.versions[s.loss_mask.astype(bool)].max()) for t in scored for s in t.segments
                    if s.loss_mask.any()]
    assert max(gen_versions) > min(gen_versions) >= 0, "later trajectories should come from newer versions"
    samples = _read_all(kafka, topics.train("policy"))
    assert samples and any(abs(s.advantage) > 0 for s in samples)

    held = summary["heldout"]
    assert held["heldout_rows"] == 16 and held["final_version"] >= 2, held
    for label in ("sampled", "greedy"):
        for key in ("warm_start", "final"):
            assert 0.0 <= held[f"heldout_{label}_{key}"] <= 1.0 and held[f"heldout_{label}_{key}_se"] >= 0.0, held
        change = held[f"heldout_{label}_final"] - held[f"heldout_{label}_warm_start"]
        assert abs(held[f"heldout_{label}_change"] - change) < 1e-3, held

    dead = _read_all(kafka, topics.dlq, idle_s=1.0)
    others = [(d.component, d.error_class, d.error) for d in dead
              if not (d.component == "trainer" and d.error_class == "InvalidSampleError" and d.error.startswith("stale:"))]
    assert others == []
