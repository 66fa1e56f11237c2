"""The trainer scores sampled tokens under the distribution the rollout node sampled them from.

The torch backend records ``log_softmax(logits / T)`` renormalised over the top-p nucleus; a
TrainSample carries T (schema v2) and the trainer divides its logits by it. At T = 0.7 the
trainer's logprobs of the backend's tokens must equal the recorded ones (1e-5), and old (v1)
records decode with T = 1.
"""

from __future__ import annotations

import dataclasses
import json
import shutil
from pathlib import Path

import numpy as np
import pytest
import torch

from astraflow.raas.backends.base import GenerateRequest
from astraflow.raas.backends.torch_backend import TorchBackend, sample_tokens
from astraflow.records import TrainSample
from astraflow.rl.samples import SampleLimits, sample_problem
from astraflow.schema_catalog import SchemaCatalog, default_schemas_dir
from astraflow.serde import AvroSerde
from trainers.batching import collate
from trainers.module import PolicyTrainer

pytestmark = pytest.mark.unit



def _rollout(tiny: Path, temperature: float, top_p: float = 1.0) -> TrainSample:
    backend = TorchBackend("policy", str(tiny), seed=3, max_batch=2, threads=1, device="cpu")
    try:
        prompt = [5, 17, 42, 9]
        gen = backend.generate_sync(GenerateRequest(prompt, max_tokens=12, temperature=temperature, top_p=top_p))
    finally:
        backend.close()
    g = len(gen.token_ids)
    mask = np.r_[np.zeros(len(prompt), np.uint8), np.ones(g, np.uint8)]
    return TrainSample("s", "t", "g", "p", "policy", np.r_[prompt, gen.token_ids].astype(np.int32), mask,
                       np.r_[np.zeros(len(prompt), np.float32), gen.logprobs].astype(np.float32),
                       np.where(mask == 1, 0, -1).astype(np.int32), 1.0, 1.0, 0, temperature=temperature)


def _trainer_logprobs(tiny: Path, sample: TrainSample) -> tuple[np.ndarray, np.ndarray]:
    module = PolicyTrainer(tiny)
    module.eval()
    batch = collate([sample])
    with torch.no_grad():
        lp = module.scored_logprobs(batch)[0][0]
    on = batch["loss_mask"][0]
    return lp[on].numpy(), batch["behaviour_logprobs"][0][on].numpy()


def test_trainer_and_backend_logprobs_agree_at_temperature_0_7(tiny: Path) -> None:
    sample = _rollout(tiny, 0.7)
    trainer, recorded = _trainer_logprobs(tiny, sample)
    np.testing.assert_allclose(trainer, recorded, atol=1e-5)
    # Without the temperature the trainer would score another distribution.
    untempered = dataclasses.replace(sample, temperature=1.0)
    wrong, _ = _trainer_logprobs(tiny, untempered)
    assert np.abs(wrong - recorded).max() > 1e-3


def test_top_p_logprob_is_renormalised_over_the_nucleus() -> None:
    logits = torch.log(torch.tensor([[0.5, 0.3, 0.15, 0.05]]))
    gen = torch.Generator().manual_seed(0)
    seen = set()
    for _ in range(50):
        tok, lp = sample_tokens(logits, torch.tensor([1.0]), torch.tensor([0.7]), gen)
        seen.add(int(tok))
        # nucleus {0, 1} (mass 0.8 reaches 0.7): probabilities 0.5/0.8 and 0.3/0.8
        expected = {0: 0.5 / 0.8, 1: 0.3 / 0.8}[int(tok)]
        assert lp.item() == pytest.approx(np.log(expected), abs=1e-6)
    assert seen == {0, 1}
    tok, lp = sample_tokens(logits, torch.tensor([1.0]), torch.tensor([1.0]), gen)
    assert lp.item() == pytest.approx(float(torch.log_softmax(logits, -1)[0, int(tok)]), abs=1e-6)


def test_a_sample_must_have_a_positive_finite_temperature() -> None:
    s = TrainSample("s", "t", "g", "p", "policy", np.arange(4, dtype=np.int32), np.array([0, 1, 1, 1], np.uint8),
                    np.array([0, -1, -1, -1], np.float32), np.array([-1, 0, 0, 0], np.int32), 1.0, 1.0, 0)
    limits = SampleLimits("policy", 10, 10)
    assert sample_problem(s, limits) is None
    for bad in (0.0, -1.0, float("nan"), float("inf"), 1000.0):
        s.temperature = bad
        assert (sample_problem(s, limits) or "").startswith("temperature:"), bad


def test_a_sample_too_stale_when_read_is_refused() -> None:
    s = TrainSample("s", "t", "g", "p", "policy", np.arange(4, dtype=np.int32), np.array([0, 1, 1, 1], np.uint8),
                    np.array([0, -1, -1, -1], np.float32), np.array([-1, 3, 3, 4], np.int32), 1.0, 1.0, 3)
    limits = SampleLimits("policy", 10, 10, max_staleness=8)
    assert sample_problem(s, limits, newest_version=11) is None
    assert (sample_problem(s, limits, newest_version=12) or "").startswith("stale: its oldest trained token is 9 versions")


def test_v1_train_samples_decode_with_temperature_one(tmp_path: Path) -> None:
    root = tmp_path / "schemas"
    shutil.copytree(default_schemas_dir(), root)
    (root / "train_sample" / "v2.avsc").unlink()  # a writer from before v2
    old, new = AvroSerde(SchemaCatalog.load(root)), AvroSerde()
    s = TrainSample("s", "t", "g", "p", "policy", np.arange(4, dtype=np.int32), np.ones(4, np.uint8),
                    np.zeros(4, np.float32), np.zeros(4, np.int32), 1.0, 1.0, 0)
    data = old.encode("astraflow.TrainSample", {k: v for k, v in s.to_avro().items() if k != "temperature"})
    assert new.loads(data, TrainSample).temperature == 1.0
    s.temperature = 0.7
    assert new.loads(new.dumps(s), TrainSample).temperature == pytest.approx(0.7)
    assert json.loads((default_schemas_dir() / "train_sample" / "v1.avsc").read_text())["name"] == "TrainSample"
