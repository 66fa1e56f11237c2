"""Advantage estimators against values computed by hand."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest

from astraflow.dataflow.advantages import advantages_for, dr_grpo, grpo, rloo
from astraflow.dataflow.registry import get
from astraflow.errors import StrategyError
from astraflow.testing import make_trajectory

pytestmark = pytest.mark.unit


def test_grpo_one_group_by_hand() -> None:
    # [1, 2, 3, 4]: mean 2.5, population variance (2.25 + 0.25 + 0.25 + 2.25) / 4 = 1.25
    s = np.sqrt(1.25)
    assert grpo([1, 2, 3, 4], eps=0) == pytest.approx([-1.5 / s, -0.5 / s, 0.5 / s, 1.5 / s])
    # binary group: mean 0.5, std 0.5 -> +-1 (eps shrinks it a hair)
    assert grpo([1, 0, 0, 1], eps=0) == pytest.approx([1, -1, -1, 1])
    a = 0.5 / (0.5 + 1e-6)
    assert grpo([1, 0, 0, 1]) == pytest.approx([a, -a, -a, a], rel=1e-12)
    # sample std (ddof=1) of [3, 1] is sqrt(2)
    assert grpo([3, 1], eps=0, ddof=1) == pytest.approx([1 / np.sqrt(2), -1 / np.sqrt(2)])


def test_zero_variance_group_gives_zero_advantage() -> None:
    assert grpo([1, 1, 1]) == pytest.approx([0, 0, 0])
    assert grpo([1, 1, 1], eps=0) == pytest.approx([0, 0, 0])  # 0/0 is taken as 0, never NaN
    assert dr_grpo([0.3, 0.3]) == pytest.approx([0, 0])
    assert rloo([2, 2, 2]) == pytest.approx([0, 0, 0])


def test_dr_grpo_and_rloo_by_hand() -> None:
    assert dr_grpo([1, 2, 3, 4]) == pytest.approx([-1.5, -0.5, 0.5, 1.5])
    # leave-one-out: 1 - (2+3+4)/3 = -2; 2 - (1+3+4)/3 = -2/3; 3 - 7/3 = 2/3; 4 - 2 = 2
    assert rloo([1, 2, 3, 4]) == pytest.approx([-2, -2 / 3, 2 / 3, 2])
    assert rloo([5]) == pytest.approx([0])  # no other sample: no baseline, no signal


def test_ragged_groups_in_any_order() -> None:
    rewards = [1, 5, 0, 3, 1]
    ids = ["a", "b", "a", "b", "c"]  # a = [1, 0], b = [5, 3], c = [1]
    assert grpo(rewards, ids, eps=1e-6) == pytest.approx([1, 1, -1, -1, 0], rel=1e-5)
    assert dr_grpo(rewards, ids) == pytest.approx([0.5, 1, -0.5, -1, 0])
    assert rloo(rewards, ids) == pytest.approx([1, 2, -1, -2, 0])


def test_two_dimensional_input_is_one_group_per_row() -> None:
    out = dr_grpo(np.array([[1.0, 0.0], [2.0, 2.0]]))
    assert out.shape == (2, 2)
    assert out == pytest.approx(np.array([[0.5, -0.5], [0.0, 0.0]]))
    assert rloo(np.array([[1.0, 0.0, 2.0]])) == pytest.approx(np.array([[0.0, -1.5, 1.5]]))


def test_bad_inputs_raise() -> None:
    with pytest.raises(StrategyError, match="finite"):
        grpo([1.0, float("nan")])
    with pytest.raises(StrategyError, match="same length"):
        grpo([1.0, 2.0], ["a"])


def test_advantages_for_scored_trajectories_via_registry() -> None:
    base = make_trajectory(32)
    items = [
        dataclasses.replace(base, group_id=g, trajectory_id=f"t{i}", reward=r)
        for i, (g, r) in enumerate([("g1", 1.0), ("g1", 0.0), ("g2", 1.0), ("g2", 1.0)])
    ]
    estimator = get("advantage", "grpo", eps=0.0)
    assert advantages_for(items, estimator) == pytest.approx([1, -1, 0, 0])
    with pytest.raises(StrategyError, match="no reward"):
        advantages_for([dataclasses.replace(base, reward=None)], estimator)
