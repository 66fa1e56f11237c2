from astraflow.raas.offsets import OffsetTracker


def test_commits_only_contiguous_prefix() -> None:
    t = OffsetTracker()
    for off in (5, 6, 7):
        t.start("tasks", 0, off)
    t.finish("tasks", 0, 7)
    assert t.committable() == {("tasks", 0): 5}  # 5 is still running
    t.finish("tasks", 0, 5)
    assert t.committable() == {("tasks", 0): 6}
    t.mark_committed({("tasks", 0): 6})
    assert t.committable() == {}
    t.finish("tasks", 0, 6)
    assert t.committable() == {("tasks", 0): 8}
    assert t.outstanding == 0


def test_partitions_are_independent_and_forgettable() -> None:
    t = OffsetTracker()
    t.start("tasks", 0, 1)
    t.start("tasks", 1, 10)
    t.finish("tasks", 1, 10)
    assert t.committable() == {("tasks", 0): 1, ("tasks", 1): 11}
    t.forget("tasks", 0)
    assert t.committable() == {("tasks", 1): 11}
