"""`consume_ready`: a read returns as soon as a record is there, never waiting for a full batch.

`Consumer.consume(n, t)` returns only once it has n messages or t has passed, so the trainer
(batches of 64 read 500 at a time) and the weight follower waited out their poll timeout after
every record. The stand-in consumer below fails any `consume` with a positive timeout: the
waiting must be done by `poll`, which returns at the first message.
"""

from __future__ import annotations

from typing import Any

import pytest

from astraflow.kafka.clients import consume_ready


class Held:
    """A consumer holding `ready` messages now, and `later` for a poll to wait for."""

    def __init__(self, ready: list[str], later: list[str]) -> None:
        self.ready, self.later, self.polls = list(ready), list(later), []

    def consume(self, n: int, timeout: float) -> list[Any]:
        if timeout > 0:
            raise AssertionError("consume with a timeout waits for n messages")
        out, self.ready = self.ready[:n], self.ready[n:]
        return out

    def poll(self, timeout: float) -> Any:
        self.polls.append(timeout)
        if not self.later:
            return None
        first, *rest = self.later
        self.later, self.ready = [], self.ready + rest
        return first


def test_what_the_client_holds_comes_without_waiting() -> None:
    c = Held(["a", "b", "c"], ["d"])
    assert consume_ready(c, 2, 5.0) == ["a", "b"]
    assert consume_ready(c, 5, 5.0) == ["c"]
    assert c.polls == []


def test_the_first_record_ends_the_wait_and_the_rest_of_its_fetch_comes_along() -> None:
    c = Held([], ["a", "b", "c"])
    assert consume_ready(c, 500, 5.0) == ["a", "b", "c"]
    assert c.polls == [5.0]


@pytest.mark.parametrize("max_records", [1, 2])
def test_never_more_than_asked(max_records: int) -> None:
    c = Held([], ["a", "b", "c"])
    assert consume_ready(c, max_records, 5.0) == ["a", "b"][:max_records]


def test_nothing_within_the_timeout_is_an_empty_list_and_zero_does_not_wait() -> None:
    c = Held([], [])
    assert consume_ready(c, 500, 0.5) == []
    assert consume_ready(c, 500, 0) == []
    assert c.polls == [0.5]
