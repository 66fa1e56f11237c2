"""bench/apps.py's hand-written reference: the reward and curate apps' job, written by hand on
confluent-kafka, exactly-once with Kafka transactions, without the engine (Faust, aiokafka,
tables, the control topic, metrics).

Each stage is a step (`HandReward`, `HandCurate`: a record's bytes in, its outputs as
(topic, key, bytes) out) that calls the same code the apps call, and one loop (`hand_loop`):

* **reward**: the same decode (`RewardCodec`'s short path for a strategy that reads no segments,
  else `AvroSerde.loads`), the same `exact_match` strategy, the same scored bytes (spliced, or
  `with_reward` encoded), keyed like the input;
* **curate**: the same `GroupStore` assembly (over plain dicts: **state in memory**, written to
  no changelog, so unlike the app's tables it does not survive a crash or a rebalance), the same
  prompt statistics (`update_prompt_stats`, to `feedback`), `train_samples`, GRPO advantages over
  each policy's trajectories, the filters (length, zero variance, staleness) with the same
  lineage, `GroupDropped` records to `lineage`, TrainSamples encoded by `AvroSerde`; timeouts
  checked every 0.25 s as the app's tick does. Its strategies are fixed (the apps' defaults):
  no control topic, so no hot swap;
* **the same DLQ rule**: a record that does not decode, or on which the strategy raises (named),
  goes to the DLQ as `dead_letter_bytes` writes it; a group whose samples fail goes there whole.

`tests/unit/test_bench_apps_hand.py` checks that both steps give the records the apps give for
the same input (so the reference does the same work).

The loop: one consumer (read_committed, no auto commit), one transactional producer (the
platform's producer settings, the apps' codec, the Java partitioner as aiokafka's), every
output produced into the open transaction; the transaction commits with the consumed offsets
(`send_offsets_to_transaction`) on the apps' rule: once `commit_interval_s` passed since the
last commit, and sooner once no record arrived for `commit_idle_s` (the apps' defaults from
`EngineSettings`: 1 s and 20 ms; 50 ms before fbde99e). One producer for both partitions (KIP-447's model: offsets carry the consumer group's
metadata), where Faust keeps one per source partition.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable, Sequence
from typing import Any

import _common
import numpy as np

from astraflow.dataflow.advantages import advantages_for
from astraflow.dataflow.filters import FilterContext
from astraflow.dataflow.prompt_stats import update_prompt_stats
from astraflow.dataflow.registry import REGISTRY
from astraflow.dataflow.rewards import RewardResult, with_reward
from astraflow.errors import SerdeError
from astraflow.kafka.received import Received, dead_letter_bytes
from astraflow.kafka.topics import Topics
from astraflow.records import GroupDropped, PromptStats, StrategyRef, Trajectory
from astraflow.serde import AvroSerde
from stream_apps.curate import GroupClaimError, LateTrajectoryError, UnscoredTrajectoryError
from stream_apps.curate_samples import IncompleteGroupError
from stream_apps.engine import EngineSettings
from stream_apps.groups import Group, GroupStore, TaskClaim, policy_reward, train_samples, trained_policies
from stream_apps.reward_codec import RewardCodec

Out = tuple[str, "bytes | None", bytes]  # topic, key, value


class _Step:
    name = ""

    tick_interval_s = math.inf  # how often `tick` runs (curate: its timeouts)

    def __init__(self, experiment: str, serde: AvroSerde, dlq_serde: AvroSerde) -> None:
        self.topics, self.serde, self.dlq_serde = Topics(experiment), serde, dlq_serde

    def dlq(self, inc: Received[Any], error: BaseException | str, strategy: str | None = None) -> Out:
        return self.topics.dlq, inc.key, dead_letter_bytes(self.dlq_serde, inc, error, self.name, strategy)[1]

    def tick(self, now: float) -> list[Out]:
        return []


class HandReward(_Step):
    """The reward app's job with its default strategy (exact match), by hand."""

    name = "reward"

    def __init__(self, experiment: str, serde: AvroSerde, dlq_serde: AvroSerde, out: str | None = None) -> None:
        super().__init__(experiment, serde, dlq_serde)
        self.out = out or self.topics.scored  # where the scored copies go
        self.strategy = REGISTRY.get("reward", "exact_match")
        self.ref = self.strategy.ref("reward", "reward")
        self.short = not getattr(self.strategy.impl, "reads_segments", True)
        self.codec = RewardCodec(serde)

    def process(self, inc: Received[Any]) -> list[Out]:
        data = inc.value
        try:
            read = self.codec.read(data) if self.short and self.codec.applies(data) else None  # type: ignore[arg-type]
            traj = read.trajectory if read is not None else self.serde.loads(data, Trajectory)  # type: ignore[arg-type]
        except SerdeError as exc:
            return [self.dlq(inc, exc)]
        try:
            result = self.strategy(traj)
        except Exception as exc:
            return [self.dlq(inc, exc, self.strategy.name)]
        if not isinstance(result, RewardResult) or not math.isfinite(result.reward):
            return [self.dlq(inc, f"returned {result!r}; a reward must be a RewardResult with a finite reward",
                             self.strategy.name)]
        key = inc.key if inc.key is not None else traj.group_id.encode()
        try:
            out = (self.codec.scored(data, read, result.reward, result.components, self.ref)  # type: ignore[arg-type]
                   if read is not None else self.serde.dumps(with_reward(traj, result, self.ref)))
        except SerdeError as exc:
            return [self.dlq(inc, exc)]
        return [(self.out, key, out)]


class HandCurate(_Step):
    """The curate app's job with its default strategies, by hand, state in memory (module doc)."""

    name = "curate"
    tick_interval_s = 0.25

    def __init__(self, experiment: str, serde: AvroSerde, dlq_serde: AvroSerde, policies: Sequence[str],
                 current_version: Callable[[str], int | None] = lambda policy: None, *, group_timeout_s: float = 300.0,
                 min_group_size: int = 2, stats_alpha: float = 0.3, source: str | None = None,
                 claim: Callable[[str], TaskClaim | None] = lambda group_id: None) -> None:
        super().__init__(experiment, serde, dlq_serde)
        self.source = source or self.topics.scored  # the topic read (a dead letter names it)
        self.policies = tuple(policies)
        self.claim = claim  # group id -> its task's claims (curate's TaskBook)
        self.current_version = current_version
        self.group_timeout_s, self.min_group_size, self.stats_alpha = group_timeout_s, min_group_size, stats_alpha
        self.store = GroupStore({}, {}, lambda value: serde.loads(value, Trajectory), lambda partition, offsets: {},
                                group_timeout_s)
        self.stats: dict[str, PromptStats] = {}
        self.length = REGISTRY.get("filter", "length")
        self.zero_variance = REGISTRY.get("filter", "zero_variance")
        self.staleness = REGISTRY.get("filter", "staleness", max_staleness=8)
        self.grpo = REGISTRY.get("advantage", "grpo")

    def process(self, inc: Received[Any]) -> list[Out]:
        try:
            traj = self.serde.loads(inc.value, Trajectory)  # type: ignore[arg-type]
        except SerdeError as exc:
            return [self.dlq(inc, exc)]
        if traj.reward is None:
            return [self.dlq(inc, UnscoredTrajectoryError(
                f"trajectory {traj.trajectory_id} has no reward; curate reads the reward app's output"))]
        added = self.store.add(traj, inc.value or b"", inc.partition, inc.offset, time.time(), self.claim(traj.group_id))
        if added.status == "refused":
            return [self.dlq(inc, GroupClaimError(f"[{added.rule}] {added.reason}"))]
        if added.status == "late":
            info = added.emitted or {}
            return [self.dlq(inc, LateTrajectoryError(
                f"trajectory {traj.trajectory_id} arrived after its group {traj.group_id} was emitted without it "
                f"({len(info.get('members', ()))} of {traj.group_size} members, after the {self.group_timeout_s:g} s "
                "group timeout); raise curate's --group-timeout if this is frequent"))]
        return self.emit(added.group) if added.group is not None else []

    def tick(self, now: float) -> list[Out]:
        wall, outs = time.time(), []
        for p in self.store.expired(wall):
            outs += self.emit(self.store.take(p, wall))
        return outs

    def emit(self, group: Group) -> list[Out]:
        """Feedback, then the train samples and the drops' lineage (or the members to the DLQ)."""
        trajs = group.trajectories
        incs = [Received(t, self.source, m.partition, m.offset, t.group_id.encode(), 0, m.value, {})
                for t, m in group.members.values()]
        if not trajs:
            return []
        versions = {t.trajectory_id: t.trained_versions() for t in trajs}
        policies = trained_policies(trajs, lambda t: versions[t.trajectory_id])
        outs: list[Out] = []
        try:  # prompt statistics, whatever happens to the samples
            for policy in policies:
                mine = [(t, versions[t.trajectory_id][policy]) for t in trajs if policy in versions[t.trajectory_id]]
                key = f"{policy}/{trajs[0].prompt_id}"
                stats = self.stats[key] = update_prompt_stats(
                    self.stats.get(key), [policy_reward(t, policy) for t, _ in mine], [t.num_tokens for t, _ in mine],
                    max(newest for _, (_, newest) in mine), alpha=self.stats_alpha, prompt_id=trajs[0].prompt_id,
                    dataset=trajs[0].dataset, policy=policy)
                outs.append((self.topics.feedback, key.encode(), self.serde.dumps(stats)))
        except Exception:  # malformed trajectories: the samples fail too and say why
            outs = []
        drops: list[GroupDropped] = []
        try:
            if not group.complete and len(trajs) < self.min_group_size:
                raise IncompleteGroupError(
                    f"group {group.group_id} timed out after {self.group_timeout_s:g} s with {len(trajs)} of "
                    f"{group.expected} members, fewer than --min-group-size {self.min_group_size}")
            samples_out = self._samples(trajs, policies, drops)
        except _Failed as exc:
            return outs + [self.dlq(inc, exc.cause, exc.strategy) for inc in incs]
        except Exception as exc:
            return outs + [self.dlq(inc, exc) for inc in incs]
        try:
            encoded = [(self.topics.train(s.policy), s.group_id.encode(), self.serde.dumps(s)) for s in samples_out]
        except SerdeError as exc:
            return outs + [self.dlq(inc, exc) for inc in incs]
        return outs + encoded + [(self.topics.lineage, d.group_id.encode(), self.serde.dumps(d)) for d in drops]

    def _filter(self, strategy: Any, slot: str, items: list[Any], ctx: FilterContext, policy: str,
                drops: list[GroupDropped]) -> tuple[list[Any], list[StrategyRef]]:
        if not items:
            return items, []
        try:
            result = strategy(items, ctx)
        except Exception as exc:
            raise _Failed(strategy.name, exc) from exc
        by_reason: dict[str, list[Any]] = {}
        for d in result.dropped:
            by_reason.setdefault(d.reason, []).append(d.item)
        for reason, items_ in by_reason.items():
            drops.append(GroupDropped(group_id=items_[0].group_id, task_id=getattr(items_[0], "task_id", ""),
                                      prompt_id=items_[0].prompt_id, policy=policy,
                                      trajectory_ids=[i.trajectory_id for i in items_], component=self.name,
                                      filter=slot, strategy=strategy.name, reason=reason[:1000]))
        return list(result.kept), [strategy.ref(self.name, slot)]

    def _samples(self, trajs: list[Trajectory], policies: list[str], drops: list[GroupDropped]) -> list[Any]:
        short, length_refs = self._filter(self.length, "filter.length", trajs, FilterContext(), "", drops)
        short_ids = {t.trajectory_id for t in short}
        by_id = {t.trajectory_id: t for t in trajs}
        out: list[Any] = []
        for policy in policies:
            if self.policies and policy not in self.policies:
                drops.append(GroupDropped(group_id=trajs[0].group_id, task_id=trajs[0].task_id,
                                          prompt_id=trajs[0].prompt_id, policy=policy,
                                          trajectory_ids=[t.trajectory_id for t in trajs], component=self.name,
                                          filter="routing", strategy="unrouted_policy",
                                          reason=f"curate routes {', '.join(self.policies)} only"))
                continue
            per_traj = [ss for t in trajs if (ss := train_samples(t, policy))]
            if not per_traj:
                continue
            try:
                values = advantages_for([ss[0] for ss in per_traj], self.grpo.impl)
            except Exception as exc:
                raise _Failed(self.grpo.name, exc) from exc
            samples = []
            for ss, value in zip(per_traj, np.asarray(values, dtype=np.float64).tolist(), strict=True):
                for sample in ss:
                    sample.advantage = float(value)
                samples += ss
            ctx = FilterContext(current_version=self.current_version(policy))
            samples, refs = self._filter(self.zero_variance, "filter.zero_variance", samples, ctx, policy, drops)
            refs = [*length_refs, *refs]
            samples = [s for s in samples if s.trajectory_id in short_ids]
            if ctx.current_version is not None:
                samples, ref = self._filter(self.staleness, "filter.staleness", samples, ctx, policy, drops)
                refs += ref
            refs.append(self.grpo.ref(self.name, "advantage"))
            for sample in samples:
                sample.lineage = [*by_id[sample.trajectory_id].lineage, *refs]
                out.append(sample)
        return out


class _Failed(Exception):
    """A strategy raised on a group: its members go to the DLQ naming it."""

    def __init__(self, strategy: str, cause: BaseException) -> None:
        super().__init__(strategy)
        self.strategy, self.cause = strategy, cause


def hand_loop(kafka: Any, step: _Step, src: str, group: str, n: int, codec: str, max_record_bytes: int,
              on_first: Callable[[], None], commit_interval_s: float = EngineSettings.commit_interval_s,
              commit_idle_s: float = EngineSettings.commit_idle_s, refresh: Callable[[], Any] | None = None) -> float:
    """Runs `step` over `src` as consumer group `group`, exactly-once, until its n inputs are
    committed; returns the monotonic time of its first record (the commit rule: module doc).
    `refresh` runs before each tick (curate: the trainer's versions)."""
    from confluent_kafka import KafkaException, Producer, TopicPartition

    from astraflow.kafka.clients import producer_config, reader

    producer = Producer({**producer_config(kafka, max_record_bytes), "compression.type": codec,
                         "partitioner": "murmur2_random", "transactional.id": group})
    consumer = reader(kafka, group, max_record_bytes)  # commits in its transactions, by hand
    producer.init_transactions()
    producer.begin_transaction()
    consumer.subscribe([src])
    first: float | None = None
    poll_s = min(0.01, commit_idle_s / 2)  # so the idle commit comes within half its delay of being due
    done = in_txn = 0
    committed_at = active_at = ticked_at = time.monotonic()

    def produce(outs: list[Out]) -> None:
        for topic, key, value in outs:
            _common.produce_blocking(producer, topic, value, key)

    def commit() -> None:
        offsets = [TopicPartition(tp.topic, tp.partition, tp.offset) for tp in consumer.position(consumer.assignment())
                   if tp.offset >= 0]
        producer.send_offsets_to_transaction(offsets, consumer.consumer_group_metadata())
        producer.commit_transaction()
        producer.begin_transaction()

    try:
        while done < n or in_txn:
            msgs = consumer.consume(256, poll_s)
            now = time.monotonic()
            for m in msgs:
                if m.error() is not None:
                    raise KafkaException(m.error())
                if first is None:
                    first = now
                    on_first()
                produce(step.process(Received.of(m)))
                done += 1
                in_txn += 1
            producer.poll(0)
            if msgs:
                active_at = now
            if now - ticked_at >= step.tick_interval_s:
                ticked_at = now
                if refresh is not None:
                    refresh()
                outs = step.tick(now)
                produce(outs)
                in_txn += len(outs)
            if in_txn and (now - committed_at >= commit_interval_s or now - active_at >= commit_idle_s):
                commit()
                committed_at, in_txn = time.monotonic(), 0
    finally:
        consumer.close()
    assert first is not None
    return first
