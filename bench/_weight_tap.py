"""The benchmark's own view of the published weights, at (almost) no cost during the timed run.

`run_pipeline` needs two things from the weights topic: when each version arrived in the
benchmark process (the clock stops when version `steps` arrives; the stage timeline's
`weights_here`) and the weights of the versions at the evaluation marks. Following every
version during the run (verifying and decoding each 1 MB fp32 delta, cloning the state at the
marks) is measurement cost, charged to the pipeline's CPU. So `WeightTap` only collects during
the run: it reads the stream partition of `<policy>.weights` (read_committed, from its start: the
first version is a full snapshot there, `astraflow.weights.publish`), decodes the Avro records
(no payload work) and notes when each version's last record arrived: its manifest, then as many
chunks of that version as the manifest announced (a claim-checked version: its manifest alone).
That note only says when a version is here; it trusts nothing. `replay` then, after the timed
run, feeds the same records in the same order to a `WeightFollower` (every check: crc32, sha256,
state checksum, the chain's own) and keeps a copy of the weights at each mark: the same bits
`KafkaWeightFollower` gives for the same version (tests/integration/test_bench_weight_tap.py).
A version the follower refuses ends the replay with an error (the run's figures would be wrong).
"""

from __future__ import annotations

import time
from typing import Any

import torch
from confluent_kafka import OFFSET_BEGINNING, TopicPartition

from astraflow.config import KafkaSettings
from astraflow.errors import SerdeError
from astraflow.kafka.clients import consume_ready, data_messages
from astraflow.kafka.read import assigned_consumer
from astraflow.kafka.topics import Topics
from astraflow.records import PolicyVersion, WeightChunk
from astraflow.serde import AvroSerde
from astraflow.weights.chain import ApplyStatus
from astraflow.weights.follow import WeightFollower
from astraflow.weights.versions import STREAM_PARTITION

Snapshot = tuple[int, float, dict[str, torch.Tensor]]  # (version, arrival time here, fp32 weights)


class WeightTap:
    """Collects `<policy>.weights`' stream during a run; `replay` decodes it afterwards (see the module doc)."""

    def __init__(self, kafka: KafkaSettings, experiment: str, policy: str = "policy") -> None:
        self.policy, self.serde = policy, AvroSerde()
        self.topic = Topics(experiment).weights(policy)
        self._consumer = assigned_consumer(kafka, self.serde, Topics(experiment).group("bench-tap"))
        self.records: list[tuple[int, Any, float]] = []  # (offset, record or None, time.time() it arrived)
        self.arrived: dict[int, float] = {}  # version -> when its last record arrived here
        self._open: tuple[int, int, int] | None = None  # (version, chunks announced, chunks seen) of the version being read

    def start(self) -> None:
        """Reads the stream from its beginning (call before the run: the client fetches meanwhile)."""
        self._consumer.assign([TopicPartition(self.topic, STREAM_PARTITION, OFFSET_BEGINNING)])

    @property
    def version(self) -> int | None:
        """The newest version whose records have all arrived (not verified yet)."""
        return max(self.arrived, default=None)

    def poll(self, timeout_s: float = 0.2, max_records: int = 64) -> None:
        """Collects what has arrived (waiting up to `timeout_s` for the first record)."""
        msgs = consume_ready(self._consumer, max_records, timeout_s)
        now = time.time()
        for msg in data_messages(msgs, self.topic):
            try:
                record = self.serde.loads(msg.value())
            except SerdeError:
                record = None  # the follower skips it too (its version then fails its checks)
            self.records.append((msg.offset(), record, now))
            self._note(record, now)

    def _note(self, record: Any, now: float) -> None:
        if isinstance(record, PolicyVersion) and record.policy == self.policy:
            self._open = (record.version, record.num_chunks, 0)
        elif isinstance(record, WeightChunk) and self._open is not None and record.version == self._open[0]:
            self._open = (self._open[0], self._open[1], self._open[2] + 1)
        else:
            return
        version, announced, seen = self._open
        if seen >= announced:
            self.arrived.setdefault(version, now)
            self._open = None

    def replay(self, every: int, last: int) -> tuple[list[Snapshot], dict[int, float]]:
        """Feeds the collected records to a `WeightFollower` in order, up to version `last`; returns
        a fp32 copy of the weights at the first version at or past each multiple of `every` (and at
        `last`), with its arrival time, and the arrival time of every version applied."""
        follower = WeightFollower(self.policy)
        snapshots: list[Snapshot] = []
        applied: dict[int, float] = {}
        mark = every
        for offset, record, at in self.records:
            if record is None:
                continue
            for event in follower.feed(record, offset):
                if event.result.status == ApplyStatus.STALE:  # a version read twice: nothing changed
                    continue
                if event.result.status != ApplyStatus.APPLIED:
                    raise RuntimeError(f"version {event.version} of {self.policy} not applied: {event.result.reason}")
                applied[event.version] = at
                if event.version >= min(mark, last):
                    snapshots.append((event.version, at, {k: v.detach().clone().float() for k, v in follower.state.items()}))
                    mark = (event.version // every + 1) * every
            if (follower.version or 0) >= last:
                return snapshots, applied
        raise RuntimeError(f"the weights collected reach version {follower.version}, not {last}")

    def close(self) -> None:
        self._consumer.close()
