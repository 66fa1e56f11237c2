"""The shared OffsetTracker as the RaaS node uses it: tasks finishing out of order."""

from astraflow.kafka.offsets import OffsetTracker

TP0, TP1 = ("tasks", 0), ("tasks", 1)


def test_commits_only_contiguous_prefix() -> None:
    t = OffsetTracker()
    epochs = {off: t.received(TP0, off) for off in (5, 6, 7)}
    t.finished(TP0, 7, epochs[7])
    assert t.to_commit() == {TP0: 5}  # 5 is still running
    t.finished(TP0, 5, epochs[5])
    assert t.to_commit() == {TP0: 6}
    t.mark_committed({TP0: 6})
    assert t.to_commit() == {}
    t.finished(TP0, 6, epochs[6])
    assert t.to_commit() == {TP0: 8}
    assert t.pending() == 0


def test_partitions_are_independent_and_forgettable() -> None:
    t = OffsetTracker()
    t.received(TP0, 1)
    t.finished(TP1, 10, t.received(TP1, 10))
    assert t.to_commit() == {TP0: 1, TP1: 11}
    t.forget({TP0})
    assert t.to_commit() == {TP1: 11}


def test_committed_and_epoch_describe_the_tracked_assignment() -> None:
    t = OffsetTracker()
    assert t.committed(TP0) is None and t.epoch(TP0) is None  # not tracked
    first = t.received(TP0, 3)
    assert t.committed(TP0) == -1 and t.epoch(TP0) == first
    t.finished(TP0, 3, first)
    t.mark_committed(t.to_commit())
    assert t.committed(TP0) == 4
    t.forget({TP0})
    assert t.committed(TP0) is None and t.epoch(TP0) is None
    second = t.received(TP0, 4)  # a new assignment of the partition, a new epoch
    assert second != first and t.epoch(TP0) == second
