"""Pure parts of curate: assembling GRPO groups from scored trajectories, and TrainSamples per policy.

`GroupStore` collects trajectories by `group_id` until the `n_samples` members their task asked
for arrived (complete) or `timeout_s` passed since the first one (expired: curate emits it if
it still has `min_size` members). The group is what its task says (`TaskClaim`, from the task
the curator signed: `stream_apps.task_book`), never what its members claim: a trajectory whose
claims disagree with its task (`claims_broken`: no task issued its group, another group size,
a sample index out of range, another task, prompt or trajectory id), or a second trajectory for
a (group, sample_index) already taken, is `refused` with the rule it broke, and the group goes
on without it. The same trajectory id again (the task redelivered, or issued again: same task,
same ids) is `superseded`: counted and dropped. It remembers emitted group ids, so a trajectory
arriving after its group left is recognised (superseded when it was emitted, late when its
group left without it after a timeout). Its state lives in plain mappings of bytes, which
curate backs with Faust tables; they hold where each member is in the source topic, not the
member itself.

`train_samples(trajectory, policy, ...)` makes one TrainSample per training sequence of the
policy (`astraflow.dataflow.sequences.policy_sequences`): the policy's own segments, in order,
cut before each of its `prompt` segments after the first (an agent that rewrote its history
starts a new sequence). Other policies' segments are never part of it: a policy sees another's
output only as text in its own context (their tokenizers may differ). The loss mask is the
segments' mask; behaviour logprobs and versions are kept where it is 1 (0 and -1 elsewhere);
`min_version` is the oldest version among those tokens. A sequence without trained tokens
gives no sample, and the ids (`<trajectory>#<policy>`, then `#<k>`) are stable whatever is
skipped.

Per-policy rewards: a trajectory has one `reward`; a reward strategy may give a policy its own
one as the component `policy.<name>` (a verifier judged on its verdict, a solver on its
answer), which then replaces `reward` for that policy's sample.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Iterable, MutableMapping
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from astraflow.dataflow.sequences import policy_sequences, sequence_sample_id
from astraflow.records import Segment, StrategyRef, TrainSample, Trajectory
from astraflow.records.base import FLOAT32, INT32, UINT8


@dataclass(frozen=True, slots=True)
class TaskClaim:
    """What the task the curator issued says its group is."""

    task_id: str
    group_id: str
    prompt_id: str
    n_samples: int

    @staticmethod
    def of(task: Any) -> TaskClaim:
        return TaskClaim(task.task_id, task.group_id, task.prompt_id, int(task.n_samples))


# Rules a member breaks against its task (the DLQ names them).
NO_TASK = "group.no_task"
WRONG_SIZE = "group.size"
BAD_INDEX = "group.sample_index"
NOT_ITS_TASK = "group.identity"
DUPLICATE_SAMPLE = "group.duplicate_sample"


def claims_broken(traj: Trajectory, task: TaskClaim | None) -> tuple[str, str] | None:
    """(rule, reason) when `traj`'s claims disagree with its group's task; None when they agree."""
    gid = traj.group_id
    if task is None:
        return NO_TASK, (f"trajectory {traj.trajectory_id} claims group {gid}, which no task signed by the curator "
                         "issued (a forged group, or its task is older than the tasks topic's retention)")
    if traj.group_size != task.n_samples:
        return WRONG_SIZE, (f"trajectory {traj.trajectory_id} claims group_size {traj.group_size}; its task "
                            f"{task.task_id} asked for {task.n_samples} samples")
    if not 0 <= traj.sample_index < task.n_samples:
        return BAD_INDEX, (f"trajectory {traj.trajectory_id} claims sample_index {traj.sample_index}; its task "
                           f"{task.task_id} has samples 0..{task.n_samples - 1}")
    expected = Trajectory.make_id(task.task_id, traj.sample_index)
    if traj.task_id != task.task_id or traj.prompt_id != task.prompt_id or traj.trajectory_id != expected:
        return NOT_ITS_TASK, (f"trajectory {traj.trajectory_id} (task {traj.task_id}, prompt {traj.prompt_id}) is not "
                              f"sample {traj.sample_index} of task {task.task_id} (prompt {task.prompt_id}), "
                              f"whose id is {expected}")
    return None


@dataclass
class Member:
    """Where a group member came from: enough to dead-letter its original bytes."""

    partition: int
    offset: int
    value: bytes  # the record as read (single-object Avro)


@dataclass
class Group:
    """A group that is ready (complete, or timed out)."""

    group_id: str
    expected: int  # n_samples of its task
    partition: int  # source partition (a group lives on one partition: key = group_id)
    first_seen: float  # wall-clock time of its first member
    members: dict[str, tuple[Trajectory, Any]] = field(default_factory=dict)  # trajectory_id -> (trajectory, Member)
    complete: bool = False  # all `expected` members arrived (False: it timed out)
    lost: list[str] = field(default_factory=list)  # members whose records the source no longer has (retention)

    @property
    def trajectories(self) -> list[Trajectory]:
        return sorted((t for t, _ in self.members.values()), key=lambda t: (t.sample_index, t.trajectory_id))

    @property
    def tokens(self) -> list[Any]:
        return [tok for _, tok in self.members.values()]


@dataclass(frozen=True, slots=True)
class Added:
    """What `GroupStore.add` did with a trajectory."""

    status: str  # held | complete | superseded | late | refused
    group: Group | None = None  # the ready group when status == complete
    emitted: dict[str, Any] | None = None  # late / superseded after its group left: what `emitted` holds of it
    rule: str | None = None  # refused: the rule broken (`claims_broken`, DUPLICATE_SAMPLE)
    reason: str | None = None  # refused: why, for the dead letter


@dataclass(frozen=True, slots=True)
class Pending:
    """A group in assembly, as the `groups` table holds it."""

    group_id: str
    expected: int
    partition: int
    first_seen: float
    members: tuple[str, ...]  # trajectory ids, in arrival order
    offsets: tuple[int, ...]  # the source offset of each member


class GroupStore:
    """Trajectories in, complete (or expired) groups out; the state in two bytes -> bytes mappings.

    In curate the mappings are Faust tables backed by changelog topics, written in the same
    transaction as the record that changed them, so a worker that takes a partition over (after
    a crash or a rebalance) finds every group in assembly and every group already emitted:

    * `groups`: group id -> JSON {expected, partition, first_seen, members, offsets}: the ids of
      the members that arrived, in arrival order, and the source offset of each;
    * `emitted`: group id -> JSON {at, partition, members, complete}, kept `emitted_ttl_s`. A
      trajectory of an emitted group arriving later is `redelivered` when it was among the members
      emitted (its samples already left: a redelivery, dropped), `late` when it was not (its group
      left without it, after a timeout: curate dead-letters it, so it is never lost unseen).

    A member's bytes are not in the tables: the worker that read it keeps them in memory with
    the decoded trajectory (`held`: decoded once), and a worker that took the partition over reads them again from the source topic
    at their offsets when the group leaves (`fetch(partition, offsets)` -> {offset: bytes}).
    They are committed records below the committed offset (the offsets joined the table in the
    transaction that committed past them), so they are there to read while the topic's retention
    keeps them; one that is not (deleted by retention) is reported in `Group.lost`.

    Times are wall-clock seconds, so timeouts survive restarts. `decode` turns a member's bytes
    back into a Trajectory.
    """

    def __init__(self, groups: MutableMapping[bytes, bytes], emitted: MutableMapping[bytes, bytes],
                 decode: Callable[[bytes], Trajectory], fetch: Callable[[int, list[int]], dict[int, bytes]],
                 timeout_s: float, emitted_ttl_s: float = 86_400.0) -> None:
        self.groups, self.emitted = groups, emitted
        self.held: dict[bytes, tuple[Trajectory, bytes]] = {}  # `<group id>\0<trajectory id>` -> (decoded, bytes), read here
        self.decode = decode
        self.fetch = fetch
        self.timeout_s = timeout_s
        self.emitted_ttl_s = emitted_ttl_s

    def pending(self, group_id: str) -> Pending | None:
        raw = self.groups.get(group_id.encode())
        if raw is None:
            return None
        d = json.loads(raw)
        return Pending(group_id, int(d["expected"]), int(d["partition"]), float(d["first_seen"]), tuple(d["members"]),
                       tuple(int(o) for o in d["offsets"]))

    def _put(self, p: Pending) -> None:
        self.groups[p.group_id.encode()] = json.dumps({"expected": p.expected, "partition": p.partition,
                                                      "first_seen": p.first_seen, "members": list(p.members),
                                                      "offsets": list(p.offsets)}).encode()

    def add(self, traj: Trajectory, value: bytes, partition: int, offset: int, now: float,
            task: TaskClaim | None) -> Added:
        """Takes one trajectory of the group `task` (the task its curator issued; None: none did)."""
        gid = traj.group_id
        broken = claims_broken(traj, task)
        emitted = self.emitted.get(gid.encode())
        if broken is not None:
            if broken[0] == NOT_ITS_TASK and task is not None:  # another trajectory for a sample already taken?
                holder = Trajectory.make_id(task.task_id, traj.sample_index)
                taken = json.loads(emitted).get("members", ()) if emitted is not None else (
                    p.members if (p := self.pending(gid)) is not None else ())
                if holder in taken:
                    broken = (DUPLICATE_SAMPLE, f"trajectory {traj.trajectory_id} is a second trajectory for sample "
                                                f"{traj.sample_index} of group {gid}, which {holder} already holds")
            return Added("refused", rule=broken[0], reason=broken[1])
        assert task is not None
        if emitted is not None:
            info = json.loads(emitted)
            return Added("superseded" if traj.trajectory_id in info.get("members", ()) else "late", emitted=info)
        p = self.pending(gid) or Pending(gid, max(task.n_samples, 1), partition, now, (), ())
        if traj.trajectory_id in p.members:
            return Added("superseded")
        self.held[_member_key(gid, traj.trajectory_id)] = (traj, value)
        p = Pending(gid, p.expected, p.partition, p.first_seen, (*p.members, traj.trajectory_id), (*p.offsets, offset))
        if len(p.members) >= p.expected:
            return Added("complete", self.take(p, now, complete=True))
        self._put(p)
        return Added("held")

    def expired(self, now: float, partitions: set[int] | None = None) -> list[Pending]:
        """Groups whose first member is older than the timeout, oldest first (they stay until `take`)."""
        out = []
        for key in list(self.groups):
            p = self.pending(key.decode())
            if p is not None and now - p.first_seen >= self.timeout_s and (partitions is None or p.partition in partitions):
                out.append(p)
        return sorted(out, key=lambda p: p.first_seen)

    def take(self, p: Pending, now: float, complete: bool = False) -> Group:
        """Removes `p` from assembly, marks it emitted, and returns it with its members decoded."""
        group = Group(p.group_id, p.expected, p.partition, p.first_seen, complete=complete)
        held = {tid: self.held.pop(_member_key(p.group_id, tid), None) for tid in p.members}
        missing = {tid: off for tid, off in zip(p.members, p.offsets, strict=True) if held[tid] is None}
        found = self.fetch(p.partition, list(missing.values())) if missing else {}  # read by a previous owner
        for tid, off in zip(p.members, p.offsets, strict=True):
            member = held[tid]
            if member is None and (value := found.get(off)) is not None:
                member = (self.decode(value), value)
            if member is None:
                group.lost.append(tid)
                continue
            group.members[tid] = (member[0], Member(p.partition, off, member[1]))
        self.groups.pop(p.group_id.encode(), None)
        self.emitted[p.group_id.encode()] = json.dumps({"at": now, "partition": p.partition, "members": list(p.members),
                                                        "complete": complete}).encode()
        return group

    def prune_emitted(self, now: float, partition: int) -> int:
        """Forgets emitted groups of `partition` older than `emitted_ttl_s`; returns how many."""
        old = []
        for key, raw in list(self.emitted.items()):
            d = json.loads(raw)
            if int(d["partition"]) == partition and now - float(d["at"]) > self.emitted_ttl_s:
                old.append(key)
        for key in old:
            del self.emitted[key]
        return len(old)

    @property
    def pending_groups(self) -> int:
        return len(self.groups)


def forget_partitions(store: GroupStore, partitions: set[int], local: Callable[[MutableMapping[bytes, bytes]], Any]) -> int:
    """Drops, from this worker's memory only (`local(mapping)` gives the unlogged mapping), the state
    of revoked partitions: the changelog keeps it for their new owner. Returns the groups dropped."""
    gone = 0
    for key, raw in list(store.groups.items()):
        d = json.loads(raw)
        if int(d["partition"]) in partitions:
            for tid in d["members"]:
                store.held.pop(_member_key(key.decode(), tid), None)
            local(store.groups).pop(key, None)
            gone += 1
    for key, raw in list(store.emitted.items()):
        if int(json.loads(raw)["partition"]) in partitions:
            local(store.emitted).pop(key, None)
    return gone


def _member_key(group_id: str, trajectory_id: str) -> bytes:
    return f"{group_id}\0{trajectory_id}".encode()


def trained_policies(
    trajectories: Iterable[Trajectory], versions: Callable[[Trajectory], dict[str, tuple[int, int]]] = Trajectory.trained_versions
) -> list[str]:
    """Policies that generated trained tokens (loss_mask 1) in any trajectory, in order of appearance.

    `versions` computes `Trajectory.trained_versions` (pass a cached one to scan each trajectory once).
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


def train_samples(
    traj: Trajectory, policy: str, *, advantage: float = 0.0, lineage: list[StrategyRef] | None = None
) -> list[TrainSample]:
    """The training sequences of `traj` for `policy`, one TrainSample each (see the module doc).

    A sequence is `policy_sequences(traj, policy)[k]`: exactly the tokens that policy saw and
    sampled, in order; its id is `sequence_sample_id(trajectory_id, policy, k)`. Sequences that
    train nothing (loss mask all 0) give no sample, and ids of the others do not shift.
    """
    out: list[TrainSample] = []
    for k, seq in enumerate(policy_sequences(traj, policy)):
        found = [_trained_part(seg) for seg in seq]
        bad = [seg for seg, part in zip(seq, found, strict=True) if part is None]
        if not any(p is not None and p[4] is not None for p in found) and not any(
                np.frombuffer(seg.to_avro()["loss_mask"], UINT8).any() for seg in bad):
            continue
        for seg in bad:
            w = seg.to_avro()
            sizes = {len(w["token_ids"]) // 4, len(w["logprobs"]) // 4, len(w["loss_mask"]), len(w["versions"]) // 4}
            raise ValueError(f"trajectory {traj.trajectory_id}: a {seg.role} segment of policy {policy!r} has "
                             f"arrays of unequal lengths {sorted(sizes)}; the node that wrote it is broken")
        parts = [p for p in found if p is not None]
        on = [p[4] for p in parts if p[4] is not None]
        # The arrays' wire bytes joined (each segment's as it came, masked ones written out): one
        # copy of the tokens, which TrainSample.to_avro then encodes as they are (`pack`).
        token_ids, logp, loss_mask, vers = (b"".join(p[i] for p in parts) for i in range(4))
        out.append(TrainSample(
            sample_id=sequence_sample_id(traj.trajectory_id, policy, k),
            trajectory_id=traj.trajectory_id,
            group_id=traj.group_id,
            prompt_id=traj.prompt_id,
            policy=policy,
            token_ids=np.frombuffer(token_ids, INT32),
            loss_mask=np.frombuffer(loss_mask, UINT8),
            behaviour_logprobs=np.frombuffer(logp, FLOAT32),
            versions=np.frombuffer(vers, INT32),
            advantage=float(advantage),
            reward=policy_reward(traj, policy),
            min_version=min(on),
            lineage=list(lineage or []),
            temperature=traj.temperature,
        ))
    return out


def _trained_part(seg: Segment) -> tuple[bytes, bytes, bytes, bytes, int | None] | None:
    """A segment's part of a sample, as wire bytes: (token ids, behaviour logprobs (0 where not
    trained), loss mask, versions (-1 where not trained), its oldest trained version or None when
    it trains nothing); None when its arrays' lengths differ."""
    wire = seg.to_avro()
    token_ids, logp, mask_bytes, versions = wire["token_ids"], wire["logprobs"], wire["loss_mask"], wire["versions"]
    n = len(mask_bytes)
    if not (len(token_ids) == len(logp) == len(versions) == 4 * n):
        return None
    mask = np.frombuffer(mask_bytes, UINT8)
    if not mask.any():
        return token_ids, bytes(4 * n), mask_bytes, b"\xff" * (4 * n), None
    v = np.frombuffer(versions, INT32)
    if mask.all():
        return token_ids, logp, mask_bytes, versions, int(v.min())
    on = mask.astype(bool)
    return (token_ids, np.where(on, np.frombuffer(logp, FLOAT32), np.float32(0)).tobytes(), mask_bytes,
            np.where(on, v, np.int32(-1)).tobytes(), int(v[on].min()))
