"""`openai` backend against a real HTTP server on 127.0.0.1 that speaks the completions API.

The server here wraps the torch backend (a stand-in for vLLM's OpenAI server, which answers the
same request shape); the client under test only sees HTTP.
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
            if body.get("model") == "broken":
                payload = {"choices": [{"text": "x", "finish_reason": "stop"}]}
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


def test_unreachable_server_is_explained(server) -> None:
    _, model, _ = server
    b = OpenAIBackend("policy", "http://127.0.0.1:1/v1", tokenizer=str(model), timeout_s=2)
    with pytest.raises(OpenAIBackendError, match="failed"):
        asyncio.run(b.generate(GenerateRequest([1, 2], 4)))
