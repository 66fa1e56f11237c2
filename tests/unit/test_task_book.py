"""`TaskBook.claim`: a group curate has not seen yet is first looked up in what the readers
already fetched; only a group still unknown then costs a catch-up of every tasks topic (which
curate's event loop waits for)."""

from __future__ import annotations

import time

from astraflow.records import Task
from stream_apps.task_book import TaskBook


def task(i: int) -> Task:
    return Task(task_id=f"t{i}", group_id=f"g{i}", prompt_id=f"p{i}", dataset="d", workflow="rlvr", prompt="1+1",
                policies=["policy"], n_samples=2)


class Reader:
    """Stands in for a tasks topic's CompactedReader: `fetched` tasks arrived in the client (a
    refresh takes them), `on_broker` ones only a catch-up reaches."""

    def __init__(self, book: TaskBook) -> None:
        self.book, self.fetched, self.on_broker = book, [], []
        self.catch_ups = 0

    def refresh(self) -> int:
        taken, self.fetched = self.fetched, []
        for t in taken:
            self.book._on_task(t.group_id, t)
        return len(taken)

    def catch_up(self, timeout_s: float = 15.0) -> None:
        self.catch_ups += 1
        self.refresh()
        taken, self.on_broker = self.on_broker, []
        for t in taken:
            self.book._on_task(t.group_id, t)


def book_with_reader() -> tuple[TaskBook, Reader]:
    book = TaskBook.__new__(TaskBook)  # no cluster: the readers are stand-ins
    book.claims, book.lookups, book._admin = {}, 0, None
    reader = Reader(book)
    book.readers = {"af.x.tasks": reader}
    book._listed_at = time.monotonic()  # listed just now: no new region's topic is looked for
    return book, reader


def test_a_task_already_fetched_is_claimed_without_a_catch_up() -> None:
    book, reader = book_with_reader()
    reader.fetched.append(task(1))  # arrived since the last tick's refresh
    claim = book.claim("g1")
    assert claim is not None and claim.n_samples == 2 and claim.task_id == "t1"
    assert reader.catch_ups == 0 and book.lookups == 0


def test_a_task_not_fetched_yet_is_found_by_the_catch_up_and_none_is_no_task() -> None:
    book, reader = book_with_reader()
    reader.on_broker.append(task(2))
    assert book.claim("g2") is not None and reader.catch_ups == 1 and book.lookups == 1
    assert book.claim("g3") is None and reader.catch_ups == 2  # no task made it: read to the end first
