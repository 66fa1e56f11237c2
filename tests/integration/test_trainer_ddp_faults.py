"""Exactly-once training with two DDP ranks under `kill -9` of either rank, resuming across world
sizes (2 -> 1 -> 2), on CPU (gloo) against a real Kafka.

`astraflow train` runs one after another on one checkpoint directory; each but the last has a
rank SIGKILL itself (`ASTRAFLOW_TRAINER_CRASH_AT=<point>:<n>@<rank>`): rank 0 between a checkpoint
and its publication, the one-rank run after a step no checkpoint holds, rank 1 after such a step
(rank 0 must end, not hang), rank 0 mid-publication (chunks sent, transaction open). The job must
end each time (the other rank sees its peer gone and stops: `trainers.distributed.RankLostError`,
or Lightning's launcher kills it), and the last run trains until the topic is idle. Counted as in
test_trainer_resume.py, from the weights topic (read_committed), the lineage topic and the
trained-sample log: every sample in exactly one version, none lost, no version number with two
sets of weights, the repeated copies dead-lettered (at least once: a dead letter is written
again when a kill lands between it and the checkpoint that consumes its offset).
Also: a checkpoint written with FSDP is refused, with a clear error, by a run without it.
"""

from __future__ import annotations

import collections
import contextlib
import json
import os
import signal
import subprocess
from pathlib import Path

import pytest
from test_trainer_resume import _read

from astraflow.config import KafkaSettings
from astraflow.kafka.topics import Topics
from astraflow.models.tiny import init_tiny
from astraflow.records import DeadLetter, PolicyVersion, TrainedSamples
from astraflow.weights.versions import STREAM_PARTITION
from trainers.cpu_ranks import send, train_cmd, train_env, varied_samples

N_SAMPLES = 64  # 16 batches of 4
N_REPEATED = 6  # sent a second time, later in the topic
SETTINGS = ("trainer.batch_size=4", "trainer.max_wait_s=0.3", "trainer.publish_every_steps=2",
            "trainer.checkpoint_every_steps=3", "trainer.snapshot_every_versions=3", "trainer.lr=1e-4")


def _run(cmd: list[str], crash: str | None) -> tuple[int, str]:
    """Runs a trainer job (all its ranks) to its end; whatever is left of it is killed."""
    proc = subprocess.Popen(cmd, env=train_env(crash), stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            start_new_session=True)
    try:
        out, _ = proc.communicate(timeout=300)
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGKILL)  # the job's session: a rank left behind would be a leak
        proc.wait()
    return proc.returncode, out


@pytest.mark.slow
def test_kill_9_of_either_ddp_rank_loses_nothing_and_trains_nothing_twice(
    kafka: KafkaSettings, experiment: str, tmp_path: Path
) -> None:
    topics = Topics(experiment)
    model = init_tiny(tmp_path / "tiny", vocab_size=512, hidden=32, layers=1, heads=2, kv_heads=1, intermediate=64)
    samples = varied_samples(N_SAMPLES)
    send(kafka, topics.train("policy"), samples + samples[20 : 20 + N_REPEATED])
    run_dir = tmp_path / "runs"
    # (ranks, crash): points counted from each job's start (publications at even batches and at start)
    plan = [(2, "after_checkpoint:2@0"), (1, "step_trained:3"), (2, "step_trained:3@1"), (2, "chunks_sent:2@0"),
            (2, None)]
    ended = []
    for devices, crash in plan:
        extra = ("trainer.stop_when_idle_s=6",) if crash is None else ()
        cmd = train_cmd(kafka, experiment, model, run_dir, devices, "ddp" if devices > 1 else "auto", *SETTINGS, *extra)
        rc, out = _run(cmd, crash)
        if crash is None:
            assert rc == 0, out[-4000:]
            break
        assert rc != 0, f"{crash}: the job did not end with its killed rank\n{out[-3000:]}"
        lost = "lost the other ranks" in out
        ended.append((devices, crash, rc, "RankLostError" if lost else "killed"))
        if crash.endswith("@1"):  # rank 0 outlived rank 1: it stopped with the clear error, or the launcher killed it
            assert lost or rc == -signal.SIGKILL, out[-3000:]

    committed = [r for r in _read(kafka, topics.weights("policy"), "read_committed") if isinstance(r, PolicyVersion)]
    checksums = collections.defaultdict(set)
    for m in committed:
        checksums[m.version].add(m.state_checksum)
    assert all(len(c) == 1 for c in checksums.values()), "a version number carries two different weights"
    stream = [r for r in _read(kafka, topics.weights("policy"), "read_committed", [STREAM_PARTITION])
              if isinstance(r, PolicyVersion)]
    numbers = [m.version for m in stream]
    assert numbers == sorted(set(numbers)), f"versions committed twice or out of order: {numbers}"

    lines = [json.loads(x) for x in (run_dir / experiment / "policy" / "trained-samples.jsonl").read_text().splitlines()]
    per_sample = collections.defaultdict(set)
    for line in lines:
        per_sample[line["sample_id"]].add((line["step"], line["version"]))
    twice = {k: v for k, v in per_sample.items() if len(v) > 1}
    lost = {s.sample_id for s in samples} - set(per_sample)
    assert not twice, f"trained twice in the followed lineage: {twice}"
    assert not lost, f"samples lost: {sorted(lost)}"
    on_topic = [(sid, step, r.version) for r in _read(kafka, topics.lineage, "read_committed") if isinstance(r, TrainedSamples)
                for sid, step in zip(r.sample_ids, r.steps, strict=True)]
    assert sorted(on_topic) == sorted((x["sample_id"], x["step"], x["version"]) for x in lines)
    dead = [r for r in _read(kafka, topics.dlq, "read_committed") if isinstance(r, DeadLetter)]
    # Each repeated copy is dead-lettered, never trained; a dead letter may be written again when a
    # kill lands after it and before the checkpoint that consumes its offset (dead letters are
    # diagnostics, at least once; the samples are what is exactly once).
    assert {d.error_class for d in dead} == {"DuplicateSampleError"}, [d.error for d in dead]
    assert {d.error.split("'")[1] for d in dead} == {s.sample_id for s in samples[20 : 20 + N_REPEATED]}
    print(f"\n(ranks, kill point, exit code, how the job ended): {ended}; {len(committed)} versions committed, "
          f"{len(per_sample)} samples in the lineage once each, 0 twice, 0 lost; {N_REPEATED} repeated copies "
          f"dead-lettered ({len(dead)} dead letters)")


@pytest.mark.slow
def test_a_fsdp_checkpoint_is_refused_by_a_ddp_run(kafka: KafkaSettings, experiment: str, tmp_path: Path) -> None:
    model = init_tiny(tmp_path / "tiny", vocab_size=512, hidden=32, layers=1, heads=2, kv_heads=1, intermediate=64)
    send(kafka, Topics(experiment).train("policy"), varied_samples(8))
    run_dir = tmp_path / "runs"
    rc, out = _run(train_cmd(kafka, experiment, model, run_dir, 2, "fsdp", "trainer.max_steps=1"), None)
    assert rc == 0, out[-3000:]
    rc, out = _run(train_cmd(kafka, experiment, model, run_dir, 1, "auto", "trainer.max_steps=2"), None)
    assert rc != 0 and "was written with fsdp" in out, out[-3000:]
