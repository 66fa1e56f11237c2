"""Stream apps throughput: records/s through reward + curate (Faust apps), against hand-written
confluent-kafka loops doing the same job exactly-once, and against plain copy loops.

Same run, same broker, same records: N trajectories of 4,096 tokens (groups of 8, half the
answers right so no group is filtered) go through

* ours, exactly-once: the `reward` app (decode, exact-match reward, lineage, encode) then the
  `curate` app (decode, group assembly in changelog-backed tables, filters, GRPO, one
  TrainSample per trajectory, feedback), each a Faust worker (`StreamEngine`) with Kafka
  transactions, DLQ and metrics;
* ours, at-least-once: the same apps with `guarantee="at_least_once"` (Faust's own commits);
* hand-written, exactly-once (`_apps_hand`): the same job by hand on confluent-kafka, one loop
  per stage calling the code the apps call (the same decode and DLQ rule, exact-match reward
  with the same scored bytes; curate's group assembly (state in memory: no changelog, so unlike
  the app it does not survive a crash or a rebalance), prompt statistics, filters, GRPO and
  TrainSample encode), with a transactional producer committing the consumed offsets
  (`send_offsets_to_transaction`) on the apps' rule (every commit interval, and once idle for
  `EngineSettings.commit_idle_s`). `tests/unit/test_bench_apps_hand.py` checks that it gives the apps' records. Ours
  against it is the engine's cost (Faust, aiokafka in the worker's thread, tables, control,
  metrics, one producer per source partition); the like-for-like reference of the issue;
* plain: two confluent-kafka loops that copy the bytes unchanged (consume -> produce, same
  producer settings as ours: idempotent, acks=all, and the apps' codec, `--compression`,
  snappy by default like `EngineSettings`; flush then commit every second): no decode, no
  reward, no groups, no encode, at-least-once; not the same job but the floor any Kafka app
  pays. The first stage of every side reads `rollouts` as the rollout nodes write it
  (zstd, `astraflow.kafka.clients`); each later stage reads what the stage before it wrote.
  When the apps write another codec than zstd, two more plain stages write zstd, as the
  platform's librdkafka producers do (librdkafka compresses in a thread of its own, at
  level 3): the figure against them is a second reference, not the like-for-like one.

Stages run one after another on an otherwise idle pipeline; a stage's time runs from its first
record consumed until its consumer group's committed offsets cover all N inputs (polled every
20 ms): for exactly-once that is when the outputs became visible to read_committed readers.
Records/s through the pipeline = N / (stage 1 time + stage 2 time), with each stage's best
time over `--repeats` fresh experiments (shared machines are noisy).

Restarts: after its stages, each app's exactly-once worker is started again with one more
group of records in its source; the time from its start to its first record is a restarted
worker's start-up (curate's includes the recovery of its tables from their changelogs, which
end in a transaction marker; reward has no tables: the start-up alone, for comparison).

CPU: each stage also reports the CPU seconds of this process (every thread: librdkafka's for the
plain loop, the Faust worker's for ours) from its first record to its end, per record. With
`--profile PY_SPY` (the path of a py-spy binary; one repeat), py-spy samples this process during
each stage and the JSON gets, per stage, the share of samples by where they were spent (the
first frame from the leaf that is not the event loop's or the standard library's: Avro
encode/decode, the app's own work, Faust, aiokafka's producer or consumer, the engine, ...); the
samples themselves stay in /tmp (their paths are printed).

Usage: python bench/apps.py [--quick] [--json OUT] [--records N] [--tokens 4096] [--compression snappy] [--profile PY_SPY]
"""

from __future__ import annotations

import argparse
import functools
import os
import signal
import subprocess
import tempfile
import threading
import time
import uuid
from typing import Any

import _common
from _apps_hand import HandCurate, HandReward, hand_loop
from confluent_kafka import Producer
from dataplane import commit  # the bare loop commits as the data-plane benchmark's does

from astraflow.config import KafkaSettings, TopicSettings
from astraflow.kafka.clients import RecordProducer, producer_config, reader
from astraflow.kafka.topics import TopicAdmin, Topics, TopicSpec, topic_specs
from astraflow.serde import AvroSerde
from stream_apps.engine import COMPRESSIONS, EngineSettings
from stream_apps.launch import AppOptions, build_worker

write_json = _common.write_json

TERMS = {  # what the figures compare (written into the results JSON)
    "ours": "the reward + curate Faust apps, exactly-once (and at-least-once)",
    "against": "plain confluent-kafka copy loops (and hand-written exactly-once loops doing the same job)",
    "settings": "the same 4,096-token trajectories through every side, one broker, best of --repeats per stage",
}


PARTITIONS = 2

# Where a py-spy sample's time went: the first frame from the leaf whose file matches (in this
# order); frames of the event loop and the standard library are passed over (module doc).
CATEGORIES = [
    ("avro", ("astraflow/serde.py", "astraflow/avro_encoder.py", "stream_apps/reward_codec.py", "<avro encoder",
              "fastavro")),
    ("app", ("stream_apps/reward.py", "stream_apps/handler.py", "stream_apps/curate", "stream_apps/groups.py", "astraflow/dataflow/",
             "astraflow/records/", "astraflow/control", "numpy")),
    ("engine", ("stream_apps/engine.py", "stream_apps/takeover.py", "stream_apps/transactions.py",
                "stream_apps/metrics.py", "astraflow/kafka/")),
    ("compression (cramjam: snappy, zstd)", ("aiokafka/codec.py", "cramjam")),
    ("aiokafka connections (socket I/O)", ("aiokafka/conn.py",)),
    ("aiokafka producer", ("aiokafka/producer",)),
    ("aiokafka consumer", ("aiokafka/consumer", "aiokafka/record", "aiokafka/protocol")),
    ("aiokafka client", ("aiokafka/",)),
    ("faust", ("faust/", "mode/")),
    ("event loop (asyncio's own work)", ("stream_apps/lifecycle.py",)),
    ("the bench's commit poller", ("Finish._watch",)),
    ("plain loop (confluent-kafka)", ("plain_stage", "confluent_kafka")),
]
PASSED_OVER = ("asyncio/", "threading.py", "selectors.py", "concurrent/", "contextlib.py", "functools.py", "queue.py",
               "socket.py", "typing.py", "abc.py", "weakref.py", "<frozen", "logging/", "enum.py", "json/",
               "_weakrefset.py", "<string>")


def categorize(collapsed: str) -> dict[str, float]:
    """Shares of py-spy's collapsed samples (`frame;frame;... count` lines) by `CATEGORIES`."""
    counts: dict[str, int] = {}
    for line in collapsed.splitlines():
        stack, _, n = line.rpartition(" ")
        if not stack or not n.isdigit():
            continue
        where = "event loop and the rest"
        for frame in reversed(stack.split(";")):
            if " (" not in frame or any(p in frame for p in PASSED_OVER):  # a thread's name, the loop's own
                continue
            where = next((name for name, pats in CATEGORIES if any(p in frame for p in pats)), "other")
            break
        counts[where] = counts.get(where, 0) + int(n)
    total = sum(counts.values()) or 1
    return {k: round(v / total, 4) for k, v in sorted(counts.items(), key=lambda kv: -kv[1])}


class StageCpu:
    """CPU seconds of this process from a stage's first record (`begin`) to its end (`end`); with a
    py-spy binary, py-spy samples the same span (`profile` then holds the shares by category)."""

    def __init__(self, pyspy: str | None) -> None:
        self.pyspy, self.cpu0, self.cpu = pyspy, 0.0, 0.0
        self.profile: dict[str, float] | None = None
        self._spy: subprocess.Popen[bytes] | None = None
        self._out = ""

    def begin(self) -> None:
        self.cpu0 = time.process_time()
        if self.pyspy:
            self._out = tempfile.mktemp(suffix=".txt", prefix="apps-pyspy-")
            self._spy = subprocess.Popen([self.pyspy, "record", "--pid", str(os.getpid()), "--rate", "200",
                                          "--format", "raw", "--output", self._out, "--nonblocking"],
                                         stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)

    def when_first(self, first: Any) -> None:
        """Calls `begin` (in a thread) once `first()` is true: the worker took its first record."""
        def wait() -> None:
            while not first():
                time.sleep(0.005)
            self.begin()
        threading.Thread(target=wait, daemon=True).start()

    def end(self) -> None:
        self.cpu = time.process_time() - self.cpu0
        if self._spy is not None:
            self._spy.send_signal(signal.SIGINT)
            self._spy.wait(60)
            try:
                with open(self._out) as f:
                    self.profile = categorize(f.read())
            except OSError:
                self.profile = None


class Finish:
    """Polls the committed offsets of `group` on `topic` until they cover `n` records; records when."""

    def __init__(self, kafka: KafkaSettings, topic: str, group: str, n: int) -> None:
        self.kafka, self.topic, self.group, self.n = kafka, topic, group, n
        self.at: float | None = None
        self._thread = threading.Thread(target=self._watch, daemon=True)
        self._thread.start()

    def _watch(self) -> None:
        from confluent_kafka import TopicPartition

        c = reader(self.kafka, self.group)
        tps = [TopicPartition(self.topic, p) for p in range(PARTITIONS)]
        try:
            while sum(max(0, tp.offset) for tp in c.committed(tps, timeout=10)) < self.n:
                time.sleep(0.02)
            self.at = time.monotonic()
        finally:
            c.close()

    def wait(self, timeout_s: float) -> float:
        self._thread.join(timeout_s)
        if self.at is None:
            raise SystemExit(f"{self.topic} did not reach {self.n} records within {timeout_s:.0f}s")
        return self.at


def plain_stage(kafka: KafkaSettings, src: str, dst: str, n: int, serde: AvroSerde, codec: str, cpu: StageCpu) -> float:
    """Copies n records src -> dst with a bare confluent-kafka loop writing `codec`; returns seconds."""
    group = f"bench-plain-{uuid.uuid4().hex}"
    done = Finish(kafka, src, group, n)
    producer = Producer({**producer_config(kafka, serde.max_record_bytes), "compression.type": codec})
    consumer = reader(kafka, group, serde.max_record_bytes)  # commits by hand: the baseline
    consumer.subscribe([src])
    first, copied, last_commit = None, 0, time.monotonic()
    while copied < n:
        msgs = consumer.consume(256, 0.2)
        for m in msgs:
            if m.error() is not None:
                continue
            if first is None:
                first = time.monotonic()
                cpu.begin()
            _common.produce_blocking(producer, dst, m.value(), m.key())
            copied += 1
        producer.poll(0)
        if time.monotonic() - last_commit >= 1.0:  # same commit rule as ours: flush, then commit
            producer.flush()
            commit(consumer)
            last_commit = time.monotonic()
    producer.flush()
    commit(consumer)
    consumer.close()
    assert first is not None
    end = done.wait(120)
    cpu.end()
    return end - first


def hand_stage(kafka: KafkaSettings, step: Any, src: str, n: int, serde: AvroSerde, codec: str, cpu: StageCpu,
               refresh: Any = None) -> float:
    """Runs a hand-written stage (`_apps_hand`) exactly-once until its n inputs are committed; returns
    seconds from its first record (ended like ours: its committed offsets cover the n inputs)."""
    group = f"bench-hand-{step.name}-{uuid.uuid4().hex}"
    done = Finish(kafka, src, group, n)
    first = hand_loop(kafka, step, src, group, n, codec, serde.max_record_bytes, cpu.begin, refresh=refresh)
    end = done.wait(120)
    cpu.end()
    return end - first


def hand_curate(kafka: KafkaSettings, exp: str, src: str, serde: AvroSerde) -> tuple[HandCurate, Any]:
    """The hand-written curate of policy `policy`, reading the trainer's versions as the app does
    (the compacted `policies` topic, refreshed before each tick); and that refresh."""
    from astraflow.control import CompactedReader
    from astraflow.records import PolicyVersion

    topics = Topics(exp)
    versions = CompactedReader(kafka, topics.policies, serde=serde, expect=PolicyVersion)
    versions.catch_up()

    def current(policy: str) -> int | None:
        pv = versions.latest.get(policy)
        return None if pv is None else int(pv.version)
    dlq = AvroSerde(serde.catalog, max_record_bytes=TopicSettings().max_message_bytes)
    from stream_apps.task_book import TaskBook

    book = TaskBook(kafka, exp, serde, "hand-curate")  # the groups' tasks, as curate reads them
    return HandCurate(exp, serde, dlq, ["policy"], current, source=src, claim=book.claim), versions


def our_stage(kafka: KafkaSettings, app: str, experiment: str, src: str, n: int, options: AppOptions | None,
              guarantee: str, codec: str, cpu: StageCpu) -> float:
    """Runs one app worker until it committed all n inputs; returns seconds from its first record."""
    settings = EngineSettings(experiment, kafka, metrics_interval_s=5.0, guarantee=guarantee,  # type: ignore[arg-type]
                              group_id=Topics(experiment).group(f"{app}.{guarantee}"), compression=codec)  # type: ignore[arg-type]
    done = Finish(kafka, src, settings.group_id or "", n)
    worker = build_worker(app, settings, options)
    cpu.when_first(lambda: worker.stats.first_in_at is not None)
    thread = worker.start_thread()
    try:
        end = done.wait(120)
        cpu.end()
    finally:
        worker.stop()
        thread.join(60)
    if worker.error is not None:
        raise SystemExit(f"{app} failed: {worker.error!r}")
    assert worker.stats.first_in_at is not None
    return end - worker.stats.first_in_at


def restart(kafka: KafkaSettings, app: str, experiment: str, src: str, options: AppOptions | None,
            tokens: int, codec: str) -> float:
    """Starts the exactly-once worker of `app` again after its stages, with
    one more group of records in `src`; returns seconds from its start to its first record: a
    restarted worker's start-up, with the recovery of its tables from their changelogs."""
    fill(kafka, src, 8, tokens, 8)
    settings = EngineSettings(experiment, kafka, metrics_interval_s=5.0, group_id=Topics(experiment).group(f"{app}.exactly_once"),
                              compression=codec)  # type: ignore[arg-type]
    started = time.monotonic()
    worker = build_worker(app, settings, options)
    thread = worker.start_thread()
    try:
        while worker.stats.first_in_at is None and time.monotonic() - started < 120 and worker.error is None:
            time.sleep(0.01)
    finally:
        worker.stop()
        thread.join(60)
    if worker.stats.first_in_at is None:
        raise SystemExit(f"restarted {app} took no record within 120 s ({worker.error!r})")
    return worker.stats.first_in_at - started


def fill(kafka: KafkaSettings, topic: str, n: int, tokens: int, group_size: int) -> int:
    """Produces `_common.trajectories` to `topic`; returns the encoded size of one."""
    from astraflow.kafka.topics import experiment_of
    from astraflow.testing import issue_tasks

    producer = RecordProducer(kafka)
    size = 0
    trajs = _common.trajectories(n, tokens, group_size)
    issue_tasks(kafka, experiment_of(topic), trajs)  # curate takes each group from its task, as the curator signed it
    for t in trajs:
        data = producer.serde.dumps(t)
        size = len(data)
        producer.send_raw(topic, data, key=t.group_id)
    producer.flush(120)
    return size


STAGE_LABELS = {"p1": "plain loop stage 1", "o1": "reward exactly-once", "a1": "reward at-least-once",
                "h1": "hand-written reward exactly-once", "p2": "plain loop stage 2", "o2": "curate exactly-once",
                "h2": "hand-written curate exactly-once", "a2": "curate at-least-once",
                "z1": "plain loop stage 1 writing zstd", "z2": "plain loop stage 2 writing zstd"}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--profile", default=None, metavar="PY_SPY", help="py-spy binary: profile each stage (module doc)")
    ap.add_argument("--compression", default=EngineSettings.compression, choices=COMPRESSIONS,
                    help="codec the apps and the plain loops write (default: the apps' default)")
    args, n, repeats, kafka = _common.stream_args(ap, "stream_apps", "records")
    codec = args.compression
    serde = AvroSerde()
    zstd_too = codec != "zstd"  # the plain loops also write zstd, as the platform's librdkafka producers do
    stages = ("p1", "o1", "a1", "h1", "p2", "o2", "h2", "a2", *(("z1", "z2") if zstd_too else ()))
    times: dict[str, list[float]] = {k: [] for k in (*stages, "r1", "r2")}
    cpu_us: dict[str, list[float]] = {k: [] for k in stages}  # CPU per record
    profiles: dict[str, dict[str, float] | None] = {}

    def stage(key: str, run: Any, *run_args: Any) -> float:
        cpu = StageCpu(args.profile)
        secs = run(*run_args, cpu)
        cpu_us[key].append(cpu.cpu / n * 1e6)
        profiles[key] = cpu.profile
        if cpu.profile is not None:
            print(f"{STAGE_LABELS[key]}: py-spy samples (collapsed) in {cpu._out}")
        return secs  # type: ignore[no-any-return]
    size = 0
    for r in range(repeats):  # a fresh experiment each time; the best time of each stage counts
        exp = f"bench-{uuid.uuid4().hex[:8]}"
        topics = Topics(exp)
        plain1, plain2 = topics.stream("plain1"), topics.stream("plain2")
        plainz1, plainz2 = topics.stream("plainz1"), topics.stream("plainz2")
        hand1 = topics.stream("hand1")  # the hand-written reward's output (its curate writes the apps' topics)
        specs = [*topic_specs(exp, ["policy"], TopicSettings(partitions=PARTITIONS)),
                 *(TopicSpec(t, PARTITIONS) for t in (plain1, plain2, plainz1, plainz2, hand1))]
        admin = TopicAdmin(kafka)
        admin.create(specs)
        try:
            print(f"[{r + 1}/{repeats}] producing {n:,} trajectories of {args.tokens:,} tokens ...", flush=True)
            size = fill(kafka, topics.rollouts, n, args.tokens, args.group_size)
            # Interleaved so that machine noise hits both sides alike.
            curate = AppOptions(policies=["policy"])
            times["p1"].append(stage("p1", plain_stage, kafka, topics.rollouts, plain1, n, serde, codec))
            times["o1"].append(stage("o1", our_stage, kafka, "reward", exp, topics.rollouts, n, None, "exactly_once", codec))
            times["a1"].append(stage("a1", our_stage, kafka, "reward", exp, topics.rollouts, n, None, "at_least_once", codec))
            reward = HandReward(exp, serde, AvroSerde(serde.catalog, max_record_bytes=TopicSettings().max_message_bytes), hand1)
            times["h1"].append(stage("h1", hand_stage, kafka, reward, topics.rollouts, n, serde, codec))
            times["p2"].append(stage("p2", plain_stage, kafka, plain1, plain2, n, serde, codec))
            times["o2"].append(stage("o2", our_stage, kafka, "curate", exp, topics.scored, n, curate, "exactly_once", codec))
            step, versions = hand_curate(kafka, exp, hand1, serde)
            try:
                times["h2"].append(stage("h2", functools.partial(hand_stage, refresh=versions.refresh), kafka, step, hand1,
                                         n, serde, codec))
            finally:
                versions.close()
            if zstd_too:
                times["z1"].append(stage("z1", plain_stage, kafka, topics.rollouts, plainz1, n, serde, "zstd"))
                times["z2"].append(stage("z2", plain_stage, kafka, plainz1, plainz2, n, serde, "zstd"))
            times["a2"].append(stage("a2", our_stage, kafka, "curate", exp, topics.scored, n, curate, "at_least_once", codec))
            times["r1"].append(restart(kafka, "reward", exp, topics.rollouts, None, args.tokens, codec))
            times["r2"].append(restart(kafka, "curate", exp, topics.scored, curate, args.tokens, codec))
        finally:
            admin.delete([s.name for s in specs])
    p1, o1, a1, h1, p2, o2, h2, a2, r1, r2 = (min(times[k]) for k in ("p1", "o1", "a1", "h1", "p2", "o2", "h2", "a2",
                                                                       "r1", "r2"))
    plain_rate, ours_rate, alo_rate, hand_rate = n / (p1 + p2), n / (o1 + o2), n / (a1 + a2), n / (h1 + h2)
    zstd_rate = n / (min(times["z1"]) + min(times["z2"])) if zstd_too else plain_rate
    rows: list[tuple[str, Any]] = [
        ("records", f"{n:,} trajectories, {args.tokens:,} tokens, {size:,} bytes each, {PARTITIONS} partitions, "
                    f"best of {repeats}, apps and plain loops write {codec}"),
        ("plain copy loop, stage 1 /s", f"{n / p1:,.0f}"),
        ("plain copy loop, stage 2 /s", f"{n / p2:,.0f}"),
        ("hand-written reward, exactly-once /s", f"{n / h1:,.0f}"),
        ("hand-written curate, exactly-once /s", f"{n / h2:,.0f}"),
        ("reward app, exactly-once /s", f"{n / o1:,.0f}"),
        ("reward app, at-least-once /s", f"{n / a1:,.0f}"),
        ("curate app, exactly-once /s", f"{n / o2:,.0f}"),
        ("curate app, at-least-once /s", f"{n / a2:,.0f}"),
        ("plain copy loop, 2 stages /s", f"{plain_rate:,.0f}"),
        ("hand-written, 2 stages, exactly-once /s", f"{hand_rate:,.0f}"),
        ("reward + curate, exactly-once /s", f"{ours_rate:,.0f}"),
        ("reward + curate, at-least-once /s", f"{alo_rate:,.0f}"),
        ("exactly-once vs hand-written exactly-once: reward / curate / both (1.0 = as fast)",
         f"{h1 / o1:.2f}x / {h2 / o2:.2f}x / {ours_rate / hand_rate:.2f}x"),
        ("exactly-once vs plain copy loop: reward / curate / both", f"{p1 / o1:.2f}x / {p2 / o2:.2f}x / {ours_rate / plain_rate:.2f}x"),
        ("hand-written vs plain copy loop: reward / curate / both", f"{p1 / h1:.2f}x / {p2 / h2:.2f}x / {hand_rate / plain_rate:.2f}x"),
        ("at-least-once vs plain copy loop", f"{alo_rate / plain_rate:.2f}x"),
        *([("plain loop writing zstd, 2 stages /s", f"{zstd_rate:,.0f}"),
           ("exactly-once vs plain loop writing zstd", f"{ours_rate / zstd_rate:.2f}x")] if zstd_too else []),
        *[(f"CPU per record, {label}, us (this process, every thread)", f"{min(cpu_us[k]):,.0f}")
          for k, label in STAGE_LABELS.items() if k in cpu_us],
        ("reward restarted: start to first record, s", f"{r1:.2f}"),
        ("curate restarted (tables recovered): start to first record, s", f"{r2:.2f}"),
    ]
    _common.print_rows(rows)
    write_json(args.json, "apps", {
        "records": n, "tokens": args.tokens, "bytes": size, "partitions": PARTITIONS, "repeats": repeats, "compression": codec,
        "stage_seconds": times,
        "plain_stage1_per_s": n / p1, "plain_stage2_per_s": n / p2, "reward_per_s": n / o1, "curate_per_s": n / o2,
        "hand_reward_per_s": n / h1, "hand_curate_per_s": n / h2, "hand_pipeline_per_s": hand_rate,
        "ratio_vs_hand": {"reward": h1 / o1, "curate": h2 / o2, "pipeline": ours_rate / hand_rate},
        "ratio_vs_plain_per_stage": {"reward": p1 / o1, "curate": p2 / o2, "pipeline": ours_rate / plain_rate},
        "hand_ratio_vs_plain": {"reward": p1 / h1, "curate": p2 / h2, "pipeline": hand_rate / plain_rate},
        "reward_at_least_once_per_s": n / a1, "curate_at_least_once_per_s": n / a2,
        "plain_pipeline_per_s": plain_rate, "ours_pipeline_per_s": ours_rate, "ratio_vs_plain": ours_rate / plain_rate,
        "at_least_once_pipeline_per_s": alo_rate, "at_least_once_ratio_vs_plain": alo_rate / plain_rate,
        "plain_zstd_pipeline_per_s": zstd_rate, "ratio_vs_plain_zstd": ours_rate / zstd_rate,
        "reward_restart_s": r1, "curate_restart_s": r2,
        "cpu_us_per_record": {STAGE_LABELS[k]: min(v) for k, v in cpu_us.items()},
        "profile_shares": {STAGE_LABELS[k]: v for k, v in profiles.items()} if args.profile else None,
    }, terms=TERMS, quick=args.quick)
    if args.profile:
        for k, label in STAGE_LABELS.items():
            if k in profiles:
                print(f"{label}: " + ", ".join(f"{c} {v:.0%}" for c, v in (profiles.get(k) or {}).items()))


if __name__ == "__main__":
    main()
