"""The curator app driven by hand on a `FakeWorker` (tests/unit/stream_fakes.py), without a broker:
how far ahead it issues tasks, its prompt statistics table, its task budget."""

from __future__ import annotations

from typing import Any

import pytest
from stream_fakes import FakeWorker, curator_on_fake_worker, tick

from astraflow.kafka.received import Received
from astraflow.records import PromptStats
from astraflow.serde import AvroSerde
from stream_apps.curator import CuratorApp, CuratorOptions, tasks_ahead


def test_tasks_ahead_counts_uncurated_tasks_and_untrained_samples() -> None:
    assert tasks_ahead(issued=10, curated=10, backlog_samples=0, n_samples=4) == 0
    assert tasks_ahead(issued=10, curated=6, backlog_samples=0, n_samples=4) == 4
    assert tasks_ahead(issued=10, curated=6, backlog_samples=5, n_samples=4) == 6  # 5 samples: 2 groups
    assert tasks_ahead(issued=3, curated=5, backlog_samples=0, n_samples=4) == 0


def make_curator(tmp_path: Any, max_ahead: int = 3, max_tasks: int = 0) -> tuple[CuratorApp, FakeWorker]:
    data = tmp_path / "d.jsonl"
    data.write_text("".join(f'{{"prompt": "q{i}", "answer": "{i}", "difficulty": {i}}}\n' for i in range(5)))
    return curator_on_fake_worker(CuratorOptions([data], ["solver"], n_samples=2, max_ahead=max_ahead, max_tasks=max_tasks,
                                                 trainer_group="none"))


def test_curator_keeps_at_most_max_ahead_tasks_until_feedback_arrives(tmp_path: Any) -> None:
    app, w = make_curator(tmp_path, max_ahead=3)
    tick(app, 0.0)
    tick(app, 1.0)
    assert len(w.sent) == 3 and app.ahead == 3
    task = w.sent[0][1]
    assert task.n_samples == 2 and task.policies == ["solver"] and task.group_id == task.task_id == w.sent[0][2]
    assert task.reference.startswith('{"answer"') and task.lineage[0].name == "accept_all"
    app._on_feedback(f"solver/{task.prompt_id}", PromptStats(task.prompt_id, "d", "solver", 1, 2, 1, 1, 1, 0, 4, 0, 0))
    app._on_feedback("other/x", PromptStats("x", "d", "other", 9, 2, 1, 1, 1, 0, 4, 0, 0))  # another policy: ignored
    tick(app, 2.0)
    assert len(w.sent) == 4 and app.curated == 1
    w.control.set("curator", "pause", "on")
    app._on_feedback(f"solver/{task.prompt_id}", PromptStats(task.prompt_id, "d", "solver", 3, 6, 1, 1, 1, 0, 4, 0, 0))
    tick(app, 3.0)
    assert len(w.sent) == 4 and app.paused
    w.control.set("curator", "pause", "off")
    w.control.set("curator", "curator", "curriculum_ordered", shuffle="false", advance_at="2")
    tick(app, 4.0)
    assert len(w.sent) == 6 and w.sent[-1][1].lineage[0].name == "curriculum_ordered"
    assert {w.sent[-1][1].prompt_id, w.sent[-2][1].prompt_id} == {"d/0"}  # only the easiest level


def test_curator_measures_the_trainers_while_blocked_and_issues_on_the_tick_room_is_made(tmp_path: Any) -> None:
    app, w = make_curator(tmp_path, max_ahead=2)
    serde, backlog, measured = AvroSerde(), [0], []
    app.measure_backlog = lambda policy, ends=True: measured.append(policy) or backlog[0]  # type: ignore[method-assign]
    tick(app, 0.0)  # the first tick measures (gauges), then issues
    assert len(w.sent) == 2 and len(measured) == 1
    tick(app, 0.001)  # blocked, measured less than lag_interval_s ago: no request to Kafka
    assert len(measured) == 1
    backlog[0] = 4  # both groups curated: their 4 samples wait for the trainer
    for _, task, _ in w.sent:
        stats = PromptStats(task.prompt_id, "d", "solver", 1, 2, 1, 1, 1, 0, 4, 0, 0)
        app.handle(Received(stats, "feedback", 0, 0, f"solver/{task.prompt_id}".encode(), 0, serde.dumps(stats), {}))
    tick(app, 0.002)  # feedback arrived: measured at once; curated 2 but 4 samples not trained: still 2 ahead
    assert len(measured) == 2 and app.ahead == 2 and len(w.sent) == 2
    backlog[0] = 0  # the trainer took the batch
    tick(app, 0.01)
    assert len(measured) == 2 and len(w.sent) == 2  # not due yet
    tick(app, app.options.lag_interval_s + 0.002)  # due: measured, and the 2 freed slots are filled on this tick
    assert len(measured) == 3 and len(w.sent) == 4 and app.ahead == 2


def test_curator_keeps_prompt_statistics_in_its_table_and_recovers_them(tmp_path: Any) -> None:
    app, w = make_curator(tmp_path)
    serde = AvroSerde()

    def feedback(key: str, stats: PromptStats) -> Received[Any]:
        return Received(stats, "feedback", 0, 0, key.encode(), 0, serde.dumps(stats), {})

    app.handle(feedback("solver/d/1", PromptStats("d/1", "d", "solver", 2, 4, 1, 1, 1, 0, 4, 0, 0)))
    app.handle(feedback("solver/d/1", PromptStats("d/1", "d", "solver", 1, 2, 1, 1, 1, 0, 4, 0, 0)))  # older: ignored
    app.handle(feedback("other/d/2", PromptStats("d/2", "d", "other", 5, 2, 1, 1, 1, 0, 4, 0, 0)))  # other policy
    assert list(w.tables["prompt_stats"]) == [b"solver/d/1"] and app.curated == 2
    # A restarted (or taking-over) worker starts from the table Faust recovered from its changelog.
    again, w2 = make_curator(tmp_path)
    w2.tables["prompt_stats"].update(w.tables["prompt_stats"])
    again.on_recovered("prompt_stats")
    assert again.curated == 2 and again.stats["d/1"].groups == 2


def test_curator_stops_after_max_tasks(tmp_path: Any) -> None:
    app, w = make_curator(tmp_path, max_ahead=10, max_tasks=2)
    tick(app, 0.0)
    tick(app, 1.0)
    assert len(w.sent) == 2 and w.stopped


def test_curator_feeds_greso_the_zero_variance_share_it_sees(tmp_path: Any) -> None:
    app, w = make_curator(tmp_path, max_ahead=1)
    w.control.set("curator", "curator", "greso", step="0.1", p_easy="0.5", p_hard="0.5")
    greso = app.slot.get().impl
    for i in range(4):  # four groups came back, all of them all-solved: far above the 25% target
        app._on_feedback(f"solver/d/{i}", PromptStats(f"d/{i}", "d", "solver", 1, 2, 1.0, 1.0, 1, 0, 4, 1, 0))
    tick(app, 0.0)
    # all-solved share 100% > its target: skip more easy prompts; all-failed share 0%: skip fewer hard ones
    assert greso.p_easy == pytest.approx(0.4) and greso.p_hard == pytest.approx(0.6)
    assert app.curated == 4 and app._zv == [0, 0, 0]


def test_curator_makes_no_request_while_paused_and_measures_before_it_issues_again(tmp_path: Any) -> None:
    app, w = make_curator(tmp_path, max_ahead=2)
    backlog, measured = [0], []
    app.measure_backlog = lambda policy, ends=True: measured.append(ends) or backlog[0]  # type: ignore[method-assign]
    w.control.set("curator", "pause", "on")
    for t in range(20):  # well past every interval: still nothing asked of Kafka
        tick(app, t * 0.5)
    assert measured == [] and w.sent == [] and app.paused
    backlog[0] = 4  # meanwhile (say, a restart) two groups of samples wait for the trainer
    w.control.set("curator", "pause", "off")
    tick(app, 10.0)
    assert measured == [True] and app.ahead == 2 and w.sent == []  # measured first: no room, nothing issued


def test_curator_reads_end_offsets_again_only_after_feedback_and_pairs_them_with_curated(tmp_path: Any) -> None:
    app, w = make_curator(tmp_path, max_ahead=2)
    serde, backlog, measured = AvroSerde(), [0], []
    app.measure_backlog = lambda policy, ends=True: measured.append(ends) or backlog[0]  # type: ignore[method-assign]
    tick(app, 0.0)  # the first measurement reads everything
    assert measured == [True] and len(w.sent) == 2
    lag = app.options.lag_interval_s
    tick(app, lag + 0.001)  # blocked, no feedback since: the committed offsets only
    assert measured == [True, False]
    # a group is curated but its feedback is only in the statistics (as if read while the end offsets
    # were being read): without new end offsets its samples may be missing from the backlog, so it
    # must still count as ahead, whatever the committed offsets say
    first = w.sent[0][1]
    app._on_feedback(f"solver/{first.prompt_id}", PromptStats(first.prompt_id, "d", "solver", 1, 2, 1, 1, 1, 0, 4, 0, 0))
    tick(app, 2 * lag + 0.002)
    assert measured[-1] is False and app.curated == 1 and app.ahead == 2 and len(w.sent) == 2
    # the feedback record itself arrives (curate's transaction is visible): new end offsets, counted with it
    second = w.sent[1][1]
    stats = PromptStats(second.prompt_id, "d", "solver", 1, 2, 1, 1, 1, 0, 4, 0, 0)
    app.handle(Received(stats, "feedback", 0, 0, f"solver/{second.prompt_id}".encode(), 0, serde.dumps(stats), {}))
    backlog[0] = 2  # one group's samples wait for the trainer
    tick(app, 2 * lag + 0.003)
    assert measured[-1] is True and len(w.sent) == 3 and app.ahead == 2  # 2 issued - 2 curated + 1 group: room for one
    tick(app, 4 * lag)
    assert measured[-1] is False
    tick(app, 2 * lag + 0.004 + app.options.gauge_interval_s)  # and at least every gauge interval, feedback or not
    assert measured[-1] is True
    assert app.gauges()["backlog_measurements_total"] == 6 and app.gauges()["end_offset_reads_total"] == 3
