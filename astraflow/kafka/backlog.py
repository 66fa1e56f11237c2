"""Samples a trainer has not trained yet, counted exactly where it can be: its commit metadata.

The curator keeps at most max-ahead tasks between itself and each trainer, counting the samples
of a train topic between the trainer group's committed offset and the topic's end (the last
stable offset). Offsets overcount samples: curate writes the topic in transactions, and every
transaction leaves a marker after its records in each partition it wrote. Counting a marker as a
sample makes the curator issue fewer tasks than there is room for (with batches of 8 groups and
max-ahead 16, a wave of 7 tasks, and batches that then wait for a group of the next wave).

So the trainer, which reads ahead of what it trains, says in the metadata of each committed
offset how many samples it already holds past that offset (read, not yet trained) and up to which
offset it has read. Between the committed offset and that one it knows every record, markers
excluded; past it, only offsets are known:

    pending = held + max(0, end - read_to)        (metadata present and well formed)
    pending = max(0, end - committed)             (otherwise: markers count, too many)

The next batch's samples mostly arrive while the trainer trains, after its commit, each curate
transaction of them followed by a marker; counted by offsets, each marker made the curator
issue one task too few until the trainer's next commit (in `bench/vs_trl.py`, batch k+2's last
task went out at the take of batch k+1 instead of k, and every other step waited for it). So the
trainer commits the same offsets again with fresh metadata whenever it reads more, and a
background reader of its stream polls while it trains (`TrainStream.report_s`, 20 ms).

Both never count fewer samples than there are, so the curator never issues more than max-ahead.
The metadata is untrusted like any record: anything that does not parse, or that claims more
than the offsets allow, falls back to the offsets.
"""

from __future__ import annotations

import re

_META = re.compile(r"af-held=(\d{1,12});read-to=(\d{1,19})")


def commit_metadata(held: int, read_to: int) -> str:
    """The metadata of a trainer's committed offset: `held` samples read past it, read up to `read_to`."""
    return f"af-held={held};read-to={read_to}"


def pending_samples(end: int, committed: int, metadata: str | None) -> int:
    """Samples of one partition not trained yet (see the module doc); `committed` >= 0."""
    by_offsets = max(0, end - committed)
    match = _META.fullmatch(metadata or "")
    if match is None:
        return by_offsets
    held, read_to = int(match.group(1)), int(match.group(2))
    if read_to < committed or held > read_to - committed:  # not what a reader of [committed, read_to) can hold
        return by_offsets
    return min(by_offsets, held + max(0, end - read_to))
