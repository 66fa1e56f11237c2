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
