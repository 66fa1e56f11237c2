"""Brokers the fault harness may kill: its own local Kafka, never the shared one.

`Brokers` runs `astraflow.kafka.local.LocalKafka` (one node, or `--brokers 3`: replication factor
3, min.insync.replicas 2) on ports the caller chooses, in its own data directory, and adds what
the faults need: `kill` (SIGKILL: the process gone at once, its log segments as they were),
`pause` / `resume` (SIGSTOP / SIGCONT: the process alive but mute, its connections open) and
`start` (the same data directory again, as an operator would). `index` None means every node.
"""

from __future__ import annotations

import os
import signal
import time
from collections.abc import Callable
from pathlib import Path

from astraflow.config import LocalKafkaSettings
from astraflow.errors import LocalKafkaError, PortInUseError
from astraflow.kafka.local import LocalKafka

_QUIET = lambda *_: None  # noqa: E731


class Brokers:
    """`count` local KRaft nodes; node i listens on port + 2(i-1), its controller one above."""

    def __init__(self, data_dir: Path, port: int, count: int = 1) -> None:
        self.kafka = LocalKafka(LocalKafkaSettings(data_dir=data_dir, port=port, controller_port=port + 1, brokers=count,
                                                   start_timeout_s=300.0))  # a loaded machine restarts slowly
        self.count = count
        self.replication_factor = 3 if count >= 3 else 1
        self.min_insync_replicas = 2 if count >= 3 else None

    @property
    def bootstrap(self) -> str:
        return self.kafka.bootstrap

    def _ids(self, index: int | None) -> list[int]:
        return list(range(1, self.count + 1)) if index is None else [index]

    def _pid(self, node_id: int) -> int:
        pid = self.kafka.status().nodes[node_id - 1].pid
        if pid is None:
            raise RuntimeError(f"Kafka node {node_id} is not running ({self.kafka.root})")
        return pid

    def up(self) -> None:
        """Starts every node that is not running; returns once all answer."""
        self._retried(lambda: self.kafka.up(echo=_QUIET))

    def _retried(self, start: Callable[[], object], timeout_s: float = 600.0) -> None:
        """`start()`, again while a port is taken: while a node is down its clients keep connecting
        to its ports; when those lie in the ephemeral range (39000 does) a connect may take one as
        its own source port for a moment (a TCP self-connect), before the port check or after it,
        when the JVM binds ("Address already in use")."""
        deadline = time.monotonic() + timeout_s
        while True:
            try:
                start()
                return
            except PortInUseError:
                if time.monotonic() > deadline:
                    raise
            except LocalKafkaError as exc:
                if "Address already in use" not in self.kafka.log_tail(200) or time.monotonic() > deadline:
                    raise
                print(f"  a Kafka node could not bind its port ({str(exc).splitlines()[0]}); starting again", flush=True)
            time.sleep(1.0)

    def kill(self, index: int | None = None) -> None:
        """kill -9 node `index` (None: every node); returns once the processes are gone."""
        for node_id in self._ids(index):
            self.kafka.kill(node_id)

    def pause(self, index: int | None = None) -> None:
        for node_id in self._ids(index):
            os.kill(self._pid(node_id), signal.SIGSTOP)

    def resume(self, index: int | None = None) -> None:
        for node_id in self._ids(index):
            os.kill(self._pid(node_id), signal.SIGCONT)

    def start(self, index: int | None = None) -> None:
        """Starts node `index` (None: every node) again on its data; returns once the cluster answers."""
        if index is None:
            self.up()
        else:
            self._retried(lambda: self.kafka.start(index, echo=_QUIET))

    def down(self) -> None:
        """Stops every node (resumed first, in case one is paused)."""
        for n in self.kafka.status().nodes:
            if n.pid is not None:
                os.kill(n.pid, signal.SIGCONT)
        self.kafka.down(echo=_QUIET)
