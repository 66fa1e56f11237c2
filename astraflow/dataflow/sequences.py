"""A trajectory's training sequences per policy, for agents that rewrite their history.

A workflow that keeps one growing context (the built-ins) records one sequence per policy: its
segments, in order. An agent behind the OpenAI endpoint may instead drop, edit or summarise
earlier messages; the next prompt then does not extend what the model saw before, and the
endpoint starts a new sequence with a context segment of role `prompt`. Each sequence of a
policy is one training sample: the tokens that policy saw, exactly, with its own sampled tokens
trained. Sample ids stay unique and deterministic: `<trajectory_id>#<policy>` for the first
sequence (as before), `<trajectory_id>#<policy>#<k>` for the k-th after it.
"""

from __future__ import annotations

from collections.abc import Iterable

from astraflow.records import Segment, Trajectory


def policy_sequences(traj: Trajectory, policy: str) -> list[list[Segment]]:
    """The sequences of `policy` in `traj`: its segments, cut before each of its `prompt`
    segments after the first (segments of other policies are not part of its sequences)."""
    return segment_sequences(traj.segments, policy)


def segment_sequences(segments: Iterable[Segment], policy: str) -> list[list[Segment]]:
    """`policy_sequences` of a list of segments (a trajectory being built)."""
    out: list[list[Segment]] = []
    for seg in segments:
        if seg.policy != policy:
            continue
        if not out or (seg.role == "prompt" and out[-1]):
            out.append([])
        out[-1].append(seg)
    return [s for s in out if s]


def sequence_sample_id(trajectory_id: str, policy: str, index: int) -> str:
    """Sample id of the `index`-th sequence of `policy` (index 0 keeps the one-sequence id)."""
    base = f"{trajectory_id}#{policy}"
    return base if index == 0 else f"{base}#{index}"


__all__ = ["policy_sequences", "segment_sequences", "sequence_sample_id"]
