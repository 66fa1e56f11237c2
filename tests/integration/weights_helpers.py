"""Checks the trainer and weights integration tests share."""

from __future__ import annotations

import time

import torch

from astraflow.weights.follow import FollowEvent, KafkaWeightFollower


def bits_equal(a: dict, b: dict) -> bool:
    """Whether two state dicts hold the same tensors bit for bit (compared as 16-bit words)."""
    return a.keys() == b.keys() and all(torch.equal(a[k].view(torch.int16), b[k].view(torch.int16)) for k in a)


def follow_until(f: KafkaWeightFollower, until_version: int, timeout_s: float = 30.0) -> list[FollowEvent]:
    """Polls `f` until its follower holds `until_version` or `timeout_s` has passed; its events."""
    events: list[FollowEvent] = []
    deadline = time.monotonic() + timeout_s
    while f.follower.version != until_version and time.monotonic() < deadline:
        events += f.poll(0.5)
    return events
