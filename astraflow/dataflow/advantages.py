"""Group-relative advantage estimators (pure, vectorised numpy).

Each estimator takes rewards and says how they group:

* `rewards` 1-D with `group_ids` (same length): any number of groups, any sizes, any order;
* `rewards` 1-D without ids: one group;
* `rewards` 2-D (groups x samples) without ids: one group per row; the result has that shape.

Estimators (for sample i of a group of n with mean m and standard deviation s):

* GRPO:      A_i = (r_i - m) / (s + eps)   (s with `ddof`, 0 = population std by default;
                                           0 where s + eps is 0, e.g. eps=0 and equal rewards)
* Dr. GRPO:  A_i = r_i - m                 (no std scaling, "GRPO done right", Liu et al. 2025)
* RLOO:      A_i = r_i - mean_{j != i} r_j = n / (n - 1) * (r_i - m);  0 for a group of one
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Sequence

import numpy as np
from numpy.typing import ArrayLike, NDArray

from astraflow.dataflow.registry import register
from astraflow.errors import StrategyError
from astraflow.records import TrainSample, Trajectory

Estimator = Callable[..., NDArray[np.float64]]


def _grouped(
    rewards: ArrayLike, group_ids: ArrayLike | None
) -> tuple[NDArray[np.float64], NDArray[np.intp], tuple]:
    """(flat rewards, group index per reward, shape to return)."""
    r = np.asarray(rewards, dtype=np.float64)
    if not np.all(np.isfinite(r)):
        raise StrategyError("rewards must be finite numbers (found NaN or inf); check the reward strategy")
    if group_ids is None:
        if r.ndim == 2:
            return r.ravel(), np.repeat(np.arange(r.shape[0]), r.shape[1]), r.shape
        if r.ndim != 1:
            raise StrategyError(f"rewards must be 1-D or 2-D (groups x samples), got shape {r.shape}")
        return r, np.zeros(r.shape[0], dtype=np.intp), r.shape
    ids = np.asarray(group_ids)
    if r.ndim != 1 or ids.shape != r.shape:
        raise StrategyError(f"rewards {r.shape} and group_ids {ids.shape} must be 1-D of the same length")
    _, inverse = np.unique(ids, return_inverse=True)
    return r, inverse.reshape(-1), r.shape


def _stats(
    r: NDArray[np.float64], inv: NDArray[np.intp], ddof: int = 0
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Per-sample (group mean, group std, group size)."""
    counts = np.bincount(inv).astype(np.float64)
    means = np.bincount(inv, weights=r) / counts
    centred = r - means[inv]
    sq = np.bincount(inv, weights=centred * centred)
    dof = counts - ddof
    std = np.sqrt(np.divide(sq, dof, out=np.zeros_like(sq), where=dof > 0))
    return means[inv], std[inv], counts[inv]


def grpo(
    rewards: ArrayLike, group_ids: ArrayLike | None = None, *, eps: float = 1e-6, ddof: int = 0
) -> NDArray[np.float64]:
    """GRPO: reward minus group mean, divided by group std + eps."""
    r, inv, shape = _grouped(rewards, group_ids)
    mean, std, _ = _stats(r, inv, ddof)
    denom = std + eps
    centred = r - mean
    return np.divide(centred, denom, out=np.zeros_like(centred), where=denom > 0).reshape(shape)


def dr_grpo(rewards: ArrayLike, group_ids: ArrayLike | None = None) -> NDArray[np.float64]:
    """Dr. GRPO: reward minus group mean, no std scaling."""
    r, inv, shape = _grouped(rewards, group_ids)
    mean, _, _ = _stats(r, inv)
    return (r - mean).reshape(shape)


def rloo(rewards: ArrayLike, group_ids: ArrayLike | None = None) -> NDArray[np.float64]:
    """RLOO: reward minus the mean of the other samples of its group (0 for a group of one)."""
    r, inv, shape = _grouped(rewards, group_ids)
    mean, _, n = _stats(r, inv)
    scale = np.divide(n, n - 1, out=np.zeros_like(n), where=n > 1)
    return (scale * (r - mean)).reshape(shape)


def advantages_for(items: Sequence[Trajectory | TrainSample], estimator: Estimator) -> NDArray[np.float64]:
    """Advantages of scored items, grouped by their group_id."""
    missing = [i for i, it in enumerate(items) if it.reward is None]
    if missing:
        raise StrategyError(
            f"{len(missing)} item(s) have no reward (first at index {missing[0]}); score them first"
        )
    rewards = np.array([it.reward for it in items], dtype=np.float64)
    return estimator(rewards, np.array([it.group_id for it in items]))


@register("advantage", "grpo", version=1)
def grpo_estimator(*, eps: float = 1e-6, ddof: int = 0) -> Estimator:
    """GRPO: (r - group mean) / (group std + eps)."""
    return functools.partial(grpo, eps=eps, ddof=ddof)


@register("advantage", "dr_grpo", version=1)
def dr_grpo_estimator() -> Estimator:
    """Dr. GRPO: r - group mean."""
    return dr_grpo


@register("advantage", "rloo", version=1)
def rloo_estimator() -> Estimator:
    """RLOO: r - mean of the other samples of the group."""
    return rloo
