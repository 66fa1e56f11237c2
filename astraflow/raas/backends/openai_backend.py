"""`openai` backend: any OpenAI-compatible completions server that returns token ids and logprobs.

Requests go to `POST {base_url}/completions` with the prompt as token ids, `logprobs: 1` and
`return_tokens_as_token_ids: true` (vLLM's and SGLang's servers support both), so the sampled
ids and their logprobs come back exactly. The tokenizer (for text <-> ids) is loaded from a local
directory. The server owns its weights: this backend reports the version the operator says the
server runs (`version`), and does not follow the weights topic.
"""

from __future__ import annotations

import asyncio
import json
import re
import urllib.error
import urllib.request
from typing import Any

import numpy as np

from astraflow.errors import AstraflowError
from astraflow.raas.backends.base import GenerateRequest, Generation

_TOKEN_ID = re.compile(r"^token_id:(-?\d+)$")


class OpenAIBackendError(AstraflowError):
    """Raised when the server is unreachable or its answer lacks token ids or logprobs."""


class OpenAIBackend:
    """Client of an OpenAI-compatible server for one policy."""

    name = "openai"

    def __init__(self, policy: str, base_url: str, *, model: str | None = None, tokenizer: str | None = None,
                 api_key: str | None = None, timeout_s: float = 300.0, version: int = 0, concurrency: int = 64) -> None:
        from transformers import AutoTokenizer

        if tokenizer is None:
            raise OpenAIBackendError("the openai backend needs a local tokenizer directory (tokenizer=DIR)")
        self.policy = policy
        self.base_url = base_url.rstrip("/")
        self.model = model or policy
        self.api_key = api_key
        self.timeout_s = timeout_s
        self.version = version
        self.tokenizer = AutoTokenizer.from_pretrained(tokenizer)
        self._sem = asyncio.Semaphore(concurrency)

    def encode(self, text: str, *, add_bos: bool = False) -> list[int]:
        return self.tokenizer.encode(text, add_special_tokens=add_bos)

    def decode(self, ids) -> str:
        return self.tokenizer.decode([int(i) for i in ids], skip_special_tokens=True)

    def hardware(self) -> str:
        return f"remote:{self.base_url}"

    def update_weights(self, state_dict: dict[str, Any], version: int) -> None:
        raise OpenAIBackendError("an OpenAI-compatible server manages its own weights; update them on the server")

    def close(self) -> None:
        pass

    async def generate(self, request: GenerateRequest) -> Generation:
        body = {
            "model": self.model,
            "prompt": request.prompt_ids,
            "max_tokens": request.max_tokens,
            "temperature": request.temperature,
            "top_p": request.top_p,
            "stop": request.stop or None,
            "logprobs": 1,
            "return_tokens_as_token_ids": True,
            "include_stop_str_in_output": True,
        }
        async with self._sem:
            data = await asyncio.to_thread(self._post, "/completions", body)
        return self._parse(data)

    def _post(self, path: str, body: dict[str, Any]) -> dict[str, Any]:
        headers = {"Content-Type": "application/json"}
        if self.api_key:
            headers["Authorization"] = f"Bearer {self.api_key}"
        req = urllib.request.Request(self.base_url + path, json.dumps(body).encode(), headers)
        try:
            with urllib.request.urlopen(req, timeout=self.timeout_s) as resp:
                return json.loads(resp.read())
        except (urllib.error.URLError, TimeoutError, json.JSONDecodeError) as exc:
            raise OpenAIBackendError(f"completions request to {self.base_url} failed: {exc}") from exc

    def _parse(self, data: dict[str, Any]) -> Generation:
        try:
            choice = data["choices"][0]
            lp = choice["logprobs"]
            ids = []
            for tok in lp["tokens"]:
                m = _TOKEN_ID.match(tok)
                if m is None:
                    raise ValueError(f"token {tok!r} is not 'token_id:N'")
                ids.append(int(m.group(1)))
            logprobs = [float(x) if x is not None else 0.0 for x in lp["token_logprobs"]]
        except (KeyError, IndexError, TypeError, ValueError) as exc:
            raise OpenAIBackendError(
                f"server answer lacks token ids/logprobs ({exc}); the server must support logprobs and "
                "return_tokens_as_token_ids (vLLM does)"
            ) from exc
        finish = "length" if choice.get("finish_reason") == "length" else "stop"
        return Generation(np.asarray(ids, np.int32), np.asarray(logprobs, np.float32),
                          np.full(len(ids), self.version, np.int32), self.decode(ids), finish)
