"""scripts/figures.py: the README's figure table and docs/benchmarks.md's figures are what the
committed results say, and the generator makes them from results files (a fixture here)."""

from __future__ import annotations

import importlib.util
import json
import sys
from pathlib import Path
from typing import Any

import pytest

pytestmark = pytest.mark.unit

ROOT = Path(__file__).resolve().parents[2]


def _figures() -> Any:
    spec = importlib.util.spec_from_file_location("scripts_figures", ROOT / "scripts" / "figures.py")
    assert spec and spec.loader
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses look their module up there
    spec.loader.exec_module(module)
    return module


figures = _figures()

DOC = "# x\n\nbefore\n\n<!-- figures:begin: a note -->\nhand-written 9.99x\n<!-- figures:end -->\n\nafter\n"
TERMS = {"ours": "our typed path", "against": "bare fastavro", "settings": "one core"}


def serde_result(ratio: float, quick: bool = False) -> dict[str, Any]:
    return {"benchmark": "serde", "commit": "abc+dirty", "quick": quick, "terms": TERMS,
            "machine": {"cores": 2, "cpu": "Test CPU", "memory_gib": 8.0, "python": "3.11"},
            "tokens": 4096, "roundtrip_per_s": 1000.0 * ratio, "encode_per_s": 3000.0, "decode_per_s": 2500.0,
            "bare_roundtrip_per_s": 1000.0, "ratio_vs_bare": ratio,
            "task": {"roundtrip_per_s": 900.0, "bare_roundtrip_per_s": 1000.0, "ratio_vs_bare": 0.9}}


def weights_result() -> dict[str, Any]:
    row = {"lr": 1e-5, "params": 100_000_000, "changed_fraction": 0.14, "ours_bytes_per_changed": 0.8,
           "reference_over_ours": 7.5}
    return {"benchmark": "weights", "commit": "abc", "quick": True, "terms": {**TERMS, "against": "6 bytes each"},
            "machine": {"cores": 2, "cpu": "Test CPU", "memory_gib": 8.0, "python": "3.11"},
            "rows": [row, {**row, "lr": 1e-6, "ours_bytes_per_changed": 1.2, "reference_over_ours": 5.0}]}


@pytest.fixture
def tree(tmp_path: Path) -> Path:
    (tmp_path / "docs").mkdir()
    (tmp_path / "bench" / "results").mkdir(parents=True)
    for path in ("README.md", "docs/benchmarks.md"):
        (tmp_path / path).write_text(DOC)
    return tmp_path


def write(root: Path, name: str, data: dict[str, Any]) -> None:
    (root / "bench" / "results" / f"{name}.json").write_text(json.dumps(data))


def regenerate(root: Path) -> None:
    for path, text in figures.expected(root).items():
        path.write_text(text)


def test_the_committed_docs_state_what_the_committed_results_say() -> None:
    diffs = figures.check(ROOT)
    assert not diffs, "run `python scripts/figures.py write`:\n" + "".join(diffs)


def test_the_blocks_are_made_from_the_results_and_nothing_else(tree: Path) -> None:
    write(tree, "serde", serde_result(1.25))
    write(tree, "weights", weights_result())
    assert figures.check(tree)  # the hand-written figure differs from the results
    regenerate(tree)
    assert figures.check(tree) == []
    readme = (tree / "README.md").read_text()
    assert "9.99x" not in readme and readme.startswith("# x\n\nbefore\n") and readme.endswith("after\n")
    assert "<!-- figures:begin: a note -->" in readme  # the marker line is kept
    # serde is a docs-only headline; weights has a README row, from a quick run, against its own terms
    assert "| weight deltas | 0.80–1.20 bytes per changed element (bf16, 100M params) (quick run) | 6 bytes each | " \
           "`python bench/weights.py --quick` |" in readme
    assert "1.25x" not in readme
    assert "No committed result yet" in readme and "`multi_policy`" in readme
    docs = (tree / "docs" / "benchmarks.md").read_text()
    assert "**1.25x bare fastavro's round trips/s (4,096-token trajectory)**" in docs
    assert "full run; 2 cores (Test CPU), 8.0 GiB" in docs and "- **against**: bare fastavro" in docs
    assert "`faults` (`python bench/faults.py --brokers 3`)" in docs  # a headline with no results file is named


def test_check_fails_when_a_result_changes_or_a_figure_is_edited(tree: Path) -> None:
    write(tree, "serde", serde_result(1.25))
    regenerate(tree)
    write(tree, "serde", serde_result(1.5))
    assert any("1.50x" in d for d in figures.check(tree))
    write(tree, "serde", serde_result(1.25))
    docs = tree / "docs" / "benchmarks.md"
    docs.write_text(docs.read_text().replace("1.25x", "1.35x"))
    assert figures.check(tree)


def test_a_results_file_without_the_common_fields_is_refused(tree: Path) -> None:
    data = serde_result(1.25)
    del data["terms"]
    write(tree, "serde", data)
    with pytest.raises(SystemExit, match="no terms"):
        figures.check(tree)


def test_a_file_without_exactly_one_block_is_refused(tree: Path) -> None:
    (tree / "README.md").write_text("# no markers\n")
    with pytest.raises(SystemExit, match="exactly one"):
        figures.check(tree)


def test_multi_policy_counts_every_seed_and_shows_a_missed_target_as_a_bound() -> None:
    def row(mode: str, seed: int, wall_s: float, solver: float | None, verifier: float | None) -> dict[str, Any]:
        return {"sigma": 2.0, "mode": mode, "seed": seed, "wall_s": wall_s,
                "solver": {"time_to_target_s": solver}, "verifier": {"time_to_target_s": verifier},
                "vs_trainer_centred": {p: {"samples_per_s": 3.0} for p in ("solver", "verifier")}}

    base = [row("trainer-centred", s, 50.0, 40.0, 40.0) for s in (0, 1)]
    # seed 1's verifier never reached the target in its 12.5 s: counted at 12.5 s, so its ratio is at most 3.2x
    headline, rows = figures.multi_policy({"rows": [*base, row("pipeline", 0, 25.0, 20.0, 10.0),
                                                    row("pipeline", 1, 12.5, 5.0, None)]})
    assert headline.startswith("time to target, solver / verifier: 4.00x (95% CI ")
    assert "/ <=3.58x (95% CI " in headline and headline.endswith("(sigma 2.0, pipeline, 2 seeds)")
    assert ("sigma 2.0, pipeline: verifier time to target, per seed", "seed 0 4.00x, seed 1 <=3.20x") in rows
    summary = dict(rows)["sigma 2.0, pipeline vs trainer-centred"]
    assert "verifier <=3.58x (95% CI " in summary and "n=2, 1 censored)" in summary
    assert "samples/s 3.00x (95% CI 3.00–3.00x, n=2)" in summary


def test_a_stopped_staleness_grid_and_a_faults_report_read_as_what_they_are() -> None:
    assert figures.staleness({"completed_runs": 3, "planned_runs": 8, "rows": []}) == ("incomplete: 3 of 8 runs", [])
    phase = {"phase": "kill-curate", "faults": [{"kind": "kill"}, {"kind": "kill"}], "tasks_issued": 51, "lost": 0,
             "trained_twice": 1, "exits": []}
    headline, rows = figures.faults({"totals": {"lost": 0, "trained_twice": 1, "samples_expected": 2040}, "phases": [phase]})
    assert headline == "0 lost, 1 trained twice of 2,040 samples (2 faults)"
    assert rows == [("kill-curate", "2 faults, 51 tasks issued, 0 lost, 1 trained twice, 0 roles exited")]
