"""bench/_regions_report.py: a node counts idle only while tasks it could take wait (its own
partitions, arrived, not started), and a node's start-up is split into its parts."""

from __future__ import annotations

import datetime as dt

import pytest
from _regions_report import (
    busy_spans,
    held_mean,
    idle_while_waiting,
    loss_figures,
    open_tasks,
    owner_at,
    owners,
    recovered_after,
    reported,
    startup_parts,
    transit_s,
)

pytestmark = pytest.mark.unit

A, B = ("tasks", 0), ("tasks", 1)


def test_a_partition_belongs_to_the_node_that_started_its_last_rollout():
    by = owners([("n1", A, 10.0), ("n2", A, 20.0), ("n1", B, 5.0)])
    assert owner_at(by, A, 5.0) == "n1"  # before any start: its first owner
    assert owner_at(by, A, 15.0) == "n1" and owner_at(by, A, 20.0) == "n2" and owner_at(by, A, 99.0) == "n2"
    assert owner_at(by, ("tasks", 7), 1.0) is None


def test_idle_is_time_without_a_rollout_while_its_own_arrived_task_waits():
    by = owners([("n1", A, 0.0), ("n2", B, 0.0)])
    spans = [(0.0, 10.0), (5.0, 12.0), (20.0, 30.0), (29.0, 40.0)]  # n1 busy 0-12 and 20-40
    tasks = [
        (B, 12.0, 14.0),  # 12-14: waiting, but in n2's partition
        (A, 14.0, 16.0),  # 14-16: n1's, but crossing until 14.5 (transit 0.5): idle 1.5 s of 2
        (A, 25.0, 35.0),  # n1 has rollouts in flight meanwhile
        (A, 40.0, 44.0),  # after the window
    ]
    assert idle_while_waiting("n1", spans, tasks, by, 0.5, 0.0, 40.0) == pytest.approx(1.5 / 40)
    assert idle_while_waiting("n1", spans, tasks, by, 0.0, 0.0, 40.0) == pytest.approx(2.0 / 40)  # on the way too
    # two tasks waiting at once count once; a task started elsewhere first stops counting then
    both = [(A, 13.0, 18.0), (A, 14.0, 16.0)]
    assert idle_while_waiting("n1", spans, both, by, 0.0, 0.0, 40.0) == pytest.approx(5.0 / 40)
    assert idle_while_waiting("n2", [], tasks, by, 0.0, 0.0, 40.0) == pytest.approx(2.0 / 40)  # 12-14
    assert idle_while_waiting("n1", spans, tasks, by, 0.0, 5.0, 5.0) == 0.0
    assert busy_spans([(5.0, 6.0), (0.0, 2.0), (1.0, 3.0)]) == [(0.0, 3.0), (5.0, 6.0)]


def test_tasks_held_is_the_mean_number_written_and_not_done():
    assert held_mean([(0.0, 10.0), (5.0, 15.0), (-5.0, float("inf"))], 0.0, 10.0) == pytest.approx(2.5)
    assert held_mean([], 0.0, 10.0) == 0.0


def test_what_a_node_reported_counts_only_its_own_partitions_and_ignores_garbage():
    by = owners([("b1", A, 0.0), ("a1", B, 0.0)])
    commits = [(1.0, 0, 10, "rtt_ms=300;speed=2.000"), (1.0, 1, 50, "rtt_ms=2;speed=20.000"),
               (2.0, 0, 14, "rtt_ms=320;speed=3.000"), (2.0, 1, 90, "garbage"), (9.0, 0, 30, "rtt_ms=300;speed=9")]
    got = reported("b1", commits, "tasks", by, 0.0, 5.0, group=4)
    assert got["reported_speed_rps"] == pytest.approx(10.0)  # (2 + 3) / 2 tasks/s x 4 samples
    assert got["commit_rtt_s"] == pytest.approx(0.31)  # the median
    assert got["refill_delay_s"] == pytest.approx(3 * 0.31 + 0.2, abs=0.031)
    assert got["reserve_tasks"] == pytest.approx((2 * 1.1 + 3 * 1.16) / 2, abs=0.1)
    assert reported("zz", commits, "tasks", by, 0.0, 5.0, 4)["reported_speed_rps"] is None


def test_throughput_back_after_a_join():
    times = [i * 0.1 for i in range(100)] + [20 + i * 0.1 for i in range(100)]  # 10/s, a gap 10-20 s, 10/s again
    back, low = recovered_after(times, 16.0, 30.0, base=10.0)
    assert back == pytest.approx(8.5) and low == 0.0  # at 24.5 s the last 5 s hold 45 rollouts: 90% of 10/s
    assert recovered_after(times, 5.0, 9.0, base=10.0) == (0.0, 1.0)  # never below: back at once, nothing lost


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
                                   "to_first_start": 0.5, "to_first_rollout": 0.5, "total": 17.0,
                                   "ready": 12.5}, abs=0.01)
    # a missing line: that part is None and the next includes it
    parts = startup_parts(log.replace("caught up", "behind"), t, t + 16.5, t + 17.0)
    assert parts["to_caught_up"] is None and parts["to_joined"] == pytest.approx(3.5, abs=0.01)
    assert startup_parts("", t, None, None)["total"] is None


class _FakeRun:
    """What regions.main drives, without brokers or nodes: stopped (SIGTERM) in its elastic phase."""

    instances: list[_FakeRun] = []
    handlers: list[tuple] = []  # regions.main's signal.signal calls

    def __init__(self, a, exp: str) -> None:
        self.a, self.marks, self.closed, self.saved, self.timing = a, {}, False, None, {}
        _FakeRun.instances.append(self)

    def step(self, name: str) -> None:
        self.timing[name] = 0.0

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


def test_the_loss_count_is_a_number_only_when_the_drain_ended_with_nothing_moving():
    from types import SimpleNamespace

    from _ledger import IssuedTask

    ledger = SimpleNamespace(tasks={"t1": IssuedTask("t1", 2, 0, None), "t2": IssuedTask("t2", 2, 0, None),
                                    "t3": IssuedTask("t3", 1, 0, None)},
                             accounted={"t2/1#policy": "dlq"},
                             trained_counts=lambda: {"t1/0#policy": 1, "t1/1#policy": 1, "t3/0#policy": 1})
    assert open_tasks(ledger) == 1  # t2: one sample dead-lettered, the other neither trained nor dead-lettered
    assert loss_figures("accounted", 0, 0) == {"drain_end": "accounted", "samples_lost": 0}
    assert loss_figures("stalled", 3, 2)["samples_lost"] == 3  # nothing moved for a minute: lost
    cut = loss_figures("deadline", 40, 9)  # still moving when the deadline came: unknown, not 40
    assert cut["samples_lost"] is None and cut["samples_not_accounted_at_cut"] == 40
    assert cut["tasks_not_accounted_at_cut"] == 9 and "deadline" in cut["samples_lost_unknown"]
    stopped = loss_figures(None, 5, 1)  # the run stopped before its drain ended (a SIGTERM)
    assert stopped["samples_lost"] is None and stopped["drain_end"] == "stopped"


def test_the_drain_counts_as_accounted_only_when_nothing_is_outstanding_twice_and_after_its_last_read():
    from types import SimpleNamespace

    from _regions_run import RegionsRun

    def drained(outstanding: list[int], complete: bool = True, timeout_s: float = 30.0) -> str:
        run = RegionsRun.__new__(RegionsRun)
        left = list(outstanding)
        now = [left.pop(0)]

        def refresh() -> None:
            if left:
                now[0] = left.pop(0)

        run.control = SimpleNamespace(set=lambda *a, **k: None)
        run.ledger = SimpleNamespace(refresh=refresh, outstanding=lambda: now[0], complete=complete)
        run.refresh = run.wait = lambda *a: None
        run.marks, run.timing, run._step_at = {}, {}, 0.0
        run.drain(idle_s=60.0, timeout_s=timeout_s)
        return run.drain_end

    assert drained([8, 4, 0, 0, 0]) == "accounted"
    assert drained([8, 0, 12, 4, 0, 0, 0]) == "accounted"  # a zero then the curator's last tasks: not yet
    assert drained([8, 0, 0, 12]) == "late tasks"  # tasks read only by the final read (run 12)
    # reads cut by their timeout (some partition not read to its end): zeros prove nothing
    assert drained([8, 0, 0, 0], complete=False, timeout_s=0.5) == "deadline"


def test_node_cpus_gives_every_node_of_the_run_its_quota_and_refuses_unknown_names():
    from _regions_run import node_cpus

    names = ["raas-a1", "raas-a2", "raas-b1"]
    assert node_cpus("raas-a1=0.3, raas-a2=0.1,raas-b1=0.2,raas-b2=0.2", names) == {
        "raas-a1": 0.3, "raas-a2": 0.1, "raas-b1": 0.2}  # raas-b2: the --via mm2 node, not in this run
    assert node_cpus("raas-a2=0.1", names) == {"raas-a1": 0.0, "raas-a2": 0.1, "raas-b1": 0.0}  # others uncapped
    with pytest.raises(ValueError, match="raas-c1"):
        node_cpus("raas-c1=0.5", names)


def test_mm2_without_no_calibrate_is_refused_before_anything_starts(capsys) -> None:
    import regions

    # Calibrating one node at a time cannot work through MirrorMaker 2: region B's fixed share
    # of the tasks would fill the curator's window (the 180 s stall of a run at 19629e6).
    with pytest.raises(SystemExit) as refused:
        regions.parse(["--quick", "--via", "mm2"])
    assert refused.value.code == 2 and "--no-calibrate" in capsys.readouterr().err
    a = regions.parse(["--quick", "--via", "mm2", "--no-calibrate"])
    assert a.via == "mm2" and a.no_calibrate
    assert regions.parse(["--quick"]).via == "wan"  # calibration over the direct WAN link stays the default
