"""What a trainer accepts from its train topic: validation of TrainSamples and the sample-id window.

Every TrainSample is untrusted (many machines write the train topic). `sample_problem` checks
one decoded sample against `SampleLimits` (the model's vocabulary, the longest sequence the
trainer trains, bounds on advantages and logprobs, consistent array lengths, 0/1 masks,
versions no newer than the trainer has published) and names the first field that breaks a
limit, with the limit, so the dead letter says what to fix. Nothing here touches Kafka or torch.

`SampleWindow` remembers the ids of the most recently trained samples (bounded by count), so
that a sample id delivered twice (an upstream retry, a replay) is dropped instead of trained
twice. Its content goes into every trainer checkpoint.
"""

from __future__ import annotations

import collections
import re
from collections.abc import Iterable
from dataclasses import dataclass

import numpy as np

from astraflow.errors import RLError
from astraflow.records import TrainSample

MAX_ID_CHARS = 512  # longest sample_id kept in the window (and so in checkpoints)
_CONTROL = re.compile(r"[\x00-\x1f\x7f]")  # never in a sample id: the window is stored newline-joined
LOGPROB_SLACK = 1e-3  # logprobs are <= 0; float noise of an inference engine may exceed 0 slightly


@dataclass(frozen=True)
class SampleLimits:
    """What a trainer accepts; every sample outside these limits is dead-lettered."""

    policy: str  # samples of other policies are refused
    vocab_size: int  # token ids must be in [0, vocab_size): rows of the model's embedding
    max_len: int  # most tokens in one sample
    max_abs_advantage: float = 100.0  # |advantage| bound (GRPO-normalised advantages are small)
    min_logprob: float = -1000.0  # behaviour logprobs of trained tokens lie in [min_logprob, 0]
    max_abs_reward: float = 1e6  # the reward is reported in metrics only, but must be a number
    max_staleness: int | None = None  # most versions the oldest trained token may lag the newest published
    max_temperature: float = 100.0  # sampling temperatures of trained samples lie in (0, max_temperature]


def sample_problem(s: TrainSample, limits: SampleLimits, newest_version: int | None = None) -> str | None:
    """Why `s` cannot be trained (field, value and limit), or None when it can.

    `newest_version`: the newest version the trainer has published; a trained token that claims
    a newer version is a lie (None skips that check, e.g. before the first publication).
    """
    n = len(s.token_ids)
    if s.policy != limits.policy:
        return f"policy: sample is for {s.policy!r}, this trainer trains {limits.policy!r}"
    if not s.sample_id or len(s.sample_id) > MAX_ID_CHARS:
        return f"sample_id: length {len(s.sample_id)} is not in [1, {MAX_ID_CHARS}]"
    if _CONTROL.search(s.sample_id):
        return "sample_id: contains a control character"
    if n < 2:
        return f"token_ids: {n} tokens, a sample needs at least 2"
    if n > limits.max_len:
        return f"token_ids: {n} tokens exceed trainer.max_seq_len={limits.max_len}"
    lengths = {"loss_mask": len(s.loss_mask), "behaviour_logprobs": len(s.behaviour_logprobs), "versions": len(s.versions)}
    wrong = {k: v for k, v in lengths.items() if v != n}
    if wrong:
        return f"array lengths: token_ids has {n}, " + ", ".join(f"{k} has {v}" for k, v in wrong.items())
    lo, hi = int(s.token_ids.min()), int(s.token_ids.max())
    if lo < 0 or hi >= limits.vocab_size:
        bad = lo if lo < 0 else hi
        return f"token_ids: id {bad} is outside the vocabulary [0, {limits.vocab_size})"
    if int(s.loss_mask.max()) > 1:
        return f"loss_mask: value {int(s.loss_mask.max())} is not 0 or 1"
    on = s.loss_mask.astype(bool)  # tokens this policy generated (curate's mask)
    if not on[1:].any():  # position 0 has no context and is never trained
        return "loss_mask: no trained token after position 0"
    if not np.isfinite(s.advantage) or abs(s.advantage) > limits.max_abs_advantage:
        return f"advantage: {s.advantage} is not finite or |advantage| > trainer.max_abs_advantage={limits.max_abs_advantage}"
    if not np.isfinite(s.reward) or abs(s.reward) > limits.max_abs_reward:
        return f"reward: {s.reward} is not finite or |reward| > {limits.max_abs_reward}"
    blp = s.behaviour_logprobs
    finite = np.isfinite(blp)
    if not finite.all():
        i = int(np.argmin(finite))
        return f"behaviour_logprobs: position {i} is {blp[i]} (not finite)"
    lp = blp[on]
    if lp.min() < limits.min_logprob or lp.max() > LOGPROB_SLACK:
        bad = float(lp.min() if lp.min() < limits.min_logprob else lp.max())
        return f"behaviour_logprobs: {bad} of a trained token is outside [trainer.min_behaviour_logprob={limits.min_logprob}, 0]"
    versions = s.versions[on]
    if int(versions.min()) < 0:
        return f"versions: a trained token has version {int(versions.min())} (< 0)"
    if newest_version is not None and int(versions.max()) > newest_version:
        return f"versions: a trained token claims version {int(versions.max())}, newer than the newest published ({newest_version})"
    if s.min_version != int(versions.min()):
        return f"min_version: {s.min_version} differs from the oldest version of its trained tokens ({int(versions.min())})"
    t = s.temperature
    if not np.isfinite(t) or not 0.0 < t <= limits.max_temperature:
        return (f"temperature: {t} is not in (0, {limits.max_temperature}] (greedy samples carry no sampling "
                "probability to correct for: sample with temperature > 0 to train)")
    if limits.max_staleness is not None and newest_version is not None and newest_version - s.min_version > limits.max_staleness:
        return (f"stale: its oldest trained token is {newest_version - s.min_version} versions behind the newest "
                f"published ({newest_version}), more than trainer.max_staleness={limits.max_staleness}")
    return None


class SampleWindow:
    """The ids of the last `capacity` samples trained, oldest first; see the module docstring.

    Memory and checkpoint size are bounded by `capacity` ids (each at most MAX_ID_CHARS). A
    duplicate that arrives more than `capacity` trained samples after its first copy is no
    longer recognised.
    """

    def __init__(self, capacity: int, ids: Iterable[str] = ()) -> None:
        if capacity < 1:
            raise ValueError("a sample window needs a capacity of at least 1")
        self.capacity = capacity
        self._ids: collections.OrderedDict[str, None] = collections.OrderedDict()
        self.extend(ids)

    def __contains__(self, sample_id: object) -> bool:
        return sample_id in self._ids

    def __len__(self) -> int:
        return len(self._ids)

    def extend(self, ids: Iterable[str]) -> None:
        """Remember `ids` as trained (the oldest are forgotten beyond `capacity`)."""
        for i in ids:
            self._ids[i] = None
            self._ids.move_to_end(i)
        while len(self._ids) > self.capacity:
            self._ids.popitem(last=False)

    def to_list(self) -> list[str]:
        """The ids, oldest first."""
        return list(self._ids)

    def dumps(self) -> str:
        """The ids newline-joined, oldest first: what a checkpoint stores (one string pickles in
        milliseconds; a list of 100,000 strings takes ~10x longer). Ids hold no control characters."""
        return "\n".join(self._ids)

    @classmethod
    def loads(cls, capacity: int, text: str) -> SampleWindow:
        """The window `dumps` wrote."""
        return cls(capacity, text.split("\n") if text else [])


class InvalidSampleError(RLError):
    """Raised (and dead-lettered with the record) when a TrainSample breaks a `SampleLimits`
    limit; the message names the field and the limit."""


class DuplicateSampleError(InvalidSampleError):
    """Raised (and dead-lettered) when a TrainSample repeats the id of a sample already trained
    (within the trainer's `dedup_window`)."""


class NonFiniteStepError(RLError):
    """Raised (and dead-lettered with each sample of the batch) when an optimizer step is skipped
    because its loss or gradients are not finite."""
