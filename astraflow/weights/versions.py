"""What has been published, as the topics say, and asking a trainer for a snapshot.

Both sides read these: the publisher (`astraflow.weights.publish`) continues numbering after the
last version used; the follower (`astraflow.weights.follow`) starts from the newest version on
the compacted ``policies`` topic and, when deltas cannot bring it up to date, asks the trainer
for a full snapshot on the `snapshot_requests` topic. The metadata keys a manifest carries are named here.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from typing import Any

from astraflow.config import KafkaSettings
from astraflow.errors import ProduceError
from astraflow.kafka.clients import RecordProducer
from astraflow.kafka.read import read_range
from astraflow.kafka.signing import SignatureError, Verifier
from astraflow.kafka.topics import Topics
from astraflow.records import Control, PolicyVersion, WeightChunk
from astraflow.serde import AvroSerde

# The weights topic has two partitions: the stream every follower reads (every version, a delta but
# for a publisher's first version) and, beside it, the full snapshots only joining or recovering
# followers read (a snapshot version is a delta in the stream and a snapshot here, same weights).
STREAM_PARTITION, SNAPSHOT_PARTITION = 0, 1
SNAPSHOT_OFFSET = "latest_snapshot_offset"  # metadata: offset of the latest snapshot's manifest (snapshot partition)
# metadata: Kafka timestamp (ms) of the latest snapshot's manifest record. MirrorMaker 2 keeps record
# timestamps but not offsets (transaction markers are not copied), so a follower on a mirrored cluster
# finds the snapshot by this time (`offsets_for_times`), where the offset would land past it. The
# publisher writes a snapshot before its version's stream records, so a follower that loaded it
# resumes the stream at the first record at or after this time.
SNAPSHOT_TS = "latest_snapshot_ts_ms"
# metadata: the most versions one delta may move (the trainer declares it, signed with the manifest);
# a follower refuses a delta that jumps further. Snapshots are how a follower catches up: no bound.
MAX_STEP = "max_version_step"
DEFAULT_MAX_STEP = 1  # for manifests that do not declare it
log = logging.getLogger("astraflow.weights")
OFFSET = "offset"  # metadata (policies topic only): weights-topic offset of this version's manifest
CONTROL_APP = "trainer"  # Control records asking a trainer for a snapshot: app, slot "<policy>.snapshot"


def signed_by_trainer(experiment: str, stream: str) -> Callable[[Any], bool]:
    """`read_range`'s `accept`: only records the trainer signed (a forged version 1e9 on `policies`
    or the weights topic neither starts a follower there nor moves the publisher's numbering)."""
    verifier = Verifier(experiment)

    def accept(msg: Any) -> bool:
        try:
            verifier.check(stream, msg.key(), msg.value(), msg.headers())
        except SignatureError:
            return False
        return True

    return accept


def latest_policy_version(
    kafka: KafkaSettings,
    topics: Topics,
    policy: str,
    timeout_s: float = 10.0,
    serde: AvroSerde | None = None,
    strict: bool = False,
) -> PolicyVersion | None:
    """The newest PolicyVersion of `policy` on the compacted ``policies`` topic (None if none);
    `strict`: KafkaLayerError rather than an answer from a partial read."""
    records = read_range(kafka, topics.policies, 0, serde or AvroSerde.for_kafka(kafka), timeout_s, strict,
                         accept=signed_by_trainer(topics.experiment, "policies"))
    found = [r for r in records if isinstance(r, PolicyVersion) and r.policy == policy]
    return max(found, key=lambda r: r.version) if found else None


def last_published_version(
    kafka: KafkaSettings,
    topics: Topics,
    policy: str,
    timeout_s: float = 10.0,
    latest: PolicyVersion | None = None,
) -> int | None:
    """Highest version number already used for `policy`: on ``policies`` (`latest`, when the
    caller read it already) or, after a crash between the two sends of a publisher without
    transactions, among the last records of the weights topic. Raises KafkaLayerError when
    Kafka cannot be read to the end."""
    serde = AvroSerde.for_kafka(kafka)
    if latest is None:
        latest = latest_policy_version(kafka, topics, policy, timeout_s, serde, strict=True)
    tail = read_range(kafka, topics.weights(policy), None, serde, timeout_s, strict=True,
                      accept=signed_by_trainer(topics.experiment, f"{policy}.weights"))
    versions = [r.version for r in tail if isinstance(r, PolicyVersion | WeightChunk)]
    versions += [latest.version] if latest else []
    return max(versions) if versions else None


def snapshot_request(policy: str, requester: str, reason: str = "") -> Control:
    """The Control record that asks the trainer of `policy` for a full snapshot. Its `version` (an
    Avro int: 32 bits) is the request's time in seconds; the trainer takes any such record as a
    request and does not read the number. Milliseconds overflowed the field."""
    return Control(CONTROL_APP, f"{policy}.snapshot", "snapshot", int(time.time()), {"reason": reason}, requester)


def ask_trainer_for_snapshot(
    producer: RecordProducer, topics: Topics, policy: str, requester: str, reason: str = ""
) -> None:
    """Ask the trainer of `policy` to publish a full snapshot next (a Control record on the
    `snapshot_requests` topic; the trainer's `WeightPublisher.request_snapshot` then makes its next
    publication one)."""
    producer.send(topics.snapshot_requests, snapshot_request(policy, requester, reason),
                  key=f"{CONTROL_APP}/{policy}.snapshot")
    try:
        producer.flush(10.0)
    except ProduceError as exc:  # e.g. topics made before this topic existed: the follower goes on
        log.warning("cannot ask the trainer of %s for a snapshot (%s); create %s with `astraflow topics create`",
                    policy, exc, topics.snapshot_requests)
