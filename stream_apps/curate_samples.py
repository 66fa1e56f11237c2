"""How the curate app turns a group into train samples and prompt feedback (steps 2 to 4 of the
`stream_apps.curate` module doc): advantages over each policy's trajectories of the group, then
the filters, each sample's lineage, and the prompt's statistics.

`GroupSamples` is the half of `CurateApp` that needs no assembly state: the app mixes it in
and provides the slots, the worker and the hooks named in the class doc.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np

from astraflow.dataflow.advantages import advantages_for
from astraflow.dataflow.filters import FilterContext, FilterResult
from astraflow.dataflow.prompt_stats import update_prompt_stats
from astraflow.dataflow.registry import Strategy
from astraflow.errors import AstraflowError
from astraflow.records import (
    GroupDropped,
    PromptStats,
    StrategyRef,
    TrainSample,
    Trajectory,
    TrajectoryStatus,
)
from stream_apps.groups import (
    Group,
    policy_reward,
    train_samples,
    trained_policies,
)
from stream_apps.handler import StrategyFailed
from stream_apps.slots import Slot, SlotDefault

TRAJECTORY_FILTERS = ("filter.dedupe", "filter.length")
SAMPLE_FILTERS = ("filter.zero_variance", "filter.staleness")


class IncompleteGroupError(AstraflowError):
    """A group timed out with fewer than `--min-group-size` members; its members go to the DLQ."""


class GroupSamples:
    """Train samples and feedback of one group (mixed into `CurateApp`).

    The app provides: `name`, `policies`, `slots`, `defaults`, `worker`, `min_group_size`,
    `group_timeout_s`, `stats`, `stats_alpha`, `_extra_generation`, and the hooks
    `current_version(policy)`, `_has_train_topic(policy)`, `_trained_versions(traj)` and
    `_dropped(items, policy, rule, strategy, reason)`.
    """

    name: str
    policies: Sequence[str]
    slots: dict[str, Slot]
    defaults: dict[str, SlotDefault]
    worker: Any
    min_group_size: int
    group_timeout_s: float
    stats: dict[str, PromptStats]
    stats_alpha: float
    _extra_generation: int
    _versions: dict[str, Any]
    _drops: list[GroupDropped]

    def process(self, group: Group) -> tuple[list[tuple[str, TrainSample, str]], list[tuple[str, PromptStats]]]:
        """(train samples with their topic and key, feedback records with their key) of one group."""
        self._versions, self._drops = {}, []
        return self.train_outputs(group), self.prompt_feedback(group)

    def prompt_feedback(self, group: Group) -> list[tuple[str, PromptStats]]:
        """Updated statistics of the group's prompt for each policy that trained in it, with their keys."""
        return self._prompt_stats(group.trajectories)

    def train_outputs(self, group: Group) -> list[tuple[str, TrainSample, str]]:
        """The group's train samples with their topic and key (filters and advantages applied)."""
        trajs = group.trajectories
        if not group.complete and len(trajs) < self.min_group_size:
            self.worker.drop("incomplete_group", len(trajs))
            raise IncompleteGroupError(
                f"group {group.group_id} timed out after {self.group_timeout_s:g} s with {len(trajs)} of {group.expected} "
                f"members, fewer than --min-group-size {self.min_group_size}")
        # A trajectory that ended in ERROR (backend crash, timeout, a raising workflow) is an
        # infrastructure failure, not a sample of the policy: never trained, and not part of its
        # siblings' baseline either. Not a strategy the control topic could switch off.
        failed = [t for t in trajs if t.status is TrajectoryStatus.ERROR]
        if failed:
            self.worker.drop("error_trajectory", len(failed))
            self._drops.append(self._dropped(failed, "", "status", "error_trajectory",
                                             "ended in ERROR: " + (failed[0].error or "no error text")[:500]))
            trajs = [t for t in trajs if t.status is not TrajectoryStatus.ERROR]
        # Advantages are computed on the whole (deduplicated) group, then filters mask samples
        # out of it (as DAPO does): dropping a stale or over-long member must not change its
        # siblings' advantages.
        kept, refs = self._filter("filter.dedupe", trajs, FilterContext())
        short, length_refs = self._filter("filter.length", kept, FilterContext())
        short_ids = {t.trajectory_id for t in short}
        by_id = {t.trajectory_id: t for t in kept}
        outputs: list[tuple[str, TrainSample, str]] = []
        for policy in trained_policies(kept, self._trained_versions):
            if (self.policies and policy not in self.policies) or not self._has_train_topic(policy):
                self.worker.drop("unrouted_policy", len(kept))
                self._drops.append(self._dropped(kept, policy, "routing", "unrouted_policy",
                                                 f"curate routes {', '.join(self.policies)} only" if self.policies
                                                 else f"no train topic {self.worker.topics.train(policy)}"))
                continue
            per_traj = [ss for t in kept if (ss := train_samples(t, policy))]
            if not per_traj:
                continue
            adv_slot = self._policy_slot("advantage", policy)
            adv = self.slots[adv_slot].get()
            assert adv is not None
            try:  # one reward per trajectory, whatever its number of sequences
                values = advantages_for([ss[0] for ss in per_traj], adv.impl)
            except Exception as exc:
                raise StrategyFailed(adv.name, exc) from exc
            samples: list[TrainSample] = []
            for ss, value in zip(per_traj, np.asarray(values, dtype=np.float64).tolist(), strict=True):
                for sample in ss:
                    sample.advantage = float(value)
                samples += ss
            policy_refs = [*refs, *length_refs]
            ctx = FilterContext(current_version=self.current_version(policy))
            zero_variance, *others = self._sample_filter_slots()  # zero variance: judged on the whole group
            samples, ref = self._filter(self._policy_slot(zero_variance, policy), samples, ctx, policy)
            policy_refs += ref
            samples = [s for s in samples if s.trajectory_id in short_ids]
            for slot in others:
                if slot == "filter.staleness" and ctx.current_version is None:
                    continue  # no trainer version known yet: nothing can be stale
                samples, ref = self._filter(self._policy_slot(slot, policy), samples, ctx, policy)
                policy_refs += ref
            policy_refs.append(adv.ref(self.name, adv_slot))
            topic = self.worker.topics.train(policy)
            for sample in samples:
                sample.lineage = [*by_id[sample.trajectory_id].lineage, *policy_refs]
                outputs.append((topic, sample, sample.group_id))
        return outputs

    def _filter(self, slot: str, items: list[Any], ctx: FilterContext, policy: str = "") -> tuple[list[Any], list[StrategyRef]]:
        strategy: Strategy[Any] | None = self.slots[slot].get()
        if strategy is None or not items:
            return items, []
        try:
            result: FilterResult[Any] = strategy(items, ctx)
        except Exception as exc:
            raise StrategyFailed(strategy.name, exc) from exc
        if result.dropped:
            self.worker.drop(strategy.name, len(result.dropped))
            by_reason: dict[str, list[Any]] = {}
            for d in result.dropped:
                by_reason.setdefault(d.reason, []).append(d.item)
            self._drops += [self._dropped(dropped, policy, slot, strategy.name, reason) for reason, dropped in by_reason.items()]
        return list(result.kept), [strategy.ref(self.name, slot)]

    def _policy_slot(self, slot: str, policy: str) -> str:
        """`<slot>@<policy>` where a --default or a control record names it (that policy's own
        strategy), else `slot`. Once named, it stays the policy's slot: a tombstone takes it back
        to its own default, or to the shared slot's default."""
        own = f"{slot}@{policy}"
        if own not in self.slots:
            control = self.worker.control
            if own not in self.defaults and control.state.get(self.name, own) is None:
                return slot
            default = self.defaults.get(own) or self.defaults.get(slot) or SlotDefault("none")
            kind = "advantage" if slot == "advantage" else "filter"
            self.slots[own] = Slot(control, self.name, own, kind, default, optional=slot != "advantage")
        return own

    def _sample_filter_slots(self) -> list[str]:
        """Built-in sample filters, then any other `filter.*` slot the control topic names."""
        control = self.worker.control
        if control.generation != self._extra_generation:
            self._extra_generation = control.generation
            for slot in sorted(control.state.slots(self.name)):
                if slot.startswith("filter.") and "@" not in slot and slot not in self.slots:
                    self.slots[slot] = Slot(control, self.name, slot, "filter", SlotDefault("none"), optional=True)
        extra = sorted(s for s in self.slots
                       if s.startswith("filter.") and "@" not in s and s not in (*TRAJECTORY_FILTERS, *SAMPLE_FILTERS))
        return [*SAMPLE_FILTERS, *extra]

    def _prompt_stats(self, trajs: list[Trajectory]) -> list[tuple[str, PromptStats]]:
        out = []
        versions = [self._trained_versions(t) for t in trajs]
        for policy in trained_policies(trajs, self._trained_versions):
            mine = [(t, v[policy]) for t, v in zip(trajs, versions, strict=True) if policy in v]
            key = f"{policy}/{trajs[0].prompt_id}"
            stats = update_prompt_stats(
                self.stats.get(key),
                [policy_reward(t, policy) for t, _ in mine],
                [t.num_tokens for t, _ in mine],
                max(newest for _, (_, newest) in mine),
                alpha=self.stats_alpha,
                prompt_id=trajs[0].prompt_id,
                dataset=trajs[0].dataset,
                policy=policy,
            )
            self.stats[key] = stats
            out.append((key, stats))
        return out
