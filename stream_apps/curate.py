"""The curate app: scored trajectories -> per-policy train topics, and per-prompt feedback.

    astraflow app run curate --experiment EXP --policy solver --policy verifier \
        [--group-timeout 300] [--min-group-size 2]

For every group (records keyed by `group_id`, so a group lives on one partition):

1. **Assemble** by `group_id` until the `n_samples` members its task asked for arrived, or
   `--group-timeout` seconds after its first one (then it is emitted if it has at least
   `--min-group-size` members, dead-lettered as `IncompleteGroupError` otherwise). The group's
   size and members come from the task its curator signed, read from the tasks topics
   (`stream_apps.task_book`), never from its trajectories: one whose claims disagree with its
   task (no task issued its group, another size, a sample index out of range, another task or
   trajectory id, a second trajectory for a sample already taken) is dead-lettered as
   `GroupClaimError` naming the rule (`stream_apps.groups.claims_broken`), and its group goes on
   without it. The same trajectory again (a redelivered or re-issued task: same ids), before or
   after its group left, is `superseded`: counted and dropped. A trajectory of a group emitted
   without it (a timeout) is dead-lettered as `LateTrajectoryError`: no trajectory leaves
   curate unseen, neither trained nor in the DLQ.
2. **Feedback.** For every policy that trained tokens in the group, the prompt's statistics are
   updated (`update_prompt_stats`: pass rate, EWMA, zero-variance streak, ...) and published
   to `feedback` keyed `<policy>/<prompt_id>` — for every group, whatever the filters keep,
   since curators choose prompts by how they went.
3. **Dedupe** (slot `filter.dedupe`, off by default): the groups table already drops a
   redelivered trajectory (`superseded`, `late_trajectory`), exactly-once; the `dedupe`
   strategy's memory of ids is not transactional, so after an aborted transaction it would drop
   the members of a group emitted again (a split group). Set it to `dedupe` only for inputs
   that repeat ids across groups.
4. **ERROR trajectories** (an infrastructure failure: backend crash, deadline, a raising
   workflow) are never trained and do not enter their siblings' advantages, whatever the
   strategies: counted as `error_trajectory`, a GroupDropped on `lineage` says why (they stay
   in `scored` and the archive).
5. **Per policy**: one TrainSample per training sequence of each trajectory
   (`stream_apps.groups.train_samples`: usually one; an agent that rewrote its history has
   several), then **advantages** (slot `advantage`, default `grpo`) over ALL of that policy's
   trajectories of the group (one reward each; every sequence of a trajectory gets its value), and only then the filters mask samples out (DAPO-style: a filtered member does not
   change its siblings' advantages) — `filter.zero_variance` (on the whole group),
   `filter.length`, `filter.staleness` (default 8 versions), then any other `filter.<name>` slot
   set on the control topic, in slot-name order; the samples go to `<policy>.train` keyed by
   `group_id`. Every sample's lineage is
   its trajectory's (the reward) plus each curate strategy applied.

**Per policy.** Each policy of a group is curated on its own (samples, advantages, filters,
train topic). A sample slot may be chosen for one policy as `<slot>@<policy>` (control topic or
--default), e.g. `filter.staleness@verifier`: that policy's own staleness limit.

**Staleness.** The trainer's current version of each policy comes from the compacted
`policies` topic (the latest PolicyVersion per policy, written by the trainer on every
publish), read to its end at start and followed live. It is the only place that knows what
the trainer is at (samples' `min_version` tells how old a rollout is, not how far the trainer
moved on). While no version of a policy is known (no trainer yet), nothing is stale.

**State and exactly-once.** Groups in assembly (their members' ids and source offsets) and the
emitted group ids live in Faust tables (`stream_apps.groups.GroupStore`), backed by changelog
topics and written in the transaction of the record that changed them, together with the
outputs and the record's offset. A worker killed at any point, or a partition moved by a
rebalance, leaves the next owner exactly the committed state: no group lost, none emitted
twice, and partial groups keep assembling at once (no timeout to wait for). The members
themselves stay in the worker's memory, not in a changelog (that would write every trajectory
a second time); the next owner reads them again from `scored` at their offsets when their group
leaves. A member the topic no longer has (its retention deleted it first) is counted as
`member_gone` and logged; its group leaves without it. Timeouts are wall-clock, measured from
a group's first member; an expired group is emitted (or dropped) in a transaction of its
partition.
Emitted ids are kept `--emitted-ttl` seconds (default a day), so a trajectory redelivered
within that time is dropped as late. Prompt statistics resume from the `feedback` topic.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Sequence
from typing import Any

from astraflow.errors import AstraflowError, ConfigError, SerdeError
from astraflow.kafka.received import Received
from astraflow.records import GroupDropped, PolicyVersion, PromptStats, Trajectory
from stream_apps.curate_samples import GroupSamples
from stream_apps.groups import (
    Group,
    GroupStore,
    Member,
    Pending,
    forget_partitions,
)
from stream_apps.handler import AppHandler, StrategyFailed
from stream_apps.slots import Slot, SlotDefault

log = logging.getLogger("astraflow.stream.curate")

DEFAULTS: dict[str, SlotDefault] = {
    "filter.dedupe": SlotDefault("none"),  # the tables dedupe, transactionally (module doc, 3.)
    "filter.length": SlotDefault("length"),
    "filter.staleness": SlotDefault("staleness", {"max_staleness": 8}),
    "filter.zero_variance": SlotDefault("zero_variance"),
    "advantage": SlotDefault("grpo"),
}


class UnscoredTrajectoryError(AstraflowError):
    """Raised when curate reads a trajectory without a reward (it was not written by the reward app)."""


class LateTrajectoryError(AstraflowError):
    """A trajectory arrived after its group was emitted without it (the group timed out first).

    Its samples cannot join their group's advantages any more; it goes to the DLQ. Frequent ones
    mean `--group-timeout` is shorter than the slowest rollout plus the longest stall (a killed
    node's session timeout, a restart)."""


class GroupClaimError(AstraflowError):
    """A trajectory's claims disagree with the task its curator issued (the message starts with
    the rule broken, `stream_apps.groups.claims_broken`); its group goes on without it. Many
    from one node mean that node is broken or hostile."""


class CurateApp(GroupSamples, AppHandler):
    """Assembles groups and routes training samples (see the module doc; the samples of a
    complete group: `stream_apps.curate_samples.GroupSamples`)."""

    name = "curate"
    expect = Trajectory
    sources = ("scored",)
    tick_interval_s = 0.25
    tables = ("groups", "emitted")
    prune_interval_s = 60.0  # how often emitted ids older than emitted_ttl_s are forgotten

    def __init__(
        self,
        policies: Sequence[str] = (),
        *,
        group_timeout_s: float = 300.0,
        min_group_size: int = 2,
        stats_alpha: float = 0.3,
        emitted_ttl_s: float = 86_400.0,
        defaults: dict[str, SlotDefault] | None = None,
    ) -> None:
        if min_group_size < 1:
            raise ConfigError(f"--min-group-size must be >= 1, got {min_group_size}")
        self.policies = tuple(policies)  # policies routed (empty: every policy that has a train topic)
        self.group_timeout_s = group_timeout_s
        self.min_group_size = min_group_size
        self.stats_alpha = stats_alpha
        self.defaults = {**DEFAULTS, **(defaults or {})}
        self.slots: dict[str, Slot] = {}
        self.emitted_ttl_s = emitted_ttl_s
        self._store: GroupStore | None = None
        self._pruned_at = 0.0
        self.stats: dict[str, PromptStats] = {}  # "<policy>/<prompt_id>" -> latest statistics
        self.groups_emitted = 0
        self._extra_generation = -1
        self._train_topics: dict[str, bool] = {}  # policy -> its train topic exists
        self._versions: dict[str, dict[str, tuple[int, int]]] = {}  # Trajectory.trained_versions of the group being emitted
        self._drops: list[GroupDropped] = []  # what the group being emitted lost, and why (to `lineage`)

    # ---- setup -----------------------------------------------------------------------------------

    def bind(self, worker: Any) -> None:
        from astraflow.control import CompactedReader

        super().bind(worker)
        self.init_slots(worker.control)
        for policy in self.policies:
            if not self._has_train_topic(policy):
                raise ConfigError(
                    f"train topic {worker.topics.train(policy)} does not exist; create it with "
                    f"`astraflow topics create -e {worker.settings.experiment} -p {policy}`"
                )
        self.versions = CompactedReader(worker.kafka, worker.topics.policies, serde=worker.serde, expect=PolicyVersion,
                                        signed=(worker.settings.experiment, "policies"), component=self.name)
        self.feedback = CompactedReader(
            worker.kafka, worker.topics.feedback, serde=worker.serde, expect=PromptStats, on_record=self._on_feedback
        )
        self.versions.catch_up()
        self.feedback.catch_up()
        from stream_apps.task_book import TaskBook

        self.tasks = TaskBook(worker.kafka, worker.settings.experiment, worker.serde, self.name)

    @property
    def store(self) -> GroupStore:
        """Groups in assembly and emitted, in the worker's tables (new ones when the Faust app is rebuilt)."""
        groups = self.worker.table("groups")
        if self._store is None or self._store.groups is not groups:
            self._store = GroupStore(groups, self.worker.table("emitted"), self._decode, self.worker.reread,
                                     self.group_timeout_s, self.emitted_ttl_s)
        return self._store

    def _decode(self, value: bytes) -> Trajectory:
        return self.worker.serde.loads(value, Trajectory)

    def init_slots(self, control: Any) -> None:
        """Builds the strategy slots (bind calls it; unit tests call it with a plain control state)."""
        for slot, default in self.defaults.items():
            if "@" in slot:
                continue  # a policy's own strategy: built when that policy's samples come (_policy_slot)
            kind = "advantage" if slot == "advantage" else "filter"
            self.slots[slot] = Slot(control, self.name, slot, kind, default, optional=slot != "advantage")

    def _on_feedback(self, key: str, stats: PromptStats | None) -> None:
        # Another worker's update (or ours coming back): keep whichever has seen more groups.
        mine = self.stats.get(key)
        if stats is not None and (mine is None or stats.groups >= mine.groups):
            self.stats[key] = stats

    def _has_train_topic(self, policy: str) -> bool:
        known = self._train_topics.get(policy)
        if known is None:
            from astraflow.kafka.topics import TopicAdmin

            topic = self.worker.topics.train(policy)
            known = self._train_topics[policy] = bool(TopicAdmin(self.worker.kafka).list(topic).get(topic))
            if not known:
                log.error("no train topic %s: samples of policy %s are dropped (create it and restart curate)", topic, policy)
        return known

    def current_version(self, policy: str) -> int | None:
        pv = self.versions.latest.get(policy)
        return None if pv is None else int(pv.version)

    # ---- stream ----------------------------------------------------------------------------------

    def handle(self, inc: Received[Any]) -> None:
        traj: Trajectory = inc.record
        if traj.reward is None:
            raise UnscoredTrajectoryError(f"trajectory {traj.trajectory_id} has no reward; curate reads the reward app's output")
        task = self.tasks.claim(traj.group_id)
        added = self.store.add(traj, inc.value or b"", inc.partition, inc.offset, self._now(), task)
        if added.status == "refused":
            self.worker.dead_letter(inc, GroupClaimError(f"[{added.rule}] {added.reason}"))
        elif added.status == "late":
            self.worker.drop("late_trajectory")
            info = added.emitted or {}
            self.worker.dead_letter(inc, LateTrajectoryError(
                f"trajectory {traj.trajectory_id} arrived after its group {traj.group_id} was emitted without it "
                f"({len(info.get('members', ()))} of {traj.group_size} members, after the {self.group_timeout_s:g} s "
                "group timeout); raise curate's --group-timeout if this is frequent"))
        elif added.status == "superseded":
            self.worker.drop("superseded")
        elif added.group is not None:
            self._emit(added.group)

    async def tick(self, now: float) -> None:
        self.versions.refresh()
        self.feedback.refresh()
        self.tasks.refresh()
        wall = self._now()
        for p in self.store.expired(wall):
            await self.worker.in_partition(p.partition, lambda p=p: self._expire(p.group_id))
        if wall - self._pruned_at >= self.prune_interval_s:
            self._pruned_at = wall
            for partition in sorted({int(p) for p in self.worker.assigned()}):
                await self.worker.in_partition(partition, lambda part=partition: self.store.prune_emitted(wall, part))

    def _expire(self, group_id: str) -> None:
        """Emits (or drops) a timed-out group, in its partition's transaction."""
        pending: Pending | None = self.store.pending(group_id)
        if pending is not None:  # not completed meanwhile
            self._emit(self.store.take(pending, self._now()))

    def on_revoke(self, partitions: set[int]) -> None:
        gone = forget_partitions(self.store, partitions, lambda table: getattr(table, "data", table))
        if gone:
            log.info("forgot %d groups of revoked partitions; their new owner has them from the changelog", gone)

    def _now(self) -> float:
        return time.time()

    # ---- one group -------------------------------------------------------------------------------

    def _trained_versions(self, traj: Trajectory) -> dict[str, tuple[int, int]]:
        """`Trajectory.trained_versions` of a trajectory of the group being emitted, computed once."""
        found = self._versions.get(traj.trajectory_id)
        if found is None:
            found = self._versions[traj.trajectory_id] = traj.trained_versions()
        return found

    def _member_incoming(self, member: Member, traj: Trajectory) -> Received[Any]:
        return Received(traj, self.worker.source or "", member.partition, member.offset, traj.group_id.encode(), 0,
                         member.value, {})

    def _dropped(self, items: Sequence[Any], policy: str, rule: str, strategy: str, reason: str) -> GroupDropped:
        first = items[0]
        return GroupDropped(group_id=first.group_id, task_id=getattr(first, "task_id", ""), prompt_id=first.prompt_id,
                            policy=policy, trajectory_ids=[i.trajectory_id for i in items], component=self.name,
                            filter=rule, strategy=strategy, reason=reason[:1000])

    def _send_drops(self) -> None:
        for d in self._drops:
            self.worker.send_side(self.worker.topics.lineage, d, d.group_id)
        self._drops = []

    def _emit(self, group: Group) -> None:
        """The group's feedback and train samples (or dead letters), in the current transaction."""
        self._versions, self._drops = {}, []
        if group.lost:
            self.worker.drop("member_gone", len(group.lost))
            log.error("group %s: %d member(s) no longer in %s (deleted by its retention before the group left): %s",
                      group.group_id, len(group.lost), self.worker.source, ", ".join(group.lost[:8]))
            if not group.members:
                return
        incs = [self._member_incoming(m, t) for t, m in group.members.values()]
        # Statistics first, whatever happens to the samples: the curator counts every group
        # curate finished (max-ahead), and a prompt whose group broke a filter is still news.
        try:
            feedback = self.prompt_feedback(group)
        except Exception as exc:  # malformed trajectories: the samples below fail too and say why
            log.warning("no prompt statistics for group %s: %r", group.group_id, exc)
            feedback = []
        for key, stats in feedback:
            self.worker.send_side(self.worker.topics.feedback, stats, key)
        try:
            outputs = self.train_outputs(group)
        except StrategyFailed as exc:
            for inc in incs:
                self.worker.dead_letter(inc, exc, exc.strategy)
            return
        except Exception as exc:  # a malformed trajectory (e.g. arrays of unequal lengths) fails its group only
            for inc in incs:
                self.worker.dead_letter(inc, exc)
            return
        try:
            for topic, record, key in outputs:
                self.worker.send(topic, record, key)
        except SerdeError as exc:  # a sample that does not encode (e.g. too large): the group is dead-lettered
            for inc in incs:
                self.worker.dead_letter(inc, exc)
            return
        self._send_drops()  # with the samples, in the same transaction
        self.groups_emitted += 1

    def gauges(self) -> dict[str, float]:
        return {
            "groups_pending": float(self._store.pending_groups) if self._store is not None else 0.0,
            "groups_emitted_total": float(self.groups_emitted),
            **{f"control_version.{k}": float(s.version) for k, s in self.slots.items()},
        }

    def close(self) -> None:
        for reader in (getattr(self, "versions", None), getattr(self, "feedback", None), getattr(self, "tasks", None)):
            if reader is not None:
                reader.close()

