"""`openai` backend: any OpenAI-compatible completions server that returns token ids and logprobs.

Requests go to `POST {base_url}/completions` with the prompt as token ids, `logprobs: 1` and
`return_tokens_as_token_ids: true` (vLLM's and SGLang's servers support both), so the sampled
ids and their logprobs come back exactly. The tokenizer (for text <-> ids) is loaded from a local
directory. The server owns its weights: this backend reports the version the operator says the
server runs (`version`), and does not follow the weights topic.

Which log-probabilities: the trainer needs each token's logprob under the distribution it was
sampled from (after temperature and top-p). A server cannot be asked for those per request;
vLLM's server returns them when started with `--logprobs-mode processed_logprobs` and otherwise
returns the raw model's, identical at every temperature. So at start the backend probes the
server (`probe_logprobs_mode`: the top logprobs of one next token at temperature 1 and 0.5; equal
means raw) and refuses to start when the logprobs would be wrong for the sampling settings the
node serves (`temperature`, `top_p`); a request whose settings need processed logprobs from a
raw server fails (an ERROR trajectory). A missing or impossible logprob in an answer fails the
request too: a made-up value would claim a probability to the trainer.
"""

from __future__ import annotations

import asyncio
import json
import math
import re
import urllib.error
import urllib.request
from typing import Any

import numpy as np

from astraflow.errors import AstraflowError
from astraflow.raas.backends.base import GenerateRequest, Generation

_TOKEN_ID = re.compile(r"^token_id:(-?\d+)$")
PROBE_TEMPERATURE = 0.5  # probed against 1.0: processed logprobs differ, raw ones do not


class OpenAIBackendError(AstraflowError):
    """Raised when the server is unreachable or its answer lacks token ids or logprobs."""


class OpenAIBackend:
    """Client of an OpenAI-compatible server for one policy."""

    name = "openai"

    def __init__(self, policy: str, base_url: str, *, model: str | None = None, tokenizer: str | None = None,
                 api_key: str | None = None, timeout_s: float = 300.0, version: int = 0, concurrency: int = 64,
                 temperature: float = 1.0, top_p: float = 1.0) -> None:
        """`temperature`, `top_p`: the sampling settings the node serves (its tasks'); the server is
        probed and the start refused when its logprobs would be wrong for them
        (`OpenAIBackendError`, saying what to change)."""
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
        self.logprobs_mode = self.probe_logprobs_mode()  # processed | raw | unknown (the server said too little)
        if not usable(self.logprobs_mode, temperature, top_p):
            raise OpenAIBackendError(
                    f"the server at {self.base_url} returns {self.logprobs_mode} log-probabilities, not the ones of the "
                    f"distribution tokens are sampled from at temperature={temperature}, top_p={top_p}: the trainer's "
                    "importance weights would be wrong. Start vLLM's server with `--logprobs-mode processed_logprobs` "
                    "(python -m vllm.entrypoints.openai.api_server ...), or serve temperature 1 and top_p 1 only")

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

    def probe_logprobs_mode(self) -> str:
        """"processed" when the server's logprobs depend on the temperature (vLLM with
        `--logprobs-mode processed_logprobs`), "raw" when they do not, "unknown" when its answer
        has no top logprobs to compare."""
        prompt = self.encode("Q: What is 1+1?\nA:", add_bos=True)
        tops = []
        for t in (1.0, PROBE_TEMPERATURE):
            body = {"model": self.model, "prompt": prompt, "max_tokens": 1, "temperature": t, "top_p": 1.0,
                    "logprobs": 5, "return_tokens_as_token_ids": True, "seed": 0}
            try:
                top = self._post("/completions", body)["choices"][0]["logprobs"]["top_logprobs"][0]
                tops.append({k: float(v) for k, v in top.items()})
            except (KeyError, IndexError, TypeError, ValueError):
                return "unknown"
        common = set(tops[0]) & set(tops[1])
        if not common:
            return "unknown"
        return "processed" if any(abs(tops[0][k] - tops[1][k]) > 1e-4 for k in common) else "raw"

    async def generate(self, request: GenerateRequest) -> Generation:
        if not usable(self.logprobs_mode, request.temperature, request.top_p):
            raise OpenAIBackendError(
                f"the server returns {self.logprobs_mode} log-probabilities, wrong for temperature="
                f"{request.temperature}, top_p={request.top_p}; start it with --logprobs-mode processed_logprobs")
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
            logprobs = [float(x) for x in lp["token_logprobs"]]  # None (missing) raises: never a made-up 0
            if len(logprobs) != len(ids):
                raise ValueError(f"{len(logprobs)} logprobs for {len(ids)} tokens")
            bad = [x for x in logprobs if not math.isfinite(x) or x > 1e-4]
            if bad:
                raise ValueError(f"impossible logprob {bad[0]} for a sampled token")
        except (KeyError, IndexError, TypeError, ValueError) as exc:
            raise OpenAIBackendError(
                f"server answer lacks token ids/logprobs ({exc}); the server must support logprobs and "
                "return_tokens_as_token_ids (vLLM does)"
            ) from exc
        finish = "length" if choice.get("finish_reason") == "length" else "stop"
        return Generation(np.asarray(ids, np.int32), np.asarray(logprobs, np.float32),
                          np.full(len(ids), self.version, np.int32), self.decode(ids), finish)


def usable(mode: str, temperature: float, top_p: float) -> bool:
    """Whether a server whose logprobs are of kind `mode` gives the sampling distribution's logprobs
    at these settings: processed ones always; raw (or unknown) ones only where sampling does not
    change the distribution (temperature 1 or greedy, top_p 1)."""
    return mode == "processed" or (temperature in (0.0, 1.0) and top_p >= 1.0)
