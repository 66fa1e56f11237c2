"""The KV cache of the slot engine (`slots.py`): one row of keys/values per slot, growing by doubling."""

from __future__ import annotations

from typing import Any

import torch


class SlotKVCache:
    """Keys/values of `slots` sequences; duck-types the part of transformers' `Cache` a forward uses.

    Layer l holds `k[l]`, `v[l]` of shape [slots, capacity + 1, kv_heads, head_dim] (one
    `index_copy_` writes a step's tokens); the last column is scratch, where the padding
    positions of a forward write. `prepare` says, for the
    next forward, which slots its rows are, where each new token goes and how many columns the
    rows attend over; `update` (called by every attention layer) writes and returns them.
    """

    def __init__(self, layers: int, slots: int, kv_heads: int, head_dim: int, dtype: torch.dtype,
                 device: torch.device, capacity: int = 128) -> None:
        self.shape = (slots, kv_heads, head_dim)
        self.dtype, self.device = dtype, device
        self.capacity = capacity
        self.k = [self._empty(capacity) for _ in range(layers)]
        self.v = [self._empty(capacity) for _ in range(layers)]
        self._rows: torch.Tensor | None = None
        self._write: torch.Tensor | None = None
        self._span: tuple[int, int] | None = None  # rows are the slots lo..hi-1: return views
        self._width = 0
        self._packed = False

    def _empty(self, capacity: int) -> torch.Tensor:
        s, h, d = self.shape
        return torch.zeros((s, capacity + 1, h, d), dtype=self.dtype, device=self.device)

    def ensure(self, width: int) -> None:
        """Grows every layer to hold `width` columns (doubling, copying what is cached)."""
        if width <= self.capacity:
            return
        cap = max(width, 2 * self.capacity)
        for buf in (self.k, self.v):
            for i, old in enumerate(buf):
                new = self._empty(cap)
                new[:, : self.capacity] = old[:, : self.capacity]
                buf[i] = new
        self.capacity = cap

    def prepare(self, rows: list[int], write: torch.Tensor, width: int, row_of: torch.Tensor | None = None) -> None:
        """Next forward: row i is slot rows[i], its token j goes to column write[i, j] (-1: a
        padding position, written to the scratch column). Packed (`row_of` given): the forward
        has one row of tokens, token t belongs to row row_of[t] and goes to column write[0, t];
        `update` then returns the rows' columns side by side, [1, heads, rows x width, dim]."""
        self._rows = torch.tensor(rows, device=self.device)
        col = torch.where(write < 0, self.capacity, write)
        slot = self._rows[:, None] if row_of is None else self._rows[row_of][None, :]
        self._write = (slot * (self.capacity + 1) + col).reshape(-1).to(self.device)
        lo = rows[0]
        self._span = (lo, lo + len(rows)) if rows == list(range(lo, lo + len(rows))) else None
        self._width = width
        self._packed = row_of is not None

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, layer_idx: int,
               *_: Any, **__: Any) -> tuple[torch.Tensor, torch.Tensor]:
        assert self._rows is not None and self._write is not None
        K, V = self.k[layer_idx], self.v[layer_idx]
        _, h, d = self.shape
        K.view(-1, h, d).index_copy_(0, self._write, key_states.transpose(1, 2).reshape(-1, h, d).to(self.dtype))
        V.view(-1, h, d).index_copy_(0, self._write, value_states.transpose(1, 2).reshape(-1, h, d).to(self.dtype))
        if self._span is not None:
            lo, hi = self._span
            k, v = K[lo:hi, : self._width], V[lo:hi, : self._width]
        else:
            k, v = K[self._rows, : self._width], V[self._rows, : self._width]
        if self._packed:
            k, v = k.reshape(1, -1, h, d), v.reshape(1, -1, h, d)
        return k.transpose(1, 2), v.transpose(1, 2)

    def copy(self, src: int, dst: int, n: int) -> None:
        """Slot dst's first n columns become slot src's."""
        for buf in (self.k, self.v):
            for layer in buf:
                layer[dst, :n] = layer[src, :n]
