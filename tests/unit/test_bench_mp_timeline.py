"""bench/_mp_timeline.py: the early steps' timeline of bench/multi_policy.py, from the records."""

from __future__ import annotations

from types import SimpleNamespace

import _mp_timeline as tl
import pytest

pytestmark = pytest.mark.unit


def test_trainer_steps_are_taken_back_by_their_publication_and_step() -> None:
    steps = tl.steps_from_metrics({1: {"ts": 105.0, "step_s": 0.5, "publish_s": 0.25, "warm_up_s": 0.4},
                                   2: {"ts": 109.0}}, 100.0)
    assert steps == {1: {"began": 4.25, "ended": 4.75, "warm_up_s": 0.4}}  # step 2 has no step_s: left out


def test_a_pipeline_step_is_ready_when_the_last_trajectory_of_its_groups_ended() -> None:
    groups = [{"step": 1, "ended_s": 3.0}, {"step": 1, "ended_s": 3.6}, {"step": 2, "ended_s": 8.1},
              {"step": 2, "ended_s": None}]
    rows = tl.pipeline_steps(groups, {1: {"began": 3.8, "ended": 4.5}}, [(0, 0.0), (1, 4.9), (2, 9.2)])
    assert rows == [{"step": 1, "batch_ready": 3.6, "began": 3.8, "ended": 4.5, "snapshot": 4.9},
                    {"step": 2, "batch_ready": 8.1, "began": None, "ended": None, "snapshot": 9.2}]


def test_node_occupancy_counts_rollouts_in_flight() -> None:
    spans = [(0.0, 1.0), (0.0, 2.0), (1.5, 4.0), (-1.0, 0.4)]
    occ = tl.node_occupancy(spans, 4.0, 4)
    assert occ["inflight"][:6] == [3, 2, 1, 2, 1, 1]  # at 0, 0.5, 1.0, 1.5, 2.0, 2.5 s
    assert occ["mean_inflight"] == pytest.approx((1 + 2 + 2.5 + 0.4) / 4, abs=0.05)
    assert occ["share_of_max"] == pytest.approx(occ["mean_inflight"] / 4, abs=0.01)


def test_rollout_times_are_relative_to_t0_with_their_means() -> None:
    traj = [SimpleNamespace(timings=SimpleNamespace(started_at=101_000, finished_at=103_000, generate_s=0.5, tool_s=1.0)),
            SimpleNamespace(timings=SimpleNamespace(started_at=102_000, finished_at=106_000, generate_s=1.5, tool_s=2.0))]
    spans, means = tl.rollout_times(traj, 100.0)
    assert spans == [(1.0, 3.0), (2.0, 6.0)]
    assert means == {"generate_s": 1.0, "tool_s": 1.5, "rollout_s": 3.0}


def test_an_in_process_step_had_its_batch_when_it_began() -> None:
    assert tl.in_process_row(1, 10.2221, 10.3504) == {"step": 1, "batch_ready": 10.222, "began": 10.222,
                                                       "ended": 10.35, "snapshot": 10.35}
