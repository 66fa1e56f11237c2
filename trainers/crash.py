"""Deliberate crashes for tests: the trainer SIGKILLs itself at a named point of its cycle.

`ASTRAFLOW_TRAINER_CRASH_AT=<point>[:<n>][@<rank>]` makes the trainer process kill itself with
SIGKILL (no cleanup, no flush: a faithful `kill -9`) the n-th time (default 1) it reaches
`<point>`; with `@<rank>`, only the process of that rank (`LOCAL_RANK`, set by Lightning's
launcher for every rank of a multi-process run) does; without, every rank that reaches it:

- ``step_trained``: an optimizer step is done, nothing of it is checkpointed or published;
- ``after_checkpoint``: the checkpoint of a version is durable, the version is not published;
- ``chunks_sent``: a version's manifest and chunks are acknowledged inside their transaction,
  the transaction is not committed;
- ``after_publish``: the version is committed (it goes out in the background while the next step
  trains; the point is reached when the trainer next waits for it: before its next checkpoint,
  publication or the end), nothing later is checkpointed.

Unset (the default), every point is a no-op.
"""

from __future__ import annotations

import os
import signal

ENV = "ASTRAFLOW_TRAINER_CRASH_AT"
POINTS = ("step_trained", "after_checkpoint", "chunks_sent", "after_publish")


class CrashPoints:
    """Counts arrivals at each point and kills the process at the configured one."""

    def __init__(self, spec: str | None = None) -> None:
        spec = os.environ.get(ENV, "") if spec is None else spec
        self.point, self.nth = None, 1
        self.rank: int | None = None  # only this rank crashes (None: any)
        if spec:
            spec_at, _, rank = spec.partition("@")
            name, _, nth = spec_at.partition(":")
            if name not in POINTS:
                raise ValueError(f"{ENV}={spec!r}: the point must be one of {', '.join(POINTS)}")
            self.point, self.nth = name, int(nth or 1)
            self.rank = int(rank) if rank else None
        self.reached: dict[str, int] = {}

    def __call__(self, point: str) -> None:
        """Mark arrival at `point`; SIGKILL this process if it is the configured arrival."""
        self.reached[point] = self.reached.get(point, 0) + 1
        if self.rank is not None and int(os.environ.get("LOCAL_RANK", "0")) != self.rank:
            return
        if point == self.point and self.reached[point] == self.nth:
            os.kill(os.getpid(), signal.SIGKILL)
