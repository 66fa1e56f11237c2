"""Brokers the fault harness may kill: its own local Kafka, never the shared one.

`Brokers` wraps `astraflow.kafka.local.LocalKafka` on ports the caller chooses, with its own
data directory, and adds what a fault needs: `kill` (SIGKILL, the process gone at once, its
log segments as they were), `pause` / `resume` (SIGSTOP / SIGCONT: the process alive but mute,
its TCP connections open) and `start` (the same data directory again, as an operator would).
"""

from __future__ import annotations

import contextlib
import os
import signal
import time
from pathlib import Path

from astraflow.config import LocalKafkaSettings
from astraflow.errors import PortInUseError
from astraflow.kafka.local import LocalKafka


class Brokers:
    """One local KRaft broker+controller on `port` / `port + 1`, data under `data_dir`."""

    def __init__(self, data_dir: Path, port: int) -> None:
        self.kafka = LocalKafka(LocalKafkaSettings(data_dir=data_dir, port=port, controller_port=port + 1))
        self.count = 1
        self.replication_factor = 1

    @property
    def bootstrap(self) -> str:
        return self.kafka.bootstrap

    def up(self) -> None:
        self.kafka.up(echo=lambda *_: None)

    def pid(self, index: int = 0) -> int:
        pid = self.kafka.status().pid
        if pid is None:
            raise RuntimeError(f"broker {index} is not running ({self.kafka.root})")
        return pid

    def kill(self, index: int | None = None) -> None:
        """kill -9 broker `index` (None: all) and wait until it is gone."""
        pid = self.pid(index or 0)
        os.kill(pid, signal.SIGKILL)
        while _alive(pid):
            time.sleep(0.05)

    def pause(self, index: int | None = None) -> None:
        """SIGSTOP broker `index` (None: all)."""
        os.kill(self.pid(index or 0), signal.SIGSTOP)

    def resume(self, index: int | None = None) -> None:
        os.kill(self.pid(index or 0), signal.SIGCONT)

    def start(self, index: int | None = None, timeout_s: float = 120.0) -> None:
        """Starts broker `index` (None: all) again on its data directory; returns once it answers.

        While a broker is down, its clients keep connecting to its port; when that port lies in
        the ephemeral range (here 39000 does), a connect may bind it as its own source port and
        hold it for a moment (a TCP self-connect). So a port in use is retried, not fatal."""
        deadline = time.monotonic() + timeout_s
        while True:
            try:
                self.kafka.up(echo=lambda *_: None)
                return
            except PortInUseError:
                if time.monotonic() > deadline:
                    raise
                time.sleep(0.5)

    def down(self) -> None:
        """Stops the broker (resumed first if it was paused)."""
        pid = self.kafka.status().pid
        if pid is not None:
            os.kill(pid, signal.SIGCONT)
        self.kafka.down(echo=lambda *_: None)


def _alive(pid: int) -> bool:
    with contextlib.suppress(ChildProcessError):
        os.waitpid(pid, os.WNOHANG)  # our child when we started it: reap it
    try:
        state = Path(f"/proc/{pid}/stat").read_text().split(") ", 1)[1][:1]
    except (OSError, IndexError):
        return False
    return state != "Z"
