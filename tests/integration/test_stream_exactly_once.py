"""Counted crash test on the real broker: curate workers killed with SIGKILL mid-run, nothing twice, nothing lost.

`bench.exactly_once.run_crash` feeds scored trajectories (complete groups, partial groups that
time out, lone members that are dropped, redelivered trajectories) while `astraflow app run
curate` workers run as processes: one is killed -9 three times at random moments and restarted,
a second joins after the first kill (a rebalance). Read `read_committed`, every expected sample
is there exactly once and no group is split; the same topic read `read_uncommitted` shows the
aborted records of the transactions the kills interrupted, so the kills did land mid-transaction.
The reward app and the at-least-once controls (`--guarantee at_least_once`, `--state memory`) run
in `python -m bench.exactly_once`.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from astraflow.config import KafkaSettings
from bench.exactly_once import run_crash

pytestmark = pytest.mark.slow


def test_curate_killed_three_times_and_rebalanced_emits_every_sample_exactly_once(kafka: KafkaSettings, tmp_path: Path) -> None:
    report = run_crash(kafka, "curate", kills=3, seed=7, work=tmp_path)
    assert report.kills == 3 and report.rebalances >= 4, report
    assert report.duplicates == 0, report
    assert report.split_groups == 0, report
    assert report.missing == 0 and report.unexpected == 0, report
    assert report.committed == report.expected, report
    # The control: the train topic itself, read read_uncommitted, holds the outputs of the transactions
    # the kills aborted (each kill waits until outputs are in an open transaction).
    assert report.sink_aborted > 0, f"no kill hit an open transaction with outputs; the run proves nothing: {report}"
