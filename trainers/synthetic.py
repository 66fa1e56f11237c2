"""A synthetic RL task with a fixed reward, for trainer tests, demos and smoke runs.

The policy samples a few tokens after a random prompt; the reward is the fraction of sampled
tokens that fall in a target set (by default every id divisible by 4, so a random policy
scores about 0.25 and a policy that learned the task scores 1). Groups of samples per prompt
get GRPO advantages from `astraflow.dataflow.advantages`, and everything is packed as the
TrainSamples the curate stage would produce, with the sampling logprobs as behaviour logprobs.
"""

from __future__ import annotations

import uuid
from collections.abc import Callable

import numpy as np
import torch

from astraflow.dataflow.advantages import grpo
from astraflow.records import TrainSample

Targets = Callable[[torch.Tensor], torch.Tensor]  # token ids -> bool mask of rewarded tokens


def every_fourth(ids: torch.Tensor) -> torch.Tensor:
    """The default target set: ids divisible by 4."""
    return ids % 4 == 0


@torch.no_grad()
def sample(
    model: torch.nn.Module, prompts: torch.Tensor, gen_len: int, generator: torch.Generator, low: int = 3
) -> tuple[torch.Tensor, torch.Tensor]:
    """Sample `gen_len` tokens (temperature 1, ids >= `low`: no special tokens) after each prompt
    row; returns (full sequences [N, P+L], logprobs of the sampled tokens [N, L])."""
    was_training = model.training
    model.eval()
    seq = prompts.clone()
    logps = []
    for _ in range(gen_len):
        logits = model(input_ids=seq, use_cache=False).logits[:, -1].float()
        logits[:, :low] = float("-inf")
        logp = torch.log_softmax(logits, dim=-1)
        nxt = torch.multinomial(logp.exp(), 1, generator=generator)
        logps.append(logp.gather(1, nxt))
        seq = torch.cat([seq, nxt], dim=1)
    model.train(was_training)
    return seq, torch.cat(logps, dim=1)


def random_prompts(n: int, length: int, vocab: int, generator: torch.Generator, bos: int = 1) -> torch.Tensor:
    """`n` prompts of `length` random non-special ids after a BOS."""
    body = torch.randint(3, vocab, (n, length), generator=generator)
    return torch.cat([torch.full((n, 1), bos), body], dim=1)


def reward_of(gen: torch.Tensor, targets: Targets = every_fourth) -> torch.Tensor:
    """Fraction of generated tokens in the target set, per row."""
    return targets(gen).float().mean(dim=1)


def make_samples(
    model: torch.nn.Module,
    *,
    prompts: int = 4,
    group_size: int = 8,
    prompt_len: int = 4,
    gen_len: int = 4,
    policy: str = "policy",
    version: int = 0,
    seed: int = 0,
    targets: Targets = every_fourth,
) -> list[TrainSample]:
    """One batch of on-policy TrainSamples: `prompts` groups of `group_size` samples each."""
    g = torch.Generator().manual_seed(seed)
    vocab = model.get_input_embeddings().weight.shape[0]
    ps = random_prompts(prompts, prompt_len, vocab, g).repeat_interleave(group_size, dim=0)
    seq, logps = sample(model, ps, gen_len, g)
    rewards = reward_of(seq[:, ps.shape[1] :], targets).numpy().astype(np.float64)
    groups = np.repeat(np.arange(prompts), group_size)
    adv = grpo(rewards, groups)
    p = ps.shape[1]
    out = []
    run = uuid.uuid4().hex[:8]
    for i in range(seq.shape[0]):
        n = seq.shape[1]
        mask = np.zeros(n, np.uint8)
        mask[p:] = 1
        blp = np.zeros(n, np.float32)
        blp[p:] = logps[i].numpy()
        versions = np.where(mask == 1, version, -1).astype(np.int32)
        gid = f"g-{run}-{seed}-{groups[i]}"
        out.append(
            TrainSample(
                sample_id=f"{gid}-{i % group_size}",
                trajectory_id=f"t-{gid}-{i % group_size}",
                group_id=gid,
                prompt_id=f"p-{seed}-{groups[i]}",
                policy=policy,
                token_ids=seq[i].numpy().astype(np.int32),
                loss_mask=mask,
                behaviour_logprobs=blp,
                versions=versions,
                advantage=float(adv[i]),
                reward=float(rewards[i]),
                min_version=version,
            )
        )
    return out


def mean_reward(
    model: torch.nn.Module, *, n: int = 256, prompt_len: int = 4, gen_len: int = 4, seed: int = 12345,
    targets: Targets = every_fourth,
) -> float:
    """Mean reward of `n` samples on fixed held-out prompts (same seed: comparable before/after)."""
    g = torch.Generator().manual_seed(seed)
    vocab = model.get_input_embeddings().weight.shape[0]
    seq, _ = sample(model, random_prompts(n, prompt_len, vocab, g), gen_len, g)
    return float(reward_of(seq[:, prompt_len + 1 :], targets).mean())
