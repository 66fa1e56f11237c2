"""The interface every inference backend implements: token ids in, sampled ids and logprobs out.

Backends are asynchronous (many rollouts share one backend and it batches them), load models
from local paths only, and accept new weights while serving: an update is applied between two
decoding steps, and every generated token records the policy version that produced it.
"""

from __future__ import annotations

from dataclasses import dataclass, field
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


class InferenceBackend(Protocol):
    """A policy's model behind a batching, weight-updatable generation service."""

    name: str  # torch | vllm | openai
    policy: str  # policy it serves
    version: int  # current weights version

    def encode(self, text: str, *, add_bos: bool = False) -> list[int]: ...

    def decode(self, ids: list[int] | np.ndarray) -> str: ...

    async def generate(self, request: GenerateRequest) -> Generation: ...

    def update_weights(self, state_dict: dict[str, Any], version: int) -> None:
        """Queues new weights; they take effect between two decoding steps."""
        ...

    def hardware(self) -> str: ...

    def close(self) -> None: ...
