"""bench/_regions_report.py: a node counts idle only while tasks it could take wait (its own
partitions, arrived, not started), and a node's start-up is split into its parts."""

from __future__ import annotations

import datetime as dt

import pytest
from _regions_report import idle_while_waiting, owner_at, owners, startup_parts, transit_s

pytestmark = pytest.mark.unit

A, B = ("tasks", 0), ("tasks", 1)


def test_a_partition_belongs_to_the_node_that_started_its_last_rollout():
    by = owners([("n1", A, 10.0), ("n2", A, 20.0), ("n1", B, 5.0)])
    assert owner_at(by, A, 5.0) == "n1"  # before any start: its first owner
    assert owner_at(by, A, 15.0) == "n1" and owner_at(by, A, 20.0) == "n2" and owner_at(by, A, 99.0) == "n2"
    assert owner_at(by, ("tasks", 7), 1.0) is None


def test_idle_counts_only_tasks_in_its_own_arrived_and_not_started():
    by = owners([("n1", A, 0.0), ("n2", B, 0.0)])
    samples = [(10.0, 0.0), (20.0, 0.0), (30.0, 2.0), (40.0, 0.0)]
    tasks = [
        (B, 9.0, 12.0),  # 10 s: waiting, but in n2's partition
        (A, 19.9, 21.0),  # 20 s: written 0.1 s before, still crossing (transit 0.3 s)
        (A, 29.0, 31.0),  # 30 s: waiting, but n1 has rollouts in flight
        (A, 39.0, 41.0),  # 40 s: n1 empty, its own task arrived and not started: idle
    ]
    assert idle_while_waiting("n1", samples, tasks, by, transit=0.3) == pytest.approx(1 / 4)
    # the same tasks with no transit: the one written 0.1 s before counts too
    assert idle_while_waiting("n1", samples, tasks, by, transit=0.0) == pytest.approx(2 / 4)
    # a task started elsewhere (in flight elsewhere) before the sample does not count
    assert idle_while_waiting("n1", [(40.0, 0.0)], [(A, 39.0, 39.5)], by, transit=0.0) == 0.0
    assert idle_while_waiting("n2", samples, tasks, by, transit=0.3) == pytest.approx(1 / 4)  # at 10 s
    assert idle_while_waiting("n1", [], tasks, by, transit=0.0) == 0.0


def test_transit_is_a_fetch_cycle_three_times_the_shortest_write_to_start():
    starts = [("b1", "t1", 10.4), ("b1", "t2", 20.2), ("a1", "t3", 30.0), ("b1", "unknown", 1.0)]
    written = {"t1": 10.0, "t2": 20.05, "t3": 30.01}
    assert transit_s("b1", starts, written) == pytest.approx(0.45)
    assert transit_s("a1", starts, written) == 0.0  # clocks a little apart: never below 0
    assert transit_s("zz", starts, written) == 0.0


def _line(t: float, text: str) -> str:
    stamp = dt.datetime.fromtimestamp(t)
    return f"{stamp:%Y-%m-%d %H:%M:%S},{stamp.microsecond // 1000:03d} astraflow.raas INFO {text}"


def test_startup_is_split_at_the_nodes_log_lines():
    t = 1_800_000_000.0
    log = "\n".join([
        _line(t - 50, "node starting (modules imported)"),  # an earlier start of the same node: ignored
        _line(t + 4, "node starting (modules imported)"),
        "a traceback line without a time",
        _line(t + 6, "engine process: modules imported (torch)"),
        _line(t + 7, "engine process: transformers imported"),
        _line(t + 8.5, "engine process: model loaded"),
        _line(t + 9, "backends built: policy"),
        _line(t + 12, "caught up in 3.0 s: policy at version 40"),
        _line(t + 12.5, "joining the tasks group (ready to serve)"),
        _line(t + 13, "assigned []"),  # an empty assignment is no join
        _line(t + 16, "assigned [2, 5]"),
    ])
    parts = startup_parts(log, t, first_start=t + 16.5, first_rollout=t + 17.0)
    assert parts == pytest.approx({"to_imports": 4.0, "to_engine_torch": 2.0, "to_engine_transformers": 1.0,
                                   "to_engine_model": 1.5, "to_backends": 0.5, "to_caught_up": 3.0, "to_joined": 0.5,
                                   "to_assigned": 3.5,
                                   "to_first_start": 0.5, "to_first_rollout": 0.5, "total": 17.0}, abs=0.01)
    # a missing line: that part is None and the next includes it
    parts = startup_parts(log.replace("caught up", "behind"), t, t + 16.5, t + 17.0)
    assert parts["to_caught_up"] is None and parts["to_joined"] == pytest.approx(3.5, abs=0.01)
    assert startup_parts("", t, None, None)["total"] is None


class _FakeRun:
    """What regions.main drives, without brokers or nodes: stopped (SIGTERM) in its elastic phase."""

    instances: list[_FakeRun] = []
    handlers: list[tuple] = []  # regions.main's signal.signal calls

    def __init__(self, a, exp: str) -> None:
        self.a, self.marks, self.closed, self.saved = a, {}, False, None
        _FakeRun.instances.append(self)

    def setup(self) -> None: ...
    def follow_wan(self, stop) -> None: ...
    def calibrate(self) -> None: ...

    def mixed(self) -> None:
        self.marks.update(mixed_start=1.0, mixed_end=2.0)

    def elastic(self) -> None:
        raise SystemExit(143)  # what the benchmark's SIGTERM handler raises

    def drain(self) -> None:
        self.marks["drained"] = 3.0

    def close_links(self) -> None: ...

    def save_raw(self, path) -> None:
        self.saved = path

    def report(self) -> dict:
        self.handlers_at_report = list(_FakeRun.handlers)
        return {"experiment": "x", "load_avg": "0.0", "wan": "-", "nodes": [], "figures": {}}

    def close(self) -> None:
        self.closed = True


def test_a_run_stopped_by_its_deadline_still_writes_its_figures(tmp_path, monkeypatch) -> None:
    import json

    import regions

    monkeypatch.setattr(regions, "RegionsRun", _FakeRun)
    monkeypatch.setattr(regions.signal, "signal", lambda *a: _FakeRun.handlers.append(a))  # pytest's own stays
    out = tmp_path / "r.json"
    with pytest.raises(SystemExit):
        regions.main(["--quick", "--no-calibrate", "--json", str(out), "--work-dir", str(tmp_path)])
    run = _FakeRun.instances[-1]
    assert run.closed and run.saved == out.with_suffix(".raw.pickle")
    # a second SIGTERM (the deadline again) while the figures are computed is ignored, not fatal to them
    assert run.handlers_at_report[-1] == (regions.signal.SIGTERM, regions.signal.SIG_IGN)
    assert json.loads(out.read_text())["completed"] is False
    # a run that ends normally: completed
    monkeypatch.setattr(_FakeRun, "elastic", lambda self: None)
    assert regions.main(["--quick", "--no-calibrate", "--json", str(out), "--work-dir", str(tmp_path)])["completed"] is True
