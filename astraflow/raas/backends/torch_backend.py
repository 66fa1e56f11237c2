"""`torch` backend: a transformers causal LM from a local directory, batched decoding with a KV cache.

One engine thread owns the model. Concurrent requests are grouped into waves (up to
`max_batch`), left-padded, prefilled together and decoded step by step with the KV cache.
Weight updates are applied between two decoding steps, so rollouts in flight continue with the
new weights (their earlier tokens keep the version that produced them).

The logprob recorded for each token is its log-probability under the distribution it was
sampled from (`sample_tokens`): `log_softmax(logits / temperature)` renormalised over the top-p
nucleus, i.e. minus the log of the kept mass (plain `log_softmax(logits)` for greedy
decoding). That is the behaviour policy a trainer corrects for; the trainer scores the same
tokens with `log_softmax(logits / temperature)`, the temperature coming with each sample.
"""

from __future__ import annotations

import asyncio
import concurrent.futures as cf
import logging
import queue
import threading
import time
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from astraflow.errors import AstraflowError
from astraflow.raas.backends.base import GenerateRequest, Generation
from astraflow.weights.layout import ModelLayout

log = logging.getLogger("astraflow.raas.torch")


class BackendError(AstraflowError):
    """Raised when a backend cannot load its model or fails while generating."""


@dataclass
class _Pending:
    request: GenerateRequest
    future: cf.Future


class TorchBackend:
    """Serves one policy with transformers + torch (CPU by default, CUDA when present)."""

    name = "torch"

    def __init__(self, policy: str, model_dir: str, *, max_batch: int = 16, device: str | None = None,
                 version: int = 0, seed: int | None = None, threads: int | None = None,
                 batch_wait_s: float = 0.005) -> None:
        from transformers import AutoModelForCausalLM, AutoTokenizer

        self.policy = policy
        self.version = version
        self.device = torch.device(device or ("cuda" if torch.cuda.is_available() else "cpu"))
        if threads:
            torch.set_num_threads(threads)
        try:
            self.tokenizer = AutoTokenizer.from_pretrained(model_dir)
            self.model = AutoModelForCausalLM.from_pretrained(model_dir).to(self.device).eval()
        except (OSError, ValueError) as exc:
            raise BackendError(f"cannot load a causal LM and tokenizer from {model_dir}: {exc}") from exc
        self.max_batch = max_batch
        self.batch_wait_s = batch_wait_s  # how long a wave waits for more requests to batch
        self.pad_id = self.tokenizer.pad_token_id if self.tokenizer.pad_token_id is not None else 0
        self.eos_id = self.tokenizer.eos_token_id
        self._gen = torch.Generator(device="cpu")
        self._gen.manual_seed(seed if seed is not None else int(time.time_ns() % 2**31))
        self._queue: queue.Queue[_Pending | None] = queue.Queue()
        self._update: tuple[dict[str, Any], int] | None = None
        self._update_lock = threading.Lock()
        self.tokens_generated = 0  # tokens of finished requests
        self.decode_steps = 0  # decoding steps run (all waves)
        self._thread = threading.Thread(target=self._engine, name=f"torch-backend-{policy}", daemon=True)
        self._thread.start()

    # ---- public API ----------------------------------------------------------------------------

    def encode(self, text: str, *, add_bos: bool = False) -> list[int]:
        return self.tokenizer.encode(text, add_special_tokens=add_bos)

    def decode(self, ids: list[int] | np.ndarray) -> str:
        return self.tokenizer.decode([int(i) for i in ids], skip_special_tokens=True)

    async def generate(self, request: GenerateRequest) -> Generation:
        fut: cf.Future = cf.Future()
        self._queue.put(_Pending(request, fut))
        return await asyncio.wrap_future(fut)

    def generate_sync(self, request: GenerateRequest) -> Generation:
        fut: cf.Future = cf.Future()
        self._queue.put(_Pending(request, fut))
        return fut.result()

    def update_weights(self, state_dict: dict[str, Any], version: int) -> None:
        with self._update_lock:
            self._update = (state_dict, version)
        if self._queue.empty():  # idle engine: apply now so the next request uses it
            self._queue.put(None)

    def state_dict(self) -> dict[str, torch.Tensor]:
        return {k: v.detach() for k, v in self.model.state_dict().items()}

    def weight_layout(self) -> ModelLayout:
        """Names, shapes and dtypes of the model's tensors: what a weight follower checks payloads against."""
        return ModelLayout.of(self.model.state_dict())

    def hardware(self) -> str:
        if self.device.type == "cuda":
            return f"cuda:{torch.cuda.get_device_name(self.device)}"
        return f"cpu:{torch.get_num_threads()}"

    def close(self) -> None:
        self._queue.put(None)
        self._closed = True

    # ---- engine --------------------------------------------------------------------------------

    _closed = False

    def _apply_update(self) -> None:
        with self._update_lock:
            upd, self._update = self._update, None
        if upd is None:
            return
        sd, version = upd
        params = dict(self.model.named_parameters())
        params.update(dict(self.model.named_buffers()))
        wrong = [n for n, v in sd.items() if n in params and tuple(v.shape) != tuple(params[n].shape)]
        if wrong:  # followers check the layout first; never let a bad update stop the engine
            log.error("version %d not applied: tensors %s do not have the model's shapes", version, wrong[:3])
            return
        with torch.no_grad():
            for name, value in sd.items():
                if name in params:
                    params[name].copy_(torch.as_tensor(value).to(params[name].dtype))
        self.version = version

    def _engine(self) -> None:
        while not self._closed:
            item = self._queue.get()
            self._apply_update()
            if item is None:
                continue
            wave = [item]
            # Rollouts started together reach the queue a few hundred microseconds apart: wait a
            # moment for them so they decode as one batch instead of as a wave of one.
            deadline = time.monotonic() + self.batch_wait_s
            while len(wave) < self.max_batch:
                try:
                    nxt = self._queue.get(timeout=max(0.0, deadline - time.monotonic()))
                except queue.Empty:
                    break
                if nxt is not None:
                    wave.append(nxt)
            try:
                self._run_wave(wave)
            except Exception as exc:  # one bad wave must not kill the engine thread; callers get the error
                for p in wave:
                    if not p.future.done():
                        p.future.set_exception(BackendError(f"generation failed: {exc!r}"))

    @torch.no_grad()
    def _run_wave(self, wave: list[_Pending]) -> None:
        n = len(wave)
        reqs = [p.request for p in wave]
        width = max(len(r.prompt_ids) for r in reqs)
        ids = torch.full((n, width), self.pad_id, dtype=torch.long)
        mask = torch.zeros((n, width), dtype=torch.long)
        for i, r in enumerate(reqs):
            ids[i, width - len(r.prompt_ids) :] = torch.tensor(r.prompt_ids, dtype=torch.long)
            mask[i, width - len(r.prompt_ids) :] = 1
        ids, mask = ids.to(self.device), mask.to(self.device)
        pos = (mask.cumsum(-1) - 1).clamp(min=0)
        out = self.model(input_ids=ids, attention_mask=mask, position_ids=pos, use_cache=True)
        logits, past = out.logits[:, -1, :].float(), out.past_key_values
        new_ids: list[list[int]] = [[] for _ in range(n)]
        new_lp: list[list[float]] = [[] for _ in range(n)]
        new_ver: list[list[int]] = [[] for _ in range(n)]
        done = [False] * n
        reason = ["length"] * n
        max_steps = max(r.max_tokens for r in reqs)
        next_pos = pos[:, -1] + 1
        temps = torch.tensor([r.temperature for r in reqs], device=self.device)
        top_ps = torch.tensor([r.top_p for r in reqs], device=self.device)
        for _step in range(max_steps):
            tokens, lps = self._sample(logits, temps, top_ps)
            version = self.version
            for i in range(n):
                if done[i]:
                    continue
                t = int(tokens[i])
                new_ids[i].append(t)
                new_lp[i].append(float(lps[i]))
                new_ver[i].append(version)
                if t == self.eos_id or self._hit_stop(new_ids[i], reqs[i].stop):
                    done[i], reason[i] = True, "stop"
                elif len(new_ids[i]) >= reqs[i].max_tokens:
                    done[i] = True
                if done[i]:
                    self._finish(wave[i], new_ids[i], new_lp[i], new_ver[i], reason[i])
            self.decode_steps += 1
            if all(done):
                break
            self._apply_update()  # between decoding steps: later tokens use the new version
            step_ids = torch.tensor([[new_ids[i][-1] if not done[i] else self.pad_id] for i in range(n)], device=self.device)
            mask = torch.cat([mask, torch.ones((n, 1), dtype=mask.dtype, device=self.device)], dim=1)
            out = self.model(input_ids=step_ids, attention_mask=mask, position_ids=next_pos[:, None],
                             past_key_values=past, use_cache=True)
            logits, past = out.logits[:, -1, :].float(), out.past_key_values
            next_pos = next_pos + 1

    def _sample(self, logits: torch.Tensor, temps: torch.Tensor, top_ps: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return sample_tokens(logits, temps, top_ps, self._gen)

    def _hit_stop(self, ids: list[int], stops: list[str]) -> bool:
        if not stops:
            return False
        tail = self.tokenizer.decode(ids[-16:], skip_special_tokens=False)
        return any(tail.endswith(s) for s in stops)

    def _finish(self, p: _Pending, ids: list[int], lps: list[float], vers: list[int], reason: str) -> None:
        self.tokens_generated += len(ids)
        gen = Generation(
            np.asarray(ids, dtype=np.int32),
            np.asarray(lps, dtype=np.float32),
            np.asarray(vers, dtype=np.int32),
            self.tokenizer.decode(ids, skip_special_tokens=True),
            reason,
        )
        if not p.future.done():
            p.future.set_result(gen)


def sample_tokens(
    logits: torch.Tensor, temps: torch.Tensor, top_ps: torch.Tensor, generator: torch.Generator | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """One token per row of `logits` [B, V] and its behaviour logprob, both on the CPU.

    Row b samples from ``softmax(logits / temps[b])`` truncated to its top-p nucleus (the
    smallest set of most likely tokens whose mass reaches top_ps[b]) and renormalised; the
    logprob returned is of that distribution (``log_softmax(logits / T) - log(kept mass)``).
    A temperature <= 0 decodes greedily and returns ``log_softmax(logits)`` of the argmax.
    """
    greedy = temps <= 0
    scaled = logits / torch.where(greedy, torch.ones_like(temps), temps)[:, None]
    logp = torch.log_softmax(scaled, dim=-1)
    probs = logp.exp()
    if bool((top_ps < 1.0).any()):
        sorted_p, order = probs.sort(dim=-1, descending=True)
        keep = (sorted_p.cumsum(-1) - sorted_p) < top_ps[:, None]
        kept_mass = (sorted_p * keep).sum(-1)
        sorted_p = sorted_p * keep
        probs = torch.zeros_like(probs).scatter(-1, order, sorted_p)
        nucleus = (top_ps < 1.0) & ~greedy
        logp = logp - torch.where(nucleus, kept_mass.clamp(min=1e-30).log(), torch.zeros_like(kept_mass))[:, None]
    sampled = torch.multinomial(probs.cpu(), 1, generator=generator).squeeze(-1).to(logits.device)
    tokens = torch.where(greedy, logits.argmax(-1), sampled)
    return tokens.cpu(), logp.gather(-1, tokens[:, None].to(logp.device)).squeeze(-1).cpu()
