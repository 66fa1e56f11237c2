"""Helpers shared by the tests: a scripted model backend, a topic reader, a process counter, and
a weights payload with one tensor block replaced.

Importable as `helpers` from every test folder (pytest puts tests/, the folder of conftest.py,
on the import path).
"""

from __future__ import annotations

import os
import time
import uuid
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np

from astraflow.config import KafkaSettings
from astraflow.kafka.clients import RecordConsumer
from astraflow.raas.backends.base import GenerateRequest, Generation
from astraflow.weights.delta import SparseDelta
from astraflow.weights.format import KIND_TENSOR, TensorRecord, frame, unframe


class ScriptedBackend:
    """A fake model with the real tokenizer of `model_dir`: each request's reply is the next text
    of `reply` (a list, replayed in order) or `reply(prompt text)` (a function).

    `per_char`: one token id per character (not how the tokenizer would split the text), so a
    test knows each token; `eos`: the reply ends with the end-of-sequence token. Logprobs:
    `first_logprob` + `logprob_step` x position; every token carries the current `version`.
    The requests and the token ids sampled are kept (`requests`, `sampled`).
    """

    name = "scripted"

    def __init__(self, policy: str, model_dir: Path, reply: list[str] | Callable[[str], str], *, version: int = 3,
                 context_length: int | None = None, per_char: bool = False, eos: bool = False,
                 first_logprob: float = -0.5, logprob_step: float = 0.0) -> None:
        from transformers import AutoTokenizer

        self.policy, self.version = policy, version
        self.script = list(reply) if not callable(reply) else None
        self.brain = reply if callable(reply) else None
        self.tokenizer = self.tok = AutoTokenizer.from_pretrained(model_dir)
        self.context_length = context_length  # tokens of prompt + completion; None: the tokenizer's bound
        self.per_char, self.eos = per_char, eos
        self.first_logprob, self.logprob_step = first_logprob, logprob_step
        self.requests: list[GenerateRequest] = []
        self.sampled: list[list[int]] = []

    def encode(self, text: str, *, add_bos: bool = False) -> list[int]:
        return self.tok.encode(text, add_special_tokens=add_bos)

    def decode(self, ids: Any) -> str:
        return self.tok.decode([int(i) for i in ids], skip_special_tokens=True)

    async def generate(self, request: GenerateRequest) -> Generation:
        self.requests.append(request)
        text = self.brain(self.decode(request.prompt_ids)) if self.brain is not None else self.script.pop(0)
        ids = [t for ch in text for t in self.encode(ch)] if self.per_char else self.encode(text)
        if self.eos:
            ids.append(self.tok.eos_token_id)
        self.sampled.append(ids)
        n = len(ids)
        logprobs = self.first_logprob + self.logprob_step * np.arange(n, dtype=np.float32)
        return Generation(np.asarray(ids, np.int32), logprobs.astype(np.float32), np.full(n, self.version, np.int32),
                          text, "stop")

    def hardware(self) -> str:
        return "test"

    def update_weights(self, state_dict: Any, version: int) -> None:
        self.version = version

    def close(self) -> None:
        pass


def collect(kafka: KafkaSettings, topic: str, expect: type | None, until: Callable[[list], bool], *,
            timeout_s: float = 60.0, on_batch: Callable[[list], None] | None = None) -> list:
    """The records of `topic` (decoded as `expect`) read from its start, in a fresh group, until
    `until(records so far)` or `timeout_s`; `on_batch(records so far)` after each poll."""
    c = RecordConsumer(kafka, f"t-{uuid.uuid4().hex}", [topic], component="test", dlq=None, expect=expect)
    out: list = []
    deadline = time.monotonic() + timeout_s
    try:
        while not until(out) and time.monotonic() < deadline:
            out.extend(r.record for r in c.poll_batch(500, 0.5))
            if on_batch is not None:
                on_batch(out)
    finally:
        c.close()
    return out


def processes_with(marker: str) -> int:
    """Processes on this machine whose command line contains `marker`."""
    n = 0
    for pid in os.listdir("/proc"):
        if pid.isdigit():
            try:
                n += marker.encode() in Path(f"/proc/{pid}/cmdline").read_bytes()
            except OSError:
                continue
    return n


def replace_tensor(payload: bytes, name: str, body: bytes) -> bytes:
    """The weights payload with tensor `name`'s block replaced by a block of `body` (crc32 recomputed)."""
    blocks = list(SparseDelta.from_bytes(payload).blocks)
    for i, b in enumerate(blocks):
        kind, got = unframe(b)
        if kind == KIND_TENSOR and TensorRecord.parse(got).name == name:
            blocks[i] = frame(KIND_TENSOR, body)
    return b"".join(blocks)


# ---- the GSM8K recipe's files (examples/gsm8k), read the way compose reads them ----------------

RECIPE_DIR = Path(__file__).resolve().parents[1] / "examples" / "gsm8k"


def recipe_env(**overrides: str) -> dict[str, str]:
    """The recipe's compose variables (gsm8k.env), with `overrides`."""
    lines = (RECIPE_DIR / "gsm8k.env").read_text().splitlines()
    env = dict(line.split("=", 1) for line in lines if line.strip() and not line.startswith("#"))
    return {**env, **overrides}


def recipe_commands(env: dict[str, str] | None = None) -> dict[str, list[str]]:
    """Each service's command in the recipe's compose file, `${NAME:-default}` resolved with `env`
    (default: `recipe_env()`)."""
    import re

    import yaml

    values = recipe_env() if env is None else env
    services = yaml.safe_load((RECIPE_DIR / "docker-compose.gsm8k.yaml").read_text())["services"]
    return {name: [re.sub(r"\$\{(\w+):-([^}]*)\}", lambda m: values.get(m.group(1), m.group(2)), a) for a in svc["command"]]
            for name, svc in services.items() if "command" in svc}
