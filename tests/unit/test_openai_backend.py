"""`openai` backend against a real HTTP server on 127.0.0.1 that speaks the completions API.

The server here wraps the torch backend (a stand-in for vLLM's OpenAI server, which answers the
same request shape); the client under test only sees HTTP. It answers the backend's start-up probe
(top logprobs of one next token) with processed logprobs, or with raw ones for the model named
"raw" (what vLLM's server returns without `--logprobs-mode processed_logprobs`).
tests/vllm/test_vllm_openai_server.py runs the backend against vLLM's own server.
"""

from __future__ import annotations

import asyncio
import json
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import numpy as np
import pytest

from astraflow.raas.backends.base import GenerateRequest
from astraflow.raas.backends.openai_backend import OpenAIBackend, OpenAIBackendError


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory):
    from astraflow.models.tiny import init_tiny
    from astraflow.raas.backends.torch_backend import TorchBackend

    model = init_tiny(tmp_path_factory.mktemp("tiny"), seed=0)
    engine = TorchBackend("policy", str(model), seed=0)
    seen: list[dict] = []

    class Handler(BaseHTTPRequestHandler):
        def do_POST(self) -> None:
            body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
            seen.append(body)
            if body.get("logprobs") == 5:  # the start-up probe: top logprobs of the next token
                import torch

                with torch.no_grad():
                    logits = engine.model(torch.tensor([body["prompt"]])).logits[0, -1].float()
                t = 1.0 if body.get("model") == "raw" else body["temperature"]
                top = torch.log_softmax(logits / t, -1).topk(5)
                payload = {"choices": [{"text": "", "finish_reason": "length", "logprobs": {
                    "tokens": [f"token_id:{int(top.indices[0])}"], "token_logprobs": [float(top.values[0])],
                    "top_logprobs": [{f"token_id:{int(i)}": float(v) for v, i in zip(top.values, top.indices, strict=True)}]}}]}
            elif body.get("model") == "broken":
                payload = {"choices": [{"text": "x", "finish_reason": "stop"}]}
            elif body.get("model") == "holes":
                payload = {"choices": [{"text": "ab", "finish_reason": "stop", "logprobs": {
                    "tokens": ["token_id:5", "token_id:6"], "token_logprobs": [-0.5, None]}}]}
            else:
                g = engine.generate_sync(GenerateRequest(body["prompt"], body["max_tokens"], body["temperature"],
                                                         body["top_p"], body["stop"] or []))
                payload = {"choices": [{"text": g.text, "finish_reason": g.finish_reason,
                                        "logprobs": {"tokens": [f"token_id:{t}" for t in g.token_ids],
                                                     "token_logprobs": g.logprobs.tolist()}}]}
            data = json.dumps(payload).encode()
            self.send_response(200)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(data)))
            self.end_headers()
            self.wfile.write(data)

        def log_message(self, *args) -> None:
            pass

    httpd = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    t = threading.Thread(target=httpd.serve_forever, daemon=True)
    t.start()
    yield f"http://127.0.0.1:{httpd.server_address[1]}/v1", Path(model), seen
    httpd.shutdown()
    httpd.server_close()
    t.join()
    engine.close()


def test_ids_and_logprobs_come_back(server) -> None:
    url, model, seen = server
    b = OpenAIBackend("policy", url, tokenizer=str(model), version=4)
    prompt = b.encode("Q: What is 2+3?\nA:", add_bos=True)
    gen = asyncio.run(b.generate(GenerateRequest(prompt, 10, 1.0, 0.9, ["</calc>"])))
    assert 0 < len(gen.token_ids) <= 10 and len(gen.logprobs) == len(gen.token_ids)
    assert (gen.versions == 4).all() and np.all(gen.logprobs <= 0)
    assert seen[-1]["prompt"] == prompt and seen[-1]["logprobs"] == 1 and seen[-1]["return_tokens_as_token_ids"]


def test_server_without_token_ids_is_explained(server) -> None:
    url, model, _ = server
    b = OpenAIBackend("policy", url, model="broken", tokenizer=str(model))
    with pytest.raises(OpenAIBackendError, match="return_tokens_as_token_ids"):
        asyncio.run(b.generate(GenerateRequest([1, 2], 4)))


def test_a_missing_logprob_fails_the_request_instead_of_becoming_zero(server) -> None:
    url, model, _ = server
    b = OpenAIBackend("policy", url, model="holes", tokenizer=str(model))
    with pytest.raises(OpenAIBackendError, match="logprobs"):
        asyncio.run(b.generate(GenerateRequest([1, 2], 4)))


def test_raw_logprobs_refuse_a_start_with_temperature_and_fail_such_requests(server) -> None:
    url, model, _ = server
    assert OpenAIBackend("policy", url, tokenizer=str(model)).logprobs_mode == "processed"
    with pytest.raises(OpenAIBackendError, match="--logprobs-mode processed_logprobs"):
        OpenAIBackend("policy", url, model="raw", tokenizer=str(model), temperature=0.7)
    with pytest.raises(OpenAIBackendError, match="--logprobs-mode processed_logprobs"):
        OpenAIBackend("policy", url, model="raw", tokenizer=str(model), top_p=0.9)
    b = OpenAIBackend("policy", url, model="raw", tokenizer=str(model))  # T=1, top_p=1: raw ones are right
    assert b.logprobs_mode == "raw"
    with pytest.raises(OpenAIBackendError, match="temperature=0.7"):
        asyncio.run(b.generate(GenerateRequest([1, 2], 4, 0.7)))
    assert len(asyncio.run(b.generate(GenerateRequest([1, 2], 4, 1.0))).token_ids) > 0


def test_unreachable_server_is_explained(server) -> None:
    _, model, _ = server
    with pytest.raises(OpenAIBackendError, match="failed"):
        OpenAIBackend("policy", "http://127.0.0.1:1/v1", tokenizer=str(model), timeout_s=2)
