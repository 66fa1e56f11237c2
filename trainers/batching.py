"""Batches of TrainSamples: when a batch is full (`BatchLimits`) and its padded tensors (`collate`).

Pure: no Kafka, no model. `trainers.data.TrainStream` closes its batches with these; the
LightningModule (`trainers.module`) trains on what `collate` returns.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import torch

from astraflow.records import TrainSample


@dataclass(frozen=True)
class BatchLimits:
    """When a batch is full."""

    batch_size: int = 32  # most samples
    token_budget: int | None = None  # most padded tokens (samples x longest); None: unlimited

    def fits(self, n: int, longest: int, length: int) -> bool:
        """Whether a sample of `length` tokens fits a batch of `n` samples whose longest has `longest`."""
        if n >= self.batch_size:
            return False
        if self.token_budget is None or n == 0:  # an oversized sample forms a batch on its own
            return True
        return (n + 1) * max(longest, length) <= self.token_budget


def collate(samples: Sequence[TrainSample], pad_id: int = 0) -> dict[str, torch.Tensor]:
    """Right-padded tensors of a batch: input_ids / attention_mask / loss_mask / behaviour_logprobs
    / versions (int64, -1 where not trained) [B, T], advantages / rewards / temperatures [B] float32,
    min_versions [B] int64. Position 0 is never trained (it has no context), padding never is."""
    b, t = len(samples), max(len(s.token_ids) for s in samples)
    ids = np.full((b, t), pad_id, np.int64)
    attn = np.zeros((b, t), np.int64)
    mask = np.zeros((b, t), np.bool_)
    blp = np.zeros((b, t), np.float32)
    vers = np.full((b, t), -1, np.int64)
    for i, s in enumerate(samples):
        n = len(s.token_ids)
        ids[i, :n] = s.token_ids
        attn[i, :n] = 1
        mask[i, :n] = s.loss_mask.astype(bool)
        blp[i, :n] = s.behaviour_logprobs
        vers[i, :n] = s.versions
    mask[:, 0] = False
    return {
        "input_ids": torch.from_numpy(ids),
        "attention_mask": torch.from_numpy(attn),
        "loss_mask": torch.from_numpy(mask),
        "behaviour_logprobs": torch.from_numpy(blp),
        "versions": torch.from_numpy(vers),
        "advantages": torch.tensor([s.advantage for s in samples], dtype=torch.float32),
        "rewards": torch.tensor([s.reward for s in samples], dtype=torch.float32),
        "temperatures": torch.tensor([s.temperature for s in samples], dtype=torch.float32),
        "min_versions": torch.tensor([s.min_version for s in samples], dtype=torch.int64),
    }


def minibatch_rows(n: int, minibatches: int) -> list[list[int]]:
    """The rows of each optimizer step of a batch of `n` samples: `minibatches` consecutive runs
    whose sizes differ by at most one (fewer when n < minibatches: no empty step)."""
    if minibatches < 1:
        raise ValueError(f"minibatches must be >= 1, got {minibatches}")
    base, extra = divmod(n, minibatches)
    out, start = [], 0
    for k in range(minibatches):
        size = base + (1 if k < extra else 0)
        if size:
            out.append(list(range(start, start + size)))
        start += size
    return out


def rank_rows(n: int, minibatches: int, world: int, rank: int) -> list[list[int]]:
    """The rows of a batch of `n` samples that data-parallel `rank` of `world` trains, per
    optimizer step: each step's rows (`minibatch_rows`, the same at any world size) dealt round
    robin over the ranks. So every step trains the same samples whatever the number of ranks;
    with n >= world x minibatches every rank has a row in every step (the stream waits for that
    many samples), which keeps the ranks' collectives in step."""
    if not 0 <= rank < world:
        raise ValueError(f"rank {rank} is not in a world of {world}")
    return [part[rank::world] for part in minibatch_rows(n, minibatches)]


def length_chunks(lengths: Sequence[int], max_chunks: int = 4, chunk_cost: int = 32) -> list[list[int]]:
    """The rows of a batch in at most `max_chunks` groups of similar length, each run through the
    model padded only to its own longest row: the split of the rows sorted by length that costs the
    fewest padded tokens (rows x longest, summed), plus `chunk_cost` tokens for each extra model
    call. Returns row indices, shortest rows first; every row is in exactly one chunk."""
    if max_chunks < 1:
        raise ValueError(f"max_chunks must be >= 1, got {max_chunks}")
    order = sorted(range(len(lengths)), key=lambda i: (lengths[i], i))
    n = len(order)
    if n == 0:
        return []
    sl = [int(lengths[i]) for i in order]
    inf = float("inf")
    # best[k][j]: cost of the first j sorted rows in k chunks; cut[k][j]: where its last chunk starts.
    best = [[inf] * (n + 1) for _ in range(max_chunks + 1)]
    cut = [[0] * (n + 1) for _ in range(max_chunks + 1)]
    best[0][0] = 0.0
    for k in range(1, max_chunks + 1):
        for j in range(1, n + 1):
            for i in range(k - 1, j):
                cost = best[k - 1][i] + (j - i) * sl[j - 1] + chunk_cost
                if cost < best[k][j]:
                    best[k][j], cut[k][j] = cost, i
    k = min(range(1, max_chunks + 1), key=lambda c: best[c][n])
    chunks, j = [], n
    while k > 0:
        i = cut[k][j]
        chunks.append(order[i:j])
        j, k = i, k - 1
    return chunks[::-1]
