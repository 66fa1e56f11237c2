"""Per-region figures and the autoscaling rule (astraflow.ops.scaling), on hand-made node records."""

from __future__ import annotations

import pytest

from astraflow.ops.scaling import autoscale_of, regions_of
from astraflow.ops.status import NodeStatus


def _node(nid: str, region: str, version: int, rps: float = 1.0, inflight: float = 4, seen: float = 5.0) -> NodeStatus:
    return NodeStatus(nid, "cpu", region, "torch", {"policy": version}, rps, 10 * rps, inflight, 100, seen)


def test_regions_sum_throughput_and_take_their_stalest_node() -> None:
    nodes = [_node("a1", "a", 12, 2.0), _node("a2", "a", 11, 0.5), _node("b1", "b", 9, 1.0),
             _node("gone", "b", 1, 5.0, seen=600.0)]  # left long ago: not counted
    rows = {g.region: g for g in regions_of(nodes, {"policy": 12})}
    assert rows["a"].nodes == 2 and rows["a"].rollouts_per_s == pytest.approx(2.5) and rows["a"].version_lag == 1
    assert rows["b"].nodes == 1 and rows["b"].version_lag == 3


def test_unpublished_policy_gives_no_lag() -> None:
    assert regions_of([_node("a1", "a", 3)], {})[0].version_lag is None


def test_rule_scales_out_in_proportion_to_the_backlog() -> None:
    nodes = [_node("a1", "a", 1), _node("a2", "a", 1)]
    s = autoscale_of(task_lag=90, tasks_per_s=1.0, nodes=nodes)  # 90 s of backlog against 30 s
    assert s.backlog_s == 90 and s.desired_delta == 4  # ceil(2 * (90/30 - 1))
    assert autoscale_of(task_lag=40, tasks_per_s=1.0, nodes=nodes).desired_delta == 1  # just over: at least one


def test_rule_holds_within_target_and_scales_in_when_idle() -> None:
    busy = [_node("a1", "a", 1), _node("a2", "a", 1)]
    assert autoscale_of(task_lag=20, tasks_per_s=1.0, nodes=busy).desired_delta == 0
    idle = [_node("a1", "a", 1), _node("a2", "a", 1, inflight=0)]
    assert autoscale_of(task_lag=2, tasks_per_s=1.0, nodes=idle).desired_delta == -1
    assert autoscale_of(task_lag=0, tasks_per_s=0.0, nodes=[_node("a1", "a", 1, inflight=0)]).desired_delta == 0  # keep the last


def test_rule_without_nodes_or_without_issue_rate() -> None:
    assert autoscale_of(task_lag=5, tasks_per_s=0.0, nodes=[]).desired_delta == 1
    assert autoscale_of(task_lag=0, tasks_per_s=0.0, nodes=[]).desired_delta == 0
    s = autoscale_of(task_lag=5, tasks_per_s=0.0, nodes=[_node("a1", "a", 1)])  # tasks wait, none written lately
    assert s.backlog_s is None and s.desired_delta == 1
