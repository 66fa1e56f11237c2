"""The `openai` backend against vLLM's own OpenAI server (its CPU build in CI).

The server runs as `python -m vllm.entrypoints.openai.api_server --logprobs-mode
processed_logprobs` on 127.0.0.1; the backend probes it at start (it must find processed
logprobs), and the logprobs it records at temperature 0.7 and top-p 0.9 agree with the trainer's
recomputation on the same tokens (renormalised over the nucleus, as the node records them).
"""

from __future__ import annotations

import asyncio
import os
import socket
import subprocess
import sys
import time
import urllib.request
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest

from astraflow.raas.backends.base import GenerateRequest
from astraflow.raas.backends.openai_backend import OpenAIBackend

LOGPROB_TOL = 1e-3  # as tests/vllm/test_vllm_engine.py


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def vllm_server(untied_model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    port = _free_port()
    log = tmp_path_factory.mktemp("vllm-server") / "server.log"
    env = {**os.environ, "VLLM_CPU_KVCACHE_SPACE": os.environ.get("VLLM_CPU_KVCACHE_SPACE", "1")}
    with open(log, "w") as out:
        proc = subprocess.Popen(
            [sys.executable, "-m", "vllm.entrypoints.openai.api_server", "--model", str(untied_model_dir),
             "--served-model-name", "policy", "--host", "127.0.0.1", "--port", str(port), "--max-model-len", "512",
             "--enforce-eager", "--dtype", "float32", "--logprobs-mode", "processed_logprobs", "--seed", "0"],
            stdout=out, stderr=subprocess.STDOUT, env=env, start_new_session=True)
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 240
        while True:
            try:
                with urllib.request.urlopen(url + "/health", timeout=2) as r:
                    if r.status == 200:
                        break
            except OSError:
                pass
            if proc.poll() is not None or time.monotonic() > deadline:
                pytest.fail(f"vLLM's server did not start:\n{log.read_text()[-3000:]}")
            time.sleep(1)
        yield url + "/v1"
    finally:
        proc.terminate()
        try:
            proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


def test_processed_logprobs_from_vllms_server_match_the_trainer(vllm_server: str, untied_model_dir: Path) -> None:
    import torch

    from astraflow.models.tiny import load_tiny
    from astraflow.rl.logprobs import sequence_logprobs

    b = OpenAIBackend("policy", vllm_server, tokenizer=str(untied_model_dir), temperature=0.7, top_p=0.9)
    assert b.logprobs_mode == "processed"
    prompt = b.encode("Q: What is 4+4?\nA:", add_bos=True)

    async def many():
        return await asyncio.gather(*(b.generate(GenerateRequest(prompt, 20, 0.7, 0.9)) for _ in range(4)))

    gens = asyncio.run(many())
    model = load_tiny(untied_model_dir)[0]
    worst = 0.0
    for g in gens:
        assert len(g.token_ids) == len(g.logprobs) > 0 and np.isfinite(g.logprobs).all()
        ids = torch.tensor([prompt + g.token_ids.tolist()])
        with torch.no_grad():
            logits = model(ids).logits.float()
        lp = sequence_logprobs(logits, ids, torch.tensor([0.7]))[0, len(prompt):]
        probs = torch.softmax(logits[0, len(prompt) - 1:-1] / 0.7, -1)
        sorted_p, _ = probs.sort(-1, descending=True)
        kept = (sorted_p * ((sorted_p.cumsum(-1) - sorted_p) < 0.9)).sum(-1)
        worst = max(worst, float(np.abs(g.logprobs - (lp - kept.log()).numpy()).max()))
    print(f"largest |server logprob - trainer recomputation|: {worst:.2e}")
    assert worst < LOGPROB_TOL
