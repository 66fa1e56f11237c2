"""Two ranks train what one rank trains: `astraflow train --devices 2 --strategy ddp|fsdp` on CPU
(gloo) against a real Kafka, compared with `--devices 1` on the same records.

Each run reads the same train topic from its start into its own run directory, 3 batches of 8
samples (all on one partition, so each batch holds the same samples whatever the timing; the
trained-sample logs confirm it), and the final checkpoint's fp32 parameters are compared: equal
within float tolerance (the ranks' all-reduce adds the same terms in another order). The samples
differ in length and in trained tokens, so a per-rank token mean would not give one rank's
gradients (tests/unit/test_rl_data_parallel.py shows by how much); the trainer's loss is the
global mean (`astraflow.rl.data_parallel_normaliser`). The checkpoint keeps its world size and
the whole AdamW state, compared too.

Checkpoints resume across world sizes (2 -> 1 and 1 -> 2, DDP and FSDP): resumed after 2 batches,
the run ends where one uninterrupted rank ends after 4 (`test_resume_across_world_sizes_ddp_fsdp`).
The jobs are started as `trainers.cpu_ranks` says.
"""

from __future__ import annotations

import json
import subprocess
from pathlib import Path

import pytest
import torch

from astraflow.config import KafkaSettings
from astraflow.kafka.topics import Topics
from astraflow.models.tiny import init_tiny
from trainers.callbacks import newest_checkpoint
from trainers.cpu_ranks import send, train_cmd, train_env, varied_samples


def run_train(cmd: list[str], timeout: float = 300) -> str:
    proc = subprocess.run(cmd, env=train_env(), stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                          timeout=timeout)
    assert proc.returncode == 0, proc.stdout[-4000:]
    return proc.stdout


def trained_steps(run_dir: Path, experiment: str) -> dict[str, int]:
    """sample_id -> the step that trained it, from the trained-sample log."""
    path = run_dir / experiment / "policy" / "trained-samples.jsonl"
    lines = [json.loads(x) for x in path.read_text().splitlines()]
    steps = {x["sample_id"]: x["step"] for x in lines}
    assert len(steps) == len(lines), "a sample logged twice"
    return steps


def final_state(run_dir: Path, experiment: str) -> tuple[dict[str, torch.Tensor], dict]:
    ckpt = torch.load(newest_checkpoint(run_dir / experiment / "policy" / "checkpoints"), weights_only=False)
    return {k: v.float() for k, v in ckpt["state_dict"].items()}, ckpt


def max_diff(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> float:
    assert a.keys() == b.keys()
    return max(float((a[k] - b[k]).abs().max()) for k in a)


def moments_diff(a: dict, b: dict) -> float:
    """The largest difference between AdamW's moments (exp_avg, exp_avg_sq) of checkpoints `a`
    and `b`, relative to the largest of that moment in `b`; their step counts must be equal."""
    sa, sb = a["optimizer_states"][0]["state"], b["optimizer_states"][0]["state"]
    assert sa.keys() == sb.keys()
    assert {float(sa[k]["step"]) for k in sa} == {float(sb[k]["step"]) for k in sb}, "AdamW's step counts differ"
    worst = 0.0
    for name in ("exp_avg", "exp_avg_sq"):
        scale = max(float(sb[k][name].abs().max()) for k in sb)
        worst = max(worst, max(float((sa[k][name].float() - sb[k][name].float()).abs().max()) for k in sb) / scale)
    return worst


@pytest.mark.slow
@pytest.mark.parametrize("strategy", ["ddp", "fsdp"])
def test_two_ranks_train_what_one_rank_trains_ddp_fsdp(kafka: KafkaSettings, experiment: str, tmp_path: Path,
                                                        strategy: str) -> None:
    model = init_tiny(tmp_path / "tiny", vocab_size=512, hidden=32, layers=2, heads=2, kv_heads=1, intermediate=64)
    send(kafka, Topics(experiment).train("policy"), varied_samples(24), key="one-partition")
    states, steps, ckpts = {}, {}, {}
    for devices in (1, 2):
        run_dir = tmp_path / f"runs-{devices}"
        out = run_train(train_cmd(kafka, experiment, model, run_dir, devices, strategy if devices > 1 else "auto",
                                  "trainer.max_steps=3"))
        assert "trained 3 steps, 24 samples" in out, out[-3000:]
        states[devices], ckpt = ckpts[devices] = final_state(run_dir, experiment)
        steps[devices] = trained_steps(run_dir, experiment)
        assert ckpt["astraflow"]["world_size"] == devices
        assert ckpt["global_step"] == 3
    assert steps[1] == steps[2] and sorted(set(steps[1].values())) == [1, 2, 3]
    from transformers import AutoModelForCausalLM

    start = {f"model.{k}": v.float() for k, v in AutoModelForCausalLM.from_pretrained(model).state_dict().items()}
    moved = max_diff({k: start[k] for k in states[1]}, states[1])
    diff = max_diff(states[1], states[2])
    moments = moments_diff(ckpts[2][1], ckpts[1][1])
    print(f"\n{strategy}: max |1 rank - 2 ranks| = {diff:.2e}; max change over 3 steps = {moved:.2e}; "
          f"AdamW moments in the checkpoints differ by {moments:.1e} of their largest")
    # The checkpoint holds the whole optimizer state, whatever the strategy (FSDP gathers it).
    assert moments < 1e-3, f"the 2-rank ({strategy}) checkpoint's AdamW moments differ from 1 rank's by {moments}"
    assert moved > 1e-3, "training did not move the parameters"
    # Adam divides by sqrt(v): where a gradient is ~0, summation-order noise moves a weight by up to
    # lr x 1e-3; a per-rank mean moves them by a good part of lr (tests/unit/test_rl_data_parallel.py).
    assert diff < 0.01 * moved, f"2 ranks ({strategy}) differ from 1 rank by {diff} (training moved them by {moved})"


def committed_versions(kafka: KafkaSettings, experiment: str) -> list[tuple[int, str]]:
    """(version, state checksum) of every version committed to the policy's version stream, in order."""
    from test_trainer_resume import _read

    from astraflow.records import PolicyVersion
    from astraflow.weights.versions import STREAM_PARTITION

    return [(r.version, r.state_checksum) for r in _read(kafka, Topics(experiment).weights("policy"), "read_committed",
                                                          [STREAM_PARTITION]) if isinstance(r, PolicyVersion)]


FIRST, MORE = 2, 2  # batches (one optimizer step each) before the stop, and after the resume


@pytest.mark.slow
@pytest.mark.parametrize("strategy", ["ddp", "fsdp"])
def test_resume_across_world_sizes_ddp_fsdp(kafka: KafkaSettings, make_experiment, tmp_path: Path,
                                            strategy: str) -> None:
    """FIRST batches at world size 2, resumed at world size 1 for MORE (and 1 -> 2), end where one
    uninterrupted rank ends after FIRST + MORE batches of the same records: the same parameters
    within float tolerance (AdamW's moments and step count carried: the steps after the resume
    depend on them), every sample trained at the same step, and the same version numbers, each one
    set of weights (the resumed run adopts the checkpoint's version, it does not republish it)."""
    model = init_tiny(tmp_path / "tiny", vocab_size=512, hidden=32, layers=2, heads=2, kv_heads=1, intermediate=64)
    total = FIRST + MORE
    samples = varied_samples(8 * total)

    def job(devices: int, run_dir: Path, experiment: str, steps: int) -> str:
        chosen = strategy if devices > 1 or run_dir.name != "reference" else "auto"
        return run_train(train_cmd(kafka, experiment, model, run_dir, devices, chosen, f"trainer.max_steps={steps}"))

    reference = make_experiment("ref")
    send(kafka, Topics(reference).train("policy"), samples, key="one-partition")
    job(1, tmp_path / "reference", reference, total)
    expected, expected_ckpt = final_state(tmp_path / "reference", reference)
    expected_steps = trained_steps(tmp_path / "reference", reference)
    expected_versions = committed_versions(kafka, reference)
    assert sorted(set(expected_steps.values())) == list(range(1, total + 1))
    from transformers import AutoModelForCausalLM

    start = {f"model.{k}": v.float() for k, v in AutoModelForCausalLM.from_pretrained(model).state_dict().items()}
    moved = max_diff({k: start[k] for k in expected}, expected)
    assert moved > 1e-3, "training did not move the parameters"

    for first, then in ((2, 1), (1, 2)):
        experiment = make_experiment(f"w{first}{then}")
        send(kafka, Topics(experiment).train("policy"), samples, key="one-partition")
        run_dir = tmp_path / f"runs-{first}-{then}"
        job(first, run_dir, experiment, FIRST)
        _, ckpt = final_state(run_dir, experiment)
        assert (ckpt["astraflow"]["world_size"], ckpt["global_step"]) == (first, FIRST)
        out = job(then, run_dir, experiment, total)
        assert f"trained {total} steps, {8 * total} samples" in out, out[-3000:]
        assert f"resuming a checkpoint of {first} rank(s) on {then}" in out, out[-3000:]
        state, ckpt = final_state(run_dir, experiment)
        assert (ckpt["astraflow"]["world_size"], ckpt["global_step"]) == (then, total)
        assert trained_steps(run_dir, experiment) == expected_steps
        diff, moments = max_diff(expected, state), moments_diff(ckpt, expected_ckpt)
        versions = committed_versions(kafka, experiment)
        print(f"\n{strategy} {first} -> {then} ranks: max |resumed - uninterrupted| = {diff:.2e} (training moved "
              f"them by {moved:.2e}); AdamW moments differ by {moments:.1e} of their largest; versions "
              f"{[v for v, _ in versions]}")
        # As in the test above: float noise of the all-reduce's order, not a lost or re-sharded moment.
        assert diff < 0.01 * moved, f"{first} -> {then} ranks differ from one uninterrupted rank by {diff}"
        assert moments < 1e-3, f"{first} -> {then} ranks: AdamW moments differ from one rank's by {moments}"
        assert [v for v, _ in versions] == [v for v, _ in expected_versions], "versions republished or skipped"
        assert len({c for _, c in versions}) == len(versions), f"one set of weights under two numbers: {versions}"
