"""Injected context K/V: per-draft-layer key/value rows derived from target features, their padded batch, and a
request's own growing buffer of them.

Rows are per token and independent of each other (RoPE already applied at the token's position), so serving can
store them at the target's KV slot ids and reuse them on a radix-cache prefix hit. Owns only the records and
row operations (concatenate, select, pad, append); must not compute projections or attention.
"""

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class ContextKV:
    """Context rows for some tokens, every draft layer at once."""

    keys: torch.Tensor  # [layers, T, kv_heads, head_dim], k_norm + RoPE applied
    values: torch.Tensor  # [layers, T, kv_heads, head_dim]

    @property
    def length(self) -> int:
        return self.keys.shape[1]

    def select(self, rows: torch.Tensor) -> "ContextKV":
        """rows [n] int64 (e.g. slot ids into a pool-shaped ContextKV) -> those rows, in that order."""
        return ContextKV(self.keys[:, rows], self.values[:, rows])

    @staticmethod
    def cat(parts: list["ContextKV"]) -> "ContextKV":
        return ContextKV(torch.cat([p.keys for p in parts], dim=1), torch.cat([p.values for p in parts], dim=1))


@dataclass(frozen=True)
class PaddedContext:
    """Per-request contexts of different lengths, right-padded to the longest."""

    keys: torch.Tensor  # [layers, B, S, kv_heads, head_dim]
    values: torch.Tensor  # [layers, B, S, kv_heads, head_dim]
    lengths: torch.Tensor  # [B] int64, valid rows per request

    @property
    def batch_size(self) -> int:
        return self.keys.shape[1]

    def valid(self) -> torch.Tensor:
        """[B, S] bool: True where a row holds real context."""
        return torch.arange(self.keys.shape[2], device=self.lengths.device) < self.lengths[:, None]

    def row(self, i: int) -> "PaddedContext":
        """The one-request batch of request i, trimmed to its length."""
        n = int(self.lengths[i])
        return PaddedContext(self.keys[:, i:i + 1, :n], self.values[:, i:i + 1, :n], self.lengths[i:i + 1])


HEADROOM = 128  # rows a ContextBuffer grows by at least (a request commits a few rows a step: one copy per ~50 steps)


class ContextBuffer:
    """One request's context rows in a buffer of its own [layers, capacity, kv_heads, head_dim], the first `length`
    real, grown by appending (by a quarter of its rows, at least HEADROOM, when it must grow), with `room` free rows
    kept after them: a drafting block's keys/values are written there and attention reads the buffer in place.
    Which slots the rows came from is the caller's to know (SlotContextStore: a request's context only grows
    between its prefills), so nothing here reads slot ids back from the device."""

    def __init__(self, rows: ContextKV, room: int) -> None:
        self.room, self.length = room, 0
        self.keys = rows.keys.new_empty((rows.keys.shape[0], 0, *rows.keys.shape[2:]))
        self.values = self.keys.clone()
        self.append(rows)

    def append(self, rows: ContextKV) -> None:
        """rows after the current ones."""
        end = self.length + rows.length
        if end + self.room > self.keys.shape[1]:
            capacity = end + self.room + max(HEADROOM, end // 4)
            self.keys, self.values = (self._grown(t, capacity) for t in (self.keys, self.values))
        self.keys[:, self.length:end] = rows.keys
        self.values[:, self.length:end] = rows.values
        self.length = end

    def _grown(self, t: torch.Tensor, capacity: int) -> torch.Tensor:
        """t [layers, rows, ...] with room for `capacity` rows, its first `length` rows copied."""
        out = t.new_empty((t.shape[0], capacity, *t.shape[2:]))
        out[:, :self.length] = t[:, :self.length]
        return out

    def with_block(self, layer: int, keys: torch.Tensor, values: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """A block's keys/values [q, kv_heads, d] (q <= room) written after layer `layer`'s rows -> that layer's
        rows and the block's [length + q, kv_heads, d], views of the buffer (the block's rows are scratch: the next
        append overwrites them)."""
        end = self.length + keys.shape[0]
        self.keys[layer, self.length:end] = keys
        self.values[layer, self.length:end] = values
        return self.keys[layer, :end], self.values[layer, :end]


@dataclass(frozen=True)
class RequestContexts:
    """Per-request context rows, each request's in its own `ContextBuffer` (what serving drafts from)."""

    buffers: tuple[ContextBuffer, ...]

    @property
    def batch_size(self) -> int:
        return len(self.buffers)


def pad_contexts(contexts: list[ContextKV]) -> PaddedContext:
    """One ContextKV per request -> PaddedContext (padding rows are zeros and masked out)."""
    first = contexts[0].keys
    longest = max(c.length for c in contexts)
    shape = (first.shape[0], len(contexts), longest, *first.shape[2:])
    keys, values = first.new_zeros(shape), first.new_zeros(shape)
    for i, c in enumerate(contexts):
        keys[:, i, :c.length] = c.keys
        values[:, i, :c.length] = c.values
    lengths = torch.tensor([c.length for c in contexts], dtype=torch.long, device=first.device)
    return PaddedContext(keys, values, lengths)


def gather_padded(pool: ContextKV, slots: tuple[torch.Tensor, ...]) -> PaddedContext:
    """Rows `slots[i]` [L_i] int64 of a pool-shaped ContextKV, per request, right-padded: one gather, no
    intermediate per-request copies. Padding rows repeat the request's first row (masked out like zeros).
    Example: slots ([4, 7], [2]) -> rows [[4, 7], [2, 2]], lengths [2, 1]."""
    lengths = torch.tensor([s.numel() for s in slots], dtype=torch.long)
    longest = max(int(lengths.max()), 1)
    index = torch.stack([torch.cat([s.long(), s[:1].long().expand(longest - s.numel())]) if s.numel()
                         else torch.zeros(longest, dtype=torch.long) for s in slots])  # [B, S]
    index = index.to(pool.keys.device)
    return PaddedContext(pool.keys[:, index], pool.values[:, index], lengths.to(pool.keys.device))
