"""The interface every inference backend implements: token ids in, sampled ids and logprobs out.

Backends are asynchronous (many rollouts share one backend and it batches them), load models
from local paths only, and accept new weights while serving: an update is applied between two
decoding steps, and every generated token records the policy version that produced it.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Protocol

import numpy as np


@dataclass(slots=True)
class GenerateRequest:
    """One model call of one rollout."""

    prompt_ids: list[int]  # the whole context so far (prompt, earlier turns, tool results)
    max_tokens: int  # new tokens at most
    temperature: float = 1.0  # 0 = greedy
    top_p: float = 1.0  # nucleus mass
    stop: list[str] = field(default_factory=list)  # stop strings, included in the output when hit


@dataclass(slots=True)
class Generation:
    """What a backend returns for one request."""

    token_ids: np.ndarray  # int32 sampled ids (stop string / eos included)
    logprobs: np.ndarray  # float32 log-prob of each sampled id under the sampling distribution
    versions: np.ndarray  # int32 policy version that produced each token
    text: str  # decoded new text
    finish_reason: str  # "stop" (eos or stop string) | "length"


def model_context_length(model_dir: str | Path) -> int | None:
    """The longest sequence (prompt + new tokens) the model in `model_dir` takes, from its
    `config.json` (`max_position_embeddings`, `n_positions` or `max_sequence_length`); None when
    the directory says nothing."""
    try:
        cfg = json.loads((Path(model_dir) / "config.json").read_text())
    except (OSError, ValueError):
        return None
    for key in ("max_position_embeddings", "n_positions", "max_sequence_length"):
        value = cfg.get(key) if isinstance(cfg, dict) else None
        if isinstance(value, int) and not isinstance(value, bool) and value > 0:
            return value
    return None


class InferenceBackend(Protocol):
    """A policy's model behind a batching, weight-updatable generation service."""

    name: str  # torch | vllm | openai
    policy: str  # policy it serves
    version: int  # current weights version
    # Optional: `context_length` (int | None), the most tokens of prompt + generation; when a
    # backend has none, its `tokenizer.model_max_length` is used (see `agent_api.session`).

    def encode(self, text: str, *, add_bos: bool = False) -> list[int]: ...

    def decode(self, ids: list[int] | np.ndarray) -> str: ...

    async def generate(self, request: GenerateRequest) -> Generation: ...

    def update_weights(self, state_dict: dict[str, Any], version: int) -> None:
        """Queues new weights; they take effect between two decoding steps."""
        ...

    def hardware(self) -> str: ...

    def close(self) -> None: ...
