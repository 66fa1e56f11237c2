"""Unit tests of `TorchBackend.encode`'s memory of recent texts: the ids the tokenizer gives, a
fresh list per call, bounded."""

from __future__ import annotations

from pathlib import Path

import pytest

from astraflow.raas.backends import torch_backend
from astraflow.raas.backends.torch_backend import TorchBackend

pytestmark = pytest.mark.unit


def test_encode_remembers_recent_texts_and_hands_out_fresh_lists(tiny_model_dir: Path, monkeypatch) -> None:
    monkeypatch.setattr(torch_backend, "ENCODED_KEPT", 3)
    monkeypatch.setattr(torch_backend, "ENCODED_MAX_CHARS", 40)
    backend = TorchBackend("policy", str(tiny_model_dir), seed=0, max_batch=2, threads=1)
    try:
        tok = backend.tokenizer
        prompt = "Q: Calculate 1+2.\nA:"
        first = backend.encode(prompt, add_bos=True)
        assert first == tok.encode(prompt, add_special_tokens=True)
        assert backend.encode(prompt) == tok.encode(prompt, add_special_tokens=False) != first  # add_bos is in the key
        first.append(-1)  # a caller may change its list: the next caller gets the ids anyway
        again = backend.encode(prompt, add_bos=True)
        assert again == tok.encode(prompt, add_special_tokens=True) and again is not first
        for i in range(5):
            assert backend.encode(f"Q: {i}", add_bos=True) == tok.encode(f"Q: {i}", add_special_tokens=True)
        assert len(backend._encoded) == 3  # the oldest were let go
        long = "Q: " + "9+" * 30 + "1"
        assert backend.encode(long, add_bos=True) == tok.encode(long, add_special_tokens=True)
        assert (long, True) not in backend._encoded  # longer than ENCODED_MAX_CHARS: not kept
    finally:
        backend.close()
