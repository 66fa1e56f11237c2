"""Pure parts of curate: assembling GRPO groups from scored trajectories, and TrainSamples per policy.

`GroupAssembler` collects trajectories by `group_id` until `group_size` distinct ones arrived
(complete) or `timeout_s` passed since the first one (expired: curate emits it if it still has
`min_size` members). It remembers recently emitted group ids, so a trajectory arriving after
its group left (a redelivery, or a straggler past the timeout) is recognised as late. Each
member carries an opaque token (the stream record it came from) that curate finishes when the
group leaves.

`train_sample(trajectory, policy, ...)` makes one sequence per policy out of a trajectory:
every segment's tokens in order; the loss mask is the segment's mask on that policy's
segments and 0 elsewhere; behaviour logprobs and versions are kept where the mask is 1 (0 and
-1 elsewhere); `min_version` is the oldest version among those tokens. A trajectory without
trained tokens for a policy gives no sample for it.

Per-policy rewards: a trajectory has one `reward`; a reward strategy may give a policy its own
one as the component `policy.<name>` (a verifier judged on its verdict, a solver on its
answer), which then replaces `reward` for that policy's sample.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from astraflow.records import StrategyRef, TrainSample, Trajectory

TP = tuple[str, int]


@dataclass
class Group:
    """A group being assembled, or one that is ready."""

    group_id: str
    expected: int  # group_size of its trajectories
    tp: TP  # partition its records came from (a group lives on one partition: key = group_id)
    first_seen: float  # monotonic time of its first member
    members: dict[str, tuple[Trajectory, Any]] = field(default_factory=dict)  # trajectory_id -> (trajectory, token)
    complete: bool = False  # all `expected` members arrived (False: it timed out)

    @property
    def trajectories(self) -> list[Trajectory]:
        return sorted((t for t, _ in self.members.values()), key=lambda t: (t.sample_index, t.trajectory_id))

    @property
    def tokens(self) -> list[Any]:
        return [tok for _, tok in self.members.values()]


@dataclass(frozen=True, slots=True)
class Added:
    """What `GroupAssembler.add` did with a trajectory."""

    status: str  # held | complete | duplicate | late
    group: Group | None = None  # the ready group when status == complete


class GroupAssembler:
    """Trajectories in, complete (or expired) groups out."""

    def __init__(self, timeout_s: float, emitted_capacity: int = 100_000) -> None:
        self.timeout_s = timeout_s
        self.pending: dict[str, Group] = {}  # group_id -> group, oldest first
        self.emitted: OrderedDict[str, None] = OrderedDict()  # recently emitted group ids (LRU)
        self.emitted_capacity = emitted_capacity

    def add(self, traj: Trajectory, token: Any, tp: TP, now: float) -> Added:
        if traj.group_id in self.emitted:
            return Added("late")
        group = self.pending.get(traj.group_id)
        if group is None:
            group = self.pending[traj.group_id] = Group(traj.group_id, max(traj.group_size, 1), tp, now)
        if traj.trajectory_id in group.members:
            return Added("duplicate")
        group.members[traj.trajectory_id] = (traj, token)
        if len(group.members) >= group.expected:
            group.complete = True
            self._done(group)
            return Added("complete", group)
        return Added("held")

    def expire(self, now: float) -> list[Group]:
        """Groups whose first member is older than the timeout (oldest first); they leave."""
        out = []
        for group in list(self.pending.values()):  # insertion order = first_seen order
            if now - group.first_seen < self.timeout_s:
                break
            out.append(group)
            self._done(group)
        return out

    def drop_partitions(self, tps: set[TP]) -> list[Group]:
        """Forgets groups of revoked partitions (their records are read again by the new owner)."""
        gone = [g for g in self.pending.values() if g.tp in tps]
        for g in gone:
            del self.pending[g.group_id]
        return gone

    def _done(self, group: Group) -> None:
        self.pending.pop(group.group_id, None)
        self.emitted[group.group_id] = None
        if len(self.emitted) > self.emitted_capacity:
            self.emitted.popitem(last=False)

    @property
    def pending_records(self) -> int:
        return sum(len(g.members) for g in self.pending.values())


def trained_versions(traj: Trajectory) -> dict[str, tuple[int, int]]:
    """Per policy that trained tokens (loss_mask 1) in `traj`: (oldest, newest) version among them."""
    out: dict[str, tuple[int, int]] = {}
    for seg in traj.segments:
        mask = np.asarray(seg.loss_mask).astype(bool, copy=False)
        if not mask.any():
            continue
        v = np.asarray(seg.versions)[mask]
        lo, hi = int(v.min()), int(v.max())
        old = out.get(seg.policy)
        out[seg.policy] = (lo, hi) if old is None else (min(old[0], lo), max(old[1], hi))
    return out


def trained_policies(
    trajectories: Iterable[Trajectory], versions: Callable[[Trajectory], dict[str, tuple[int, int]]] = trained_versions
) -> list[str]:
    """Policies that generated trained tokens (loss_mask 1) in any trajectory, in order of appearance.

    `versions` computes `trained_versions` (pass a cached one to scan each trajectory once).
    """
    seen: dict[str, None] = {}
    for t in trajectories:
        for policy in versions(t):
            seen.setdefault(policy, None)
    return list(seen)


def policy_reward(traj: Trajectory, policy: str) -> float:
    """The reward a policy's sample gets: component `policy.<name>` if the reward gave one, else `reward`."""
    specific = traj.reward_components.get(f"policy.{policy}")
    if specific is not None:
        return float(specific)
    if traj.reward is None:
        raise ValueError(f"trajectory {traj.trajectory_id} has no reward; is it from the scored topic?")
    return float(traj.reward)


def sample_id(trajectory_id: str, policy: str) -> str:
    """Deterministic, so a re-emitted group yields the same ids (the trainer can drop duplicates)."""
    return f"{trajectory_id}#{policy}"


def train_sample(
    traj: Trajectory, policy: str, *, advantage: float = 0.0, lineage: list[StrategyRef] | None = None
) -> TrainSample | None:
    """One training sequence of `traj` for `policy` (see the module doc); None if it trains nothing."""
    segs = traj.segments
    if not segs:
        return None
    mine = [seg.policy == policy for seg in segs]
    if not any(mine):
        return None
    loss_mask = np.concatenate([
        np.asarray(seg.loss_mask, dtype=np.uint8) if m else np.zeros(len(seg), np.uint8) for seg, m in zip(segs, mine, strict=True)
    ])
    on = loss_mask.astype(bool)
    if not on.any():
        return None
    token_ids = np.concatenate([np.asarray(seg.token_ids, dtype=np.int32) for seg in segs])
    if all(mine):  # one policy: its arrays as they are, zeroed where not trained
        logp = np.concatenate([np.asarray(seg.logprobs, dtype=np.float32) for seg in segs])
        vers = np.concatenate([np.asarray(seg.versions, dtype=np.int32) for seg in segs])
    else:
        logp = np.concatenate([
            np.asarray(seg.logprobs, dtype=np.float32) if m else np.zeros(len(seg), np.float32) for seg, m in zip(segs, mine, strict=True)
        ])
        vers = np.concatenate([
            np.asarray(seg.versions, dtype=np.int32) if m else np.full(len(seg), -1, np.int32) for seg, m in zip(segs, mine, strict=True)
        ])
    logp = np.where(on, logp, np.float32(0))
    vers = np.where(on, vers, np.int32(-1))
    return TrainSample(
        sample_id=sample_id(traj.trajectory_id, policy),
        trajectory_id=traj.trajectory_id,
        group_id=traj.group_id,
        prompt_id=traj.prompt_id,
        policy=policy,
        token_ids=token_ids,
        loss_mask=loss_mask,
        behaviour_logprobs=logp,
        versions=vers,
        advantage=float(advantage),
        reward=policy_reward(traj, policy),
        min_version=int(vers[on].min()),
        lineage=list(lineage or []),
    )


def newest_version(traj: Trajectory, policy: str) -> int:
    """Newest policy version among `policy`'s trained tokens of `traj` (-1 if none)."""
    return trained_versions(traj).get(policy, (-1, -1))[1]
