"""Trajectories curate's staleness filter dropped, counted from what curate publishes.

Curate writes a `GroupDropped` record to the lineage topic for every group of samples a filter
drops, naming the slot (`filter.staleness`, or `filter.staleness@<policy>` for a policy's own
limit) and the trajectory ids. `stale_dropped` counts those ids (distinct) per policy among the
trajectories given (distinct `trajectory_id`s, e.g. the rollouts topic's records read before the
lineage topic, so that every drop of one of them is in what was read), and over their number.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

from astraflow.records import GroupDropped


def stale_dropped(lineage: Iterable[Any], trajectories: Iterable[Any]) -> dict[str, Any]:
    """`{"trajectories": n, "dropped": {policy: n}, "fraction": {policy: dropped / n}}`; records of
    other kinds in `lineage` are ignored, and so are drops by other filters and of trajectories
    not given."""
    ids = {t.trajectory_id for t in trajectories if getattr(t, "trajectory_id", None)}
    dropped: dict[str, set[str]] = {}
    for rec in lineage:
        if isinstance(rec, GroupDropped) and rec.filter.split("@", 1)[0] == "filter.staleness":
            dropped.setdefault(rec.policy, set()).update(i for i in rec.trajectory_ids if i in ids)
    n = len(ids)
    return {"trajectories": n, "dropped": {p: len(ids) for p, ids in sorted(dropped.items())},
            "fraction": {p: round(len(ids) / n, 4) if n else None for p, ids in sorted(dropped.items())}}
