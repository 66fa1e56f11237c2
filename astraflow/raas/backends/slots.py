"""Continuous batching over a transformers causal LM, with a KV cache kept per row ("slot").

`SlotEngine` owns the model and a `SlotKVCache` (`kv_cache.py`): one cache row per slot, each holding the
keys/values of one token sequence from column 0. Every `step()`:

1. admits waiting requests into free slots (at most `max_batch` rows decode at once);
2. runs ONE forward pass over every active row: a decoding row feeds its last sampled token, an
   admitted row feeds the part of its prompt that is not cached yet (rows are left-aligned into
   a [rows, longest feed] block; a 4-D mask and per-row position ids make each row see exactly
   its own cached columns) (Llama-family models through `decoder.py`'s forward, others
   through transformers');
3. samples one token per row with the row's own temperature and top-p, checks its stop
   conditions (eos, stop strings, max_tokens, the model's context length) and releases a
   finished row's slot at once, so the next step can admit a new request there.

Prefix reuse. A released slot keeps its cache ("retained") until another request needs the
room. A new request starts from the longest cached prefix of its prompt, found in any slot
(active or retained): a retained slot whose tokens the prompt extends (the next turn of a
multi-turn rollout: prompt + its completion + a tool reply) is adopted as it is; otherwise the
prefix columns are copied into a free slot. Requests admitted in the same step with identical
prompts (the n samples of a GRPO group) prefill once: the first is computed and the others
copy its cache and sample their first token from its logits.

Versions. Weights change only between steps (`load_weights`); every token records the version
of the weights whose forward pass computed the distribution it was sampled from. The keys and
values it attended to may be older: those of earlier tokens of the same request, computed
before a switch, are not recomputed (as before this engine). A cached prefix is only reused
while the oldest version among its columns is at least `version - max_cache_lag` (default 0:
a request never starts from keys/values of older weights than a fresh prefill would use; the
cache is then recomputed under the current version). docs/raas.md states the same.
"""

from __future__ import annotations

import collections
import math
import time
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch

from astraflow.errors import AstraflowError
from astraflow.raas.backends.base import GenerateRequest, Generation
from astraflow.raas.backends.decoder import decoder_forward
from astraflow.raas.backends.kv_cache import SlotKVCache
from astraflow.raas.backends.sampling import sample_tokens
from astraflow.weights.layout import ModelLayout

PACKED_MASK_MAX = 1 << 22  # mask entries of a packed forward (tokens x rows x width), 4 MiB of bools


class BackendError(AstraflowError):
    """Raised when a backend cannot load its model, refuses a request, or fails while generating."""


@dataclass
class _Row:
    """One request in the engine."""

    rid: int  # caller's request id
    req: GenerateRequest
    submitted: float  # perf_counter at submit
    slot: int = -1
    feed: list[int] = field(default_factory=list)  # tokens the next forward feeds (uncached prompt, or the last sample)
    leader: _Row | None = None  # same prompt admitted in the same step: copy its cache once it is computed
    ids: list[int] = field(default_factory=list)
    lps: list[float] = field(default_factory=list)
    vers: list[int] = field(default_factory=list)
    first_token_s: float | None = None


@dataclass
class Finished:
    """A request the engine is done with: its Generation, or the error that ended it."""

    rid: int
    generation: Generation | None
    error: str | None = None
    ttft_s: float = 0.0  # submit -> first token


def _common_prefix(a: list[int], b: list[int]) -> int:
    n = min(len(a), len(b))
    if n == 0 or a[0] != b[0]:
        return 0
    if a[:n] == b[:n]:
        return n
    lo, hi = 1, n  # a[:lo] == b[:lo], a[:hi] != b[:hi]
    while hi - lo > 1:
        mid = (lo + hi) // 2
        if a[:mid] == b[:mid]:
            lo = mid
        else:
            hi = mid
    return lo


class SlotEngine:
    """Continuous-batching generation for one model (see the module docstring); not thread-safe:
    one thread calls `submit`, `cancel`, `load_weights` and `step`."""

    def __init__(self, model: Any, tokenizer: Any, *, max_batch: int = 16, cache_slots: int | None = None,
                 seed: int | None = None, version: int = 0, max_cache_lag: int = 0) -> None:
        cfg = model.config
        self.model, self.tokenizer = model, tokenizer
        self.device = next(model.parameters()).device
        self.max_batch = max_batch
        self.slots = max(cache_slots or 2 * max_batch, max_batch)
        self.version = version
        self.max_cache_lag = max_cache_lag
        self.max_len = int(getattr(cfg, "max_position_embeddings", 0) or 1 << 20)
        self.vocab = int(cfg.vocab_size)
        self.eos_id = tokenizer.eos_token_id
        self.pad_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else 0
        self.layer_types = list(getattr(cfg, "layer_types", None) or ["full_attention"] * cfg.num_hidden_layers)
        self.window = getattr(cfg, "sliding_window", None)
        head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
        kv_heads = getattr(cfg, "num_key_value_heads", None) or cfg.num_attention_heads
        self.cache = SlotKVCache(cfg.num_hidden_layers, self.slots, kv_heads, head_dim, model.dtype, self.device)
        self.fast_forward = decoder_forward(model)  # None: transformers' own forward (decoder.py)
        self.slot_tokens: list[list[int]] = [[] for _ in range(self.slots)]  # tokens cached in each slot
        self.slot_version: list[int] = [version] * self.slots  # oldest weights version among its columns
        self.slot_row: list[_Row | None] = [None] * self.slots
        self.slot_used = [0] * self.slots  # step of last use (evict the least recent)
        self.waiting: collections.deque[_Row] = collections.deque()
        self.active: list[_Row] = []
        self.gen = torch.Generator(device="cpu")
        self.gen.manual_seed(seed if seed is not None else int(time.time_ns() % 2**31))
        self.steps = 0  # forward passes run
        self.tokens_generated = 0  # tokens of finished requests
        self.prefill_tokens = 0  # prompt tokens computed
        self.reused_tokens = 0  # prompt tokens taken from a cached prefix instead
        self.rows_sampled = 0  # rows sampled, summed over steps (/ steps: the mean batch)
        self.busy_s = 0.0  # time spent in step() with work to do

    # ---- requests ------------------------------------------------------------------------------

    def submit(self, rid: int, req: GenerateRequest) -> None:
        """Queues a request; raises BackendError (and queues nothing) if it cannot be served."""
        prompt = [int(t) for t in req.prompt_ids]
        if not prompt:
            raise BackendError("empty prompt: a request needs at least one token")
        if min(prompt) < 0 or max(prompt) >= self.vocab:
            raise BackendError(f"prompt has token ids outside this model's vocabulary [0, {self.vocab})")
        if len(prompt) >= self.max_len:
            raise BackendError(f"prompt of {len(prompt)} tokens does not fit the model's {self.max_len}-token context")
        if req.max_tokens < 1:
            raise BackendError(f"max_tokens must be at least 1, got {req.max_tokens}")
        if not (math.isfinite(req.temperature) and req.temperature >= 0):
            raise BackendError(f"temperature must be a finite number >= 0, got {req.temperature}")
        if not (0.0 < req.top_p <= 1.0):
            raise BackendError(f"top_p must be in (0, 1], got {req.top_p}")
        req.prompt_ids = prompt
        self.waiting.append(_Row(rid, req, time.perf_counter()))

    def cancel(self, rid: int) -> None:
        """Drops a request (its caller went away); its slot is free at the next step."""
        self.waiting = collections.deque(r for r in self.waiting if r.rid != rid)
        for row in [r for r in self.active if r.rid == rid]:
            self._release(row)

    def has_work(self) -> bool:
        return bool(self.waiting or self.active)

    def load_weights(self, state: dict[str, Any], version: int) -> str | None:
        """Copies new weights in (between steps); returns why they were refused, or None."""
        params = dict(self.model.named_parameters())
        params.update(dict(self.model.named_buffers()))
        wrong = [n for n, v in state.items() if n in params and tuple(v.shape) != tuple(params[n].shape)]
        if wrong:  # followers check the layout first; never let a bad update stop the engine
            return f"version {version} not applied: tensors {wrong[:3]} do not have the model's shapes"
        with torch.no_grad():
            for name, value in state.items():
                if name in params:
                    params[name].copy_(torch.as_tensor(value).to(params[name].dtype))
        self.version = version
        return None

    # ---- one step ------------------------------------------------------------------------------

    @torch.inference_mode()
    def step(self) -> list[Finished]:
        """Admits what fits, runs one forward over every active row, samples; returns what ended."""
        self._admit()
        if not self.active:
            return []
        t_step = time.perf_counter()
        self.steps += 1
        fed = [r for r in self.active if r.leader is None]
        prefill = [r for r in fed if len(r.feed) > 1]
        # A long prompt padded next to one-token rows would cost every row its length: split then.
        groups = [fed] if not prefill or max(len(r.feed) for r in prefill) <= 16 else \
            [prefill, [r for r in fed if len(r.feed) == 1]]
        outs = [(rows, self._forward(rows)) for rows in groups if rows]
        rows = list(self.active)
        if len(outs) == 1 and len(outs[0][0]) == len(rows):  # no fork, one forward: already in row order
            logits = outs[0][1]
        else:
            logits_of = {id(r): out[i] for fed_rows, out in outs for i, r in enumerate(fed_rows)}
            for r in rows:
                if r.leader is not None:  # fork: the leader's prompt cache and first-token logits
                    n = len(self.slot_tokens[r.leader.slot])
                    self.cache.copy(r.leader.slot, r.slot, n)
                    self.slot_tokens[r.slot] = list(self.slot_tokens[r.leader.slot])
                    self.slot_version[r.slot] = self.slot_version[r.leader.slot]
                    self.reused_tokens += n
                    logits_of[id(r)] = logits_of[id(r.leader)]
                    r.leader = None
            logits = torch.stack([logits_of[id(r)] for r in rows])
        temps = torch.tensor([r.req.temperature for r in rows], device=self.device)
        top_ps = torch.tensor([r.req.top_p for r in rows], device=self.device)
        tokens, lps = sample_tokens(logits, temps, top_ps, self.gen)
        now = time.perf_counter()
        done: list[Finished] = []
        for r, t, lp in zip(rows, tokens.tolist(), lps.tolist(), strict=True):
            r.ids.append(t)
            r.lps.append(lp)
            r.vers.append(self.version)
            if r.first_token_s is None:
                r.first_token_s = now - r.submitted
            reason = None
            if t == self.eos_id or self._hit_stop(r.ids, r.req.stop):
                reason = "stop"
            elif len(r.ids) >= r.req.max_tokens or len(self.slot_tokens[r.slot]) + 1 >= self.max_len:
                reason = "length"
            if reason is None:
                r.feed = [t]
                continue
            self._release(r)
            self.tokens_generated += len(r.ids)
            text = self.tokenizer.decode(r.ids, skip_special_tokens=True)
            gen = Generation(np.asarray(r.ids, np.int32), np.asarray(r.lps, np.float32), np.asarray(r.vers, np.int32),
                             text, reason)
            done.append(Finished(r.rid, gen, ttft_s=r.first_token_s or 0.0))
        self.rows_sampled += len(rows)
        self.busy_s += time.perf_counter() - t_step
        return done

    def _admit(self) -> None:
        same_step: dict[tuple[int, ...], _Row] = {}
        while self.waiting and len(self.active) < self.max_batch:
            row = self.waiting.popleft()
            prompt = row.req.prompt_ids
            leader = same_step.get(tuple(prompt))
            if leader is not None:
                row.slot, row.leader = self._free_slot(avoid=-1), leader
                self.slot_tokens[row.slot] = []
            else:
                self._place(row)
                same_step[tuple(prompt)] = row
            self.slot_row[row.slot] = row
            self.slot_used[row.slot] = self.steps
            self.active.append(row)

    def _place(self, row: _Row) -> None:
        """Puts a request in a slot, starting from the longest usable cached prefix of its prompt."""
        prompt = row.req.prompt_ids
        best, src = 0, -1
        oldest_ok = self.version - self.max_cache_lag
        for s in range(self.slots):
            if self.slot_tokens[s] and self.slot_version[s] >= oldest_ok:
                n = _common_prefix(self.slot_tokens[s], prompt)
                if n > best or (n == best and n and self.slot_row[s] is None):
                    best, src = n, s
        reuse = min(best, len(prompt) - 1)  # the last prompt token is fed: its logits give token 1
        if src >= 0 and reuse == len(self.slot_tokens[src]) and self.slot_row[src] is None:
            # The prompt extends a retained conversation (its next turn): continue in that slot.
            row.slot = src
        else:
            row.slot = self._free_slot(avoid=src)  # == src when there is no other room: its tail is dropped
            if reuse == 0:
                self.slot_version[row.slot] = self.version
            elif row.slot != src:
                self.cache.copy(src, row.slot, reuse)
                self.slot_version[row.slot] = self.slot_version[src]
        self.slot_tokens[row.slot] = prompt[:reuse]
        self.reused_tokens += reuse
        row.feed = prompt[reuse:]

    def _free_slot(self, avoid: int) -> int:
        """A slot without a running request: an empty one, else the least recently used cache
        other than `avoid` (the source of a copy), else `avoid` itself."""
        free = [s for s in range(self.slots) if self.slot_row[s] is None]
        empty = [s for s in free if not self.slot_tokens[s]]
        if empty:
            return empty[0]
        others = [s for s in free if s != avoid]
        return min(others, key=lambda s: self.slot_used[s]) if others else avoid

    def _release(self, row: _Row) -> None:
        self.active.remove(row)
        if row.leader is not None:  # never computed: nothing cached
            self.slot_tokens[row.slot] = []
        self.slot_row[row.slot] = None
        self.slot_used[row.slot] = self.steps

    def _forward(self, rows: list[_Row]) -> torch.Tensor:
        """One forward over `rows`; returns the logits [rows, vocab] after each row's last fed token.

        Rows feeding one token each (decoding), or prompts of similar lengths, go as a [rows,
        longest feed] block, left-padded. A step where a few short prompts join decoding rows
        would pad every row to the prompt's length (16 rows x 15 positions for 30 real tokens):
        then the tokens are packed into ONE row of all fed tokens instead, and the mask lets each
        token see only its own slot's columns (`_packed`; its mask has tokens x rows x width
        entries, so only while that stays under PACKED_MASK_MAX)."""
        feeds = [r.feed for r in rows]
        q_list = [len(f) for f in feeds]
        q_max, total = max(q_list), sum(q_list)
        lens = torch.tensor([len(self.slot_tokens[r.slot]) for r in rows], device=self.device)
        slots = [r.slot for r in rows]
        width = max(len(self.slot_tokens[r.slot]) + n for r, n in zip(rows, q_list, strict=True))
        if q_max > 1 and len(rows) * q_max > 2 * total and total * len(rows) * width <= PACKED_MASK_MAX:
            ids, masks, pos_ids, last = self._packed(feeds, q_list, lens, slots)
        else:
            ids = torch.tensor([[self.pad_id] * (q_max - len(f)) + f for f in feeds], device=self.device)
            q = torch.tensor(q_list, device=self.device)
            rel = torch.arange(q_max, device=self.device)[None, :] - (q_max - q)[:, None]  # <0: padding
            valid = rel >= 0
            pos = lens[:, None] + rel
            width = int((lens + q).max())
            self.cache.ensure(width)
            self.cache.prepare(slots, torch.where(valid, pos, -1), width)
            cols = torch.arange(width, device=self.device)[None, None, :]
            pos3 = pos[:, :, None]
            # Padding queries look at column 0 only (never an empty row: softmax of nothing is NaN).
            full = torch.where(valid[:, :, None], cols <= pos3, cols == 0)
            masks = {"full_attention": full[:, None]}
            if "sliding_attention" in self.layer_types and self.window:
                masks["sliding_attention"] = (full & ((cols > pos3 - self.window) | ~valid[:, :, None]))[:, None]
            pos_ids, last = torch.where(valid, pos, 0), None
        if self.fast_forward is not None:
            logits = self.fast_forward(ids, masks, pos_ids, self.cache, last)
        else:
            out = self.model(input_ids=ids, attention_mask=masks, position_ids=pos_ids, past_key_values=self.cache,
                             use_cache=True, logits_to_keep=1 if last is None else last).logits
            logits = out[:, -1, :] if last is None else out[0]
        for r in rows:
            if len(r.feed) > 1 or not r.ids:
                self.prefill_tokens += len(r.feed)
            self.slot_tokens[r.slot].extend(r.feed)
            self.slot_version[r.slot] = min(self.slot_version[r.slot], self.version)
        return logits.float()

    def _packed(self, feeds: list[list[int]], q_list: list[int], lens: torch.Tensor, slots: list[int]
                ) -> tuple[torch.Tensor, dict[str, torch.Tensor], torch.Tensor, torch.Tensor]:
        """Inputs of a packed forward: ids and position ids [1, tokens], masks [1, 1, tokens,
        rows x width] (row i's columns are i*width .. i*width + width - 1, see
        `SlotKVCache.prepare(packed=True)`), and each row's last token index."""
        dev = self.device
        q = torch.tensor(q_list, device=dev)
        row_of = torch.repeat_interleave(torch.arange(len(feeds), device=dev), q)  # [tokens]
        starts = torch.cumsum(q, 0) - q
        pos = lens[row_of] + torch.arange(int(q.sum()), device=dev) - starts[row_of]
        width = int((lens + q).max())
        self.cache.ensure(width)
        self.cache.prepare(slots, pos[None, :], width, row_of=row_of)
        cols = torch.arange(len(feeds) * width, device=dev)
        col_row, col_pos = cols // width, cols % width
        mine = col_row[None, :] == row_of[:, None]
        full = mine & (col_pos[None, :] <= pos[:, None])
        masks = {"full_attention": full[None, None]}
        if "sliding_attention" in self.layer_types and self.window:
            masks["sliding_attention"] = (full & (col_pos[None, :] > pos[:, None] - self.window))[None, None]
        ids = torch.tensor([[t for f in feeds for t in f]], device=dev)
        return ids, masks, pos[None, :], starts + q - 1

    def _hit_stop(self, ids: list[int], stops: list[str]) -> bool:
        if not stops:
            return False
        tail = self.tokenizer.decode(ids[-16:], skip_special_tokens=False)
        return any(tail.endswith(s) for s in stops)

    # ---- checks --------------------------------------------------------------------------------

    @torch.inference_mode()
    def self_check(self) -> None:
        """Runs a short prompt through the slot cache (prefill, one decoded token, a fork) and
        compares with a plain forward; raises BackendError for a model this engine cannot drive."""
        prompt = [t % self.vocab for t in (3, 5, 7, 11, 13)]
        try:
            self.submit(-1, GenerateRequest(list(prompt), 2, temperature=0.0))
            self.submit(-2, GenerateRequest(list(prompt), 2, temperature=0.0))
            results = []
            for _ in range(8):  # two rows of two tokens, whatever max_batch is
                results += self.step()
            ref = self.model(input_ids=torch.tensor([prompt], device=self.device)).logits[0, -1].float()
        except Exception as exc:  # any architecture error: say what failed
            raise BackendError(f"{type(self.model).__name__} cannot run in the slot engine: {exc!r}") from exc
        lp0 = float(torch.log_softmax(ref, -1).max())
        got = [f.generation.logprobs[0] for f in results if f.generation is not None]
        if len(got) != 2 or any(abs(g - lp0) > 1e-3 for g in got):
            raise BackendError(f"{type(self.model).__name__}: the slot engine's logits differ from a plain forward "
                               f"({got} vs {lp0:.5f}); this architecture is not supported by the torch backend")
        self.steps = self.tokens_generated = self.prefill_tokens = self.reused_tokens = self.rows_sampled = 0
        self.busy_s = 0.0
        self.slot_tokens = [[] for _ in range(self.slots)]


def load_engine(model_dir: str, *, max_batch: int, cache_slots: int | None, device: str | None, version: int,
                seed: int | None, threads: int | None, max_cache_lag: int) -> tuple[SlotEngine, str]:
    """Loads the model and tokenizer into a checked SlotEngine; returns it and the hardware string."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    dev = torch.device(device or ("cuda" if torch.cuda.is_available() else "cpu"))
    if threads:
        torch.set_num_threads(threads)
    try:
        tokenizer = AutoTokenizer.from_pretrained(model_dir)
        model = AutoModelForCausalLM.from_pretrained(model_dir).to(dev).eval()
    except (OSError, ValueError) as exc:
        raise BackendError(f"cannot load a causal LM and tokenizer from {model_dir}: {exc}") from exc
    engine = SlotEngine(model, tokenizer, max_batch=max_batch, cache_slots=cache_slots, seed=seed, version=version,
                        max_cache_lag=max_cache_lag)
    engine.self_check()
    hardware = f"cuda:{torch.cuda.get_device_name(dev)}" if dev.type == "cuda" else f"cpu:{torch.get_num_threads()}"
    return engine, hardware


def model_layout(model: torch.nn.Module) -> tuple[dict[str, tuple[str, list[int]]], list[list[str]]]:
    """The model's tensors (name -> dtype, shape) and tied groups, as plain data."""
    layout = ModelLayout.of(model.state_dict())
    return ({n: (m.dtype.name, list(m.shape)) for n, m in layout.tensors.items()}, [list(g) for g in layout.groups])
