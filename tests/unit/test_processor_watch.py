"""The failure watch of user processors (stream_apps.process): failing rate, failures in a row,
and the traceback kept in a dead letter."""

from __future__ import annotations

import pytest

from stream_apps.process import TRACEBACK_BYTES, FailureWatch, traceback_tail

pytestmark = pytest.mark.unit


def test_failing_means_more_than_half_of_the_last_hundred() -> None:
    w = FailureWatch(max_consecutive=0)
    for _ in range(9):
        w.record(True, ValueError("x"))
    assert not w.failing  # too few records to judge
    w.record(True, ValueError("boom"))
    assert w.failing and w.last_error == "ValueError: boom"
    for _ in range(100):
        w.record(False)
    assert not w.failing and w.consecutive == 0
    for i in range(100):
        w.record(i % 2 == 0)
    assert not w.failing  # exactly half is not more than half
    w.record(True)
    w.record(True)
    assert w.failing
    assert not w.exhausted  # 0: never stops


def test_exhausted_after_the_given_failures_in_a_row() -> None:
    w = FailureWatch(max_consecutive=3)
    w.record(True)
    w.record(True)
    w.record(False)
    w.record(True)
    w.record(True)
    assert not w.exhausted
    w.record(True)
    assert w.exhausted


def test_traceback_keeps_its_end_within_the_limit() -> None:
    def fail(cause: str, message: str) -> None:
        try:
            raise KeyError(cause)
        except KeyError as exc:
            raise ValueError(message) from exc

    try:
        fail("é" * 3000, "the end " * 100)  # a two-byte character: the cut must not split one
    except ValueError as exc:
        tb = traceback_tail(exc)
    assert len(tb.encode()) <= TRACEBACK_BYTES
    assert tb.startswith("[...]") and tb.endswith("ValueError: " + "the end " * 100)
    try:
        fail("short", "short")
    except ValueError as exc:
        short = traceback_tail(exc)
    assert short.startswith("Traceback (most recent call last)") and "KeyError: 'short'" in short
