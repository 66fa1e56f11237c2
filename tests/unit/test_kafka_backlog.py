"""The trainer's commit metadata and the count of samples waiting that the curator takes from it."""

from __future__ import annotations

from astraflow.kafka.backlog import commit_metadata, pending_samples


def test_samples_waiting_count_what_the_trainer_holds_and_offsets_past_what_it_read() -> None:
    # committed 100; the trainer holds 8 samples read up to 110 (2 markers among them); the end is 115
    assert pending_samples(115, 100, commit_metadata(8, 110)) == 8 + 5
    assert pending_samples(110, 100, commit_metadata(8, 110)) == 8
    assert pending_samples(105, 100, commit_metadata(8, 110)) == 5  # an end read before the commit: offsets bound it
    assert pending_samples(110, 100, None) == 10  # no metadata (another committer): offsets, markers included
    assert pending_samples(90, 100, None) == 0


def test_metadata_that_does_not_add_up_falls_back_to_offsets() -> None:
    for bad in ("", "af-held=x;read-to=110", "af-held=8;read-to=110;more", "af-held=11;read-to=110",  # 11 in 10 offsets
                "af-held=0;read-to=90", f"af-held={10**13};read-to=110"):
        assert pending_samples(110, 100, bad) == 10, bad
