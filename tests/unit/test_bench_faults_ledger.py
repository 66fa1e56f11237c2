"""bench/_ledger.py: the fault harness's counts of lost and trained-twice samples are exact."""

from __future__ import annotations

import json

import pytest
from _ledger import IssuedTask, Step, expected_samples, lineage, parse_trained_log, tally, task_of

pytestmark = pytest.mark.unit


def _ids(task: str, *idx: int) -> tuple[str, ...]:
    return tuple(f"{task}/{i}#policy" for i in idx)


def test_sample_ids_follow_the_pipeline_scheme() -> None:
    assert expected_samples("abc-3", 2) == ["abc-3/0#policy", "abc-3/1#policy"]
    assert task_of("abc-3/1#policy") == "abc-3" and task_of("a/b/7") == "a/b"


def test_lineage_drops_steps_after_the_checkpoint_a_restart_resumed_from() -> None:
    # run A trained steps 1-5 (checkpoint at 3), was killed; run B resumed at 4 and re-trained 4-5.
    a = [Step("A", i, _ids("t", i), i - 1) for i in range(1, 6)]
    b = [Step("B", i, _ids("t", i), 5 + i - 4) for i in range(4, 7)]
    assert [(s.run, s.step) for s in lineage(a + b)] == [("A", 1), ("A", 2), ("A", 3), ("B", 4), ("B", 5), ("B", 6)]


def test_lineage_skips_a_run_killed_before_any_checkpoint_it_made_was_used() -> None:
    # A: 1-12 (checkpoint 10); B resumed at 11, trained 11-12, killed before checkpoint 20; C resumed at 11 too.
    a = [Step("A", i, (), i) for i in range(1, 13)]
    b = [Step("B", i, (), 100 + i) for i in (11, 12)]
    c = [Step("C", i, (), 200 + i) for i in (11, 12, 13)]
    assert [(s.run, s.step) for s in lineage(a + b + c)][-4:] == [("A", 10), ("C", 11), ("C", 12), ("C", 13)]


def test_tally_counts_lost_twice_and_accounted_exactly() -> None:
    tasks = [IssuedTask("t1", 2, 0), IssuedTask("t2", 2, 0), IssuedTask("t3", 2, 0)]
    steps = [Step("A", 1, _ids("t1", 0, 1), 0), Step("A", 2, _ids("t2", 0) + _ids("t1", 1), 1)]
    accounted = {"t3/0#policy": "dlq: bad"}
    t = tally(tasks, steps, accounted)
    assert (t.tasks_issued, t.tasks_trained, t.samples_trained) == (3, 1, 3)
    assert (t.lost, t.accounted, t.trained_twice) == (2, 1, 1)
    assert sorted(t.lost_ids) == ["t2/1#policy", "t3/1#policy"] and t.twice_ids == ["t1/1#policy"]
    # Trained twice counts where the second training happened (log lines), whatever task it belongs to.
    assert tally(tasks, steps, accounted, (0, 1)).trained_twice == 0
    assert tally([], steps, accounted, (1, 2)).trained_twice == 1


def test_a_retrained_step_after_a_restart_is_not_a_duplicate_but_a_second_training_in_the_lineage_is() -> None:
    tasks = [IssuedTask("t", 3, 0)]
    restarted = [Step("A", 1, _ids("t", 0), 0), Step("A", 2, _ids("t", 1), 1), Step("B", 2, _ids("t", 1), 2),
                 Step("B", 3, _ids("t", 2), 3)]
    assert tally(tasks, restarted, {}).trained_twice == 0
    twice = [*restarted, Step("B", 4, _ids("t", 0), 4)]
    assert tally(tasks, twice, {}).trained_twice == 1


def test_parse_trained_log_reads_the_trainers_lines_and_counts_torn_ones() -> None:
    line = {"run": "h-1-2", "step": 3, "samples": [[0, 5, "t/0#policy"], [1, 2, "t/1#policy"]], "offsets": {"0": 6}}
    text = json.dumps(line) + "\n" + '{"run": "h-1-2", "st' + "\n"
    steps, torn = parse_trained_log(text)
    assert steps == [Step("h-1-2", 3, ("t/0#policy", "t/1#policy"), 0)] and torn == 1


def test_a_per_sample_log_of_published_weights_is_the_lineage_itself() -> None:
    rows = [("t/0#policy", 1, 1), ("t/1#policy", 1, 1), ("t/1#policy", 4, 4)]
    text = "".join(json.dumps({"sample_id": sid, "step": st, "version": v, "partition": 0, "offset": 0}) + "\n"
                   for sid, st, v in rows)
    steps, torn = parse_trained_log(text)
    assert torn == 0 and len(lineage(steps)) == 3
    t = tally([IssuedTask("t", 3, 0)], steps, {})
    assert (t.samples_trained, t.trained_twice, t.lost) == (2, 1, 1)
