"""The pure parts of the vLLM backend, on CPU (the engine itself is GPU-only: tests/integration)."""

from __future__ import annotations

from types import SimpleNamespace

import numpy as np
import pytest

from astraflow.raas.backends.vllm_backend import VllmBackendError, completion_arrays, engine_kwargs

pytestmark = pytest.mark.unit


def test_engine_asks_for_processed_logprobs() -> None:
    kw = engine_kwargs("/m", 0.5, None, None)
    assert kw["logprobs_mode"] == "processed_logprobs" and kw["seed"] == 0 and kw["model"] == "/m"


def test_completion_arrays_take_each_sampled_ids_logprob() -> None:
    lp = SimpleNamespace
    ids, lps = completion_arrays([7, 3], [{7: lp(logprob=-0.25), 9: lp(logprob=-2.0)}, {3: lp(logprob=-1.5)}])
    assert ids.dtype == np.int32 and ids.tolist() == [7, 3]
    assert lps.dtype == np.float32 and lps.tolist() == [-0.25, -1.5]


@pytest.mark.parametrize("steps", [None, [{7: SimpleNamespace(logprob=-0.1)}], [{7: SimpleNamespace(logprob=-0.1)}, {9: SimpleNamespace(logprob=-1.0)}]])
def test_missing_logprobs_are_errors_not_zeros(steps: list | None) -> None:
    with pytest.raises(VllmBackendError):
        completion_arrays([7, 3], steps)


def test_request_checks_refuse_what_the_engine_must_not_see_and_clamp_to_the_context() -> None:
    import math

    from astraflow.raas.backends.base import GenerateRequest
    from astraflow.raas.backends.vllm_support import check_request

    for bad in (GenerateRequest([], 4), GenerateRequest([1] * 512, 4), GenerateRequest([1], 0),
                GenerateRequest([1], 4, math.nan), GenerateRequest([1], 4, math.inf), GenerateRequest([1], 4, -0.5),
                GenerateRequest([1], 4, 1.0, 0.0), GenerateRequest([1], 4, 1.0, 1.01), GenerateRequest([1], 4, 1.0, 1.0, [""])):
        with pytest.raises(VllmBackendError):
            check_request(bad, 512)
    assert check_request(GenerateRequest([1] * 500, 64, 0.0), 512) == 12  # clamped to the context
    assert check_request(GenerateRequest([1] * 10, 64, 0.7, 0.9, ["x"]), 512) == 64


def test_tied_models_are_refused_and_the_layout_comes_from_the_checkpoint(tmp_path) -> None:
    import json

    import torch
    from safetensors.torch import save_file

    from astraflow.raas.backends.vllm_support import checkpoint_layout, model_config, refuse_tied

    (tmp_path / "config.json").write_text(json.dumps({"tie_word_embeddings": True}))
    with pytest.raises(VllmBackendError, match="untied"):
        refuse_tied(str(tmp_path), model_config(str(tmp_path)))
    refuse_tied(str(tmp_path), {"tie_word_embeddings": False})
    save_file({"a.weight": torch.zeros(3, 4), "b": torch.zeros(2, dtype=torch.bfloat16)}, str(tmp_path / "model.safetensors"))
    layout = checkpoint_layout(str(tmp_path))
    assert {k: (m.dtype.name, m.shape) for k, m in layout.tensors.items()} == {"a.weight": ("float32", (3, 4)),
                                                                             "b": ("bfloat16", (2,))}


@pytest.mark.parametrize("mode, t, p, ok", [("processed", 0.7, 0.9, True), ("raw", 1.0, 1.0, True), ("raw", 0.0, 1.0, True),
                                             ("raw", 0.7, 1.0, False), ("raw", 1.0, 0.9, False), ("unknown", 1.3, 1.0, False)])
def test_which_server_logprobs_are_usable(mode: str, t: float, p: float, ok: bool) -> None:
    from astraflow.raas.backends.openai_backend import usable

    assert usable(mode, t, p) is ok
