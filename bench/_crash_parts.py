"""The pieces of the exactly-once crash benchmark (`bench/exactly_once.py`): its inputs, the
reader that counts a topic, the feeder, the worker processes it kills and the watcher of open
transactions."""

from __future__ import annotations

import os
import random
import signal
import subprocess
import sys
import time
import uuid
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]


def _traj(group: str, i: int, size: int, reward: float | None, seed: int) -> Any:
    from astraflow.testing import make_trajectory

    t = make_trajectory(128, task_id=group, sample_index=i, group_size=size, seed=seed, reward=reward)
    t.group_id, t.prompt_id = group, f"p-{group}"
    t.final_answer = "4" if i % 2 == 0 else "5"
    return t


def curate_input(run: str, rng: random.Random) -> tuple[list[Any], dict[str, int]]:
    """(records in send order, expected samples per group) for curate.

    Partial groups come first (they time out while the run goes on); a complete group's members
    are sent close together (shuffled among a few neighbours), so only a stall longer than the
    group timeout could split one. Redelivered copies go anywhere after their original.
    """
    partial, expected = [], {}
    for g in range(8):
        name = f"{run}-half-{g}"
        partial += [_traj(name, i, 4, 1.0 if i % 2 == 0 else 0.0, 1000 + g * 10 + i) for i in range(2)]
        expected[name] = 2
    for g in range(4):
        name = f"{run}-lone-{g}"
        partial.append(_traj(name, 0, 4, 1.0, 2000 + g))
        expected[name] = 0
    full = []
    for g in range(48):
        name = f"{run}-full-{g}"
        full += [_traj(name, i, 4, 1.0 if i % 2 == 0 else 0.0, g * 10 + i) for i in range(4)]
        expected[name] = 4
    for start in range(0, len(full), 12):  # three groups at a time, interleaved
        block = full[start:start + 12]
        rng.shuffle(block)
        full[start:start + 12] = block
    records = partial + full
    for t in rng.sample(records, 16):  # redelivered: the same trajectory_id again, later
        records.insert(rng.randrange(records.index(t) + 1, len(records) + 1), t)
    return records, expected


def reward_input(run: str, rng: random.Random) -> list[Any]:
    records = [_traj(f"{run}-r-{g}", i, 4, None, g * 10 + i) for g in range(60) for i in range(4)]
    rng.shuffle(records)
    for t in rng.sample(records, 16):
        records.insert(rng.randrange(len(records) + 1), t)
    return records


def read_topic(kafka: Any, topic: str | list[str], isolation: str, quiet_s: float, deadline: float, want: int,
          decode: bool = True) -> list[Any]:
    """Every record of `topic` (decoded) until nothing new came for `quiet_s` after `want` were read."""
    from astraflow.kafka.clients import reader
    from astraflow.serde import AvroSerde

    serde = AvroSerde()
    c = reader(kafka, f"count-{uuid.uuid4().hex}", **{"isolation.level": isolation})
    c.subscribe([topic] if isinstance(topic, str) else topic)
    out: list[Any] = []
    last = time.monotonic()
    try:
        while time.monotonic() < deadline:
            msgs = c.consume(500, 0.5)
            got = [m for m in msgs if m.error() is None]
            out += [serde.loads(m.value()) if decode else m.offset() for m in got]
            if got:
                last = time.monotonic()
            elif len(out) >= want and time.monotonic() - last >= quiet_s:
                break
    finally:
        c.close()
    return out


def feed(producer: Any, topic: str, records: list[Any], seconds: float) -> None:
    """Produces `records` evenly over `seconds`."""
    pause = seconds / max(1, len(records))
    for t in records:
        producer.send(topic, t, key=t.group_id)
        producer.poll(0)
        time.sleep(pause)
    producer.flush()


class Workers:
    """Worker processes of one app (separate processes, so kill -9 is real)."""

    def __init__(self, app: str, experiment: str, args: list[str], logs: Path) -> None:
        self.app, self.experiment, self.args, self.logs = app, experiment, args, logs
        self.procs: dict[str, subprocess.Popen[bytes]] = {}
        self.started = 0
        self.started_as: dict[str, int] = {}

    def start(self, name: str) -> None:
        from stream_apps.launch import app_command

        self.started += 1
        self.started_as[name] = self.started
        log = open(self.logs / f"{name}-{self.started}.log", "wb")  # noqa: SIM115 - closed with the process
        env = {**os.environ, "PYTHONPATH": f"{ROOT}{os.pathsep}{os.environ.get('PYTHONPATH', '')}"}
        if self.app == "curate-memory":
            command = [sys.executable, "-m", "bench.exactly_once", "--serve-memory-curate", self.experiment, *self.args]
        else:
            command = app_command(self.app, self.experiment, *self.args)
        self.procs[name] = subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT, env=env, cwd=ROOT)

    def wait_started(self, name: str, timeout_s: float = 60.0, mark: bytes = b": first record, ") -> bool:
        """Until the worker logged `mark` (default: it handles records; a kill before tests nothing)."""
        log = self.logs / f"{name}-{self.started_as[name]}.log"
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if mark in log.read_bytes():
                return True
            time.sleep(0.2)
        return False

    def kill(self, name: str) -> bool:
        proc = self.procs[name]
        if proc.poll() is not None:
            return False
        os.kill(proc.pid, signal.SIGKILL)
        proc.wait()
        return True

    def stop_all(self) -> None:
        for proc in self.procs.values():
            if proc.poll() is None:
                proc.send_signal(signal.SIGTERM)
        for proc in self.procs.values():
            try:
                proc.wait(30)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()


class OpenTransactions:
    """Watches the output topic for records inside a transaction that is still open.

    A read_committed consumer's high watermark is the partition's last stable offset (LSO); a
    read_uncommitted one's is the log end. While a producer's transaction holds records on a
    partition, its LSO stays below its end: `wait_open` returns True at such a moment, so a kill
    then interrupts a transaction that has outputs on this topic.
    """

    def __init__(self, kafka: Any, topic: str) -> None:
        from confluent_kafka import TopicPartition

        from astraflow.kafka.clients import reader

        def consumer(isolation: str) -> Any:
            return reader(kafka, f"watch-{uuid.uuid4().hex}", **{"isolation.level": isolation})

        self._committed, self._end = consumer("read_committed"), consumer("read_uncommitted")
        deadline = time.monotonic() + 30
        while not (partitions := self._end.list_topics(topic, timeout=10).topics[topic].partitions):
            if time.monotonic() > deadline:
                raise RuntimeError(f"{topic} has no partitions")
            time.sleep(0.1)  # a topic just created may not be in the metadata yet
        self._tps = [TopicPartition(topic, p) for p in sorted(partitions)]

    def open_now(self) -> bool:
        for tp in self._tps:
            _, stable = self._committed.get_watermark_offsets(tp, timeout=5, cached=False)
            _, end = self._end.get_watermark_offsets(tp, timeout=5, cached=False)
            if end > stable:
                return True
        return False

    def wait_open(self, timeout_s: float) -> bool:
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if self.open_now():
                return True
            time.sleep(0.01)
        return False

    def close(self) -> None:
        self._committed.close()
        self._end.close()
