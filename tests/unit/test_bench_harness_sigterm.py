"""bench/_harness.Harness.run: a SIGTERM (`timeout`, `kill`) stops the run through its cleanup
(every role and broker stopped), not the process on the spot, which would leave the roles behind."""

from __future__ import annotations

import os
import signal
import time
from pathlib import Path

import pytest

pytestmark = pytest.mark.unit


def test_a_sigterm_during_the_set_up_stops_the_run_through_its_cleanup() -> None:
    from _harness import Harness

    h = Harness.__new__(Harness)
    closed = []
    h.exp, h.work, h.brokers = "x", Path("w"), type("B", (), {"bootstrap": "-"})()

    def setup() -> None:
        os.kill(os.getpid(), signal.SIGTERM)
        time.sleep(5)  # the signal arrives meanwhile

    h.setup = setup
    h.close = lambda: closed.append(True)
    before = signal.getsignal(signal.SIGTERM)
    with pytest.raises(KeyboardInterrupt):
        h.run()
    assert closed == [True]
    assert signal.getsignal(signal.SIGTERM) == before  # the handler is the caller's again afterwards
