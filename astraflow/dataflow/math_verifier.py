"""math-verify behind a bounded pool of worker processes, with a deadline per call.

math-verify (parse LaTeX / expressions with latex2sympy and sympy, then compare) has its own
timeout, but it is `signal.alarm`: it works only in a process's main thread, and the reward app
scores in threads and on an event loop. And sympy can spend minutes in C code (`9^{9^{9^{9}}}`)
where no signal handler runs. So each check runs in a worker process (spawned, importing
math-verify once), under the worker's own interval timer (a Python exception while sympy runs
Python code), and the caller waits at most `timeout_s + grace_s` for the answer: a worker that
is still silent then is killed and replaced, and the check's verdict is `timeout`.

At most `workers` processes run; callers beyond that wait for a free one. Verdicts of recent
(reference, answer) pairs are remembered (`CACHE_SIZE`): a group's samples share a reference and
often an answer. Workers exit when the pool is closed or collected, or when this process dies
(their pipe closes).
"""

from __future__ import annotations

import logging
import multiprocessing
import queue
import threading
import weakref
from collections import OrderedDict
from dataclasses import dataclass
from typing import Any

log = logging.getLogger("astraflow.math_verify")

CACHE_SIZE = 4096
START_TIMEOUT_S = 120.0  # spawning a worker and importing math-verify (sympy, antlr) on a busy machine


@dataclass(frozen=True, slots=True)
class Verdict:
    """The outcome of one check."""

    status: str  # verified | unparsable_reference | unparsable_answer | timeout | error
    equal: bool = False  # the answer equals the reference (only when `status` is verified)
    detail: str = ""  # what went wrong, for the trajectory's notes

    @property
    def reference_ok(self) -> bool:
        return self.status != "unparsable_reference"


def verify_pair(gold: str, pred: str) -> tuple[str, bool]:
    """(status, equal) of one pair, with math-verify's own timeouts off (the caller bounds it); an
    empty `pred` checks only that the reference parses (`unparsable_answer` when it does)."""
    from math_verify import ExprExtractionConfig, LatexExtractionConfig, parse, verify

    config = [LatexExtractionConfig(boxed_match_priority=0), ExprExtractionConfig()]
    parsed_gold = parse(gold, extraction_config=config, parsing_timeout=None)  # type: ignore[arg-type]
    if not parsed_gold:
        return "unparsable_reference", False
    if not pred:
        return "unparsable_answer", False
    parsed_pred = parse(pred, extraction_config=config, parsing_timeout=None)  # type: ignore[arg-type]
    if not parsed_pred:
        return "unparsable_answer", False
    return "verified", bool(verify(parsed_gold, parsed_pred, timeout_seconds=None))  # type: ignore[arg-type]


class _Deadline(BaseException):
    """Raised in a worker by its interval timer when a check overruns (a BaseException: math-verify
    turns every Exception of a comparison into "not equal")."""


def serve(conn: Any) -> None:
    """A worker's loop: (gold, pred, timeout_s) in, (status, equal, detail) out, until the pipe closes."""
    import signal

    logging.disable(logging.WARNING)  # math-verify logs every parse failure and the disabled timeout

    def overrun(*_: Any) -> None:
        raise _Deadline

    signal.signal(signal.SIGALRM, overrun)
    import math_verify  # noqa: F401 - loaded once, before the worker says it is ready

    conn.send("ready")
    while True:
        try:
            gold, pred, timeout_s = conn.recv()
        except (EOFError, OSError):
            return
        signal.setitimer(signal.ITIMER_REAL, max(0.01, float(timeout_s)))
        try:
            status, equal = verify_pair(gold, pred)
            out: tuple[str, bool, str] = (status, equal, "")
        except _Deadline:
            out = ("timeout", False, f"math-verify took longer than {timeout_s:g} s")
        except Exception as exc:  # latex2sympy / sympy raise anything on odd input: a verdict, not a dead worker
            out = ("error", False, f"{type(exc).__name__}: {str(exc)[:200]}")
        finally:
            signal.setitimer(signal.ITIMER_REAL, 0)
        try:
            conn.send(out)
        except (EOFError, OSError):
            return


class _Worker:
    """One spawned worker process and its pipe."""

    def __init__(self) -> None:
        ctx = multiprocessing.get_context("spawn")  # no fork of a threaded process
        self.conn, child = ctx.Pipe()
        self.proc = ctx.Process(target=serve, args=(child,), name="astraflow-math-verify", daemon=True)
        self.proc.start()
        child.close()
        if not self.conn.poll(START_TIMEOUT_S) or self.conn.recv() != "ready":
            self.kill()
            raise RuntimeError("the math-verify worker did not start (is math-verify installed?)")

    def kill(self) -> None:
        self.conn.close()
        if self.proc.is_alive():
            self.proc.kill()
        self.proc.join(timeout=5.0)


def _kill_all(workers: list[_Worker]) -> None:
    for w in workers:
        w.kill()
    workers.clear()


class MathVerifier:
    """Checks (reference, answer) pairs with math-verify in at most `workers` processes."""

    def __init__(self, timeout_s: float = 5.0, workers: int = 2, grace_s: float = 2.0) -> None:
        self.timeout_s = timeout_s  # the worker's own deadline per check
        self.grace_s = grace_s  # then the caller kills a silent worker
        self.size = max(1, workers)
        self._idle: queue.LifoQueue[_Worker] = queue.LifoQueue()
        self._all: list[_Worker] = []  # every live worker, for close()
        self._lock = threading.Lock()
        self._cache: OrderedDict[tuple[str, str], Verdict] = OrderedDict()
        self.checks = self.timeouts = self.restarts = 0  # counters for tests and metrics
        self._finalizer = weakref.finalize(self, _kill_all, self._all)

    def check(self, gold: str, pred: str) -> Verdict:
        """The verdict of `pred` against `gold` (both LaTeX or plain text)."""
        key = (gold, pred)
        with self._lock:
            hit = self._cache.get(key)
            if hit is not None:
                self._cache.move_to_end(key)
                return hit
        verdict = self._run(gold, pred)
        if verdict.status != "timeout":
            with self._lock:
                self._cache[key] = verdict
                if len(self._cache) > CACHE_SIZE:
                    self._cache.popitem(last=False)
        return verdict

    def _run(self, gold: str, pred: str) -> Verdict:
        worker = self._acquire()
        try:
            worker.conn.send((gold, pred, self.timeout_s))
            if worker.conn.poll(self.timeout_s + self.grace_s):
                status, equal, detail = worker.conn.recv()
                self.checks += 1
                if status == "timeout":
                    self.timeouts += 1
                self._release(worker)
                return Verdict(status, equal, detail)
        except (EOFError, OSError) as exc:  # the worker died (memory, a signal): replace it
            self._drop(worker)
            return Verdict("error", False, f"the math-verify worker died ({type(exc).__name__})")
        self._drop(worker)  # silent past its deadline: stuck in C code
        self.timeouts += 1
        return Verdict("timeout", False, f"math-verify took longer than {self.timeout_s + self.grace_s:g} s; "
                                         "its worker was replaced")

    def _acquire(self) -> _Worker:
        try:
            return self._idle.get_nowait()
        except queue.Empty:
            pass
        with self._lock:
            start = len(self._all) < self.size
            if start:
                self._all.append(None)  # type: ignore[arg-type] - a place held while it starts
        if not start:
            return self._idle.get()
        try:
            worker = _Worker()
        except BaseException:
            with self._lock:
                self._all.remove(None)  # type: ignore[arg-type]
            raise
        with self._lock:
            self._all[self._all.index(None)] = worker  # type: ignore[arg-type]
        return worker

    def _release(self, worker: _Worker) -> None:
        with self._lock:
            kept = worker in self._all
        if kept:
            self._idle.put(worker)
        else:  # the pool was closed while it worked
            worker.kill()

    def _drop(self, worker: _Worker) -> None:
        worker.kill()
        with self._lock:
            if worker in self._all:
                self._all.remove(worker)
            self.restarts += 1

    def close(self) -> None:
        """Stops every worker (a later check starts new ones)."""
        with self._lock:
            workers = [w for w in self._all if w is not None]
            self._all[:] = [w for w in self._all if w is None]
        while True:
            try:
                self._idle.get_nowait()
            except queue.Empty:
                break
        for w in workers:
            w.kill()
