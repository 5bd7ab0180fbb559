"""Sliding-window layers in verification: which keys a verify row may still see when its layer has a window.

SGLang's convention (RadixAttention.sliding_window_size = W; torch_native's `_make_sliding_window_mask`, FlashInfer's
`window_left`): a query at position p sees the keys at positions p - W .. p, W + 1 keys counting itself. Gemma-3's HF
`sliding_window` counts the query too, so SGLang's Gemma-3 sets W = sliding_window - 1 (512 -> 511).
Pure functions of tensors and ints, no SGLang imports; the tree part of a mask is left as it is and only narrowed.
"""

from collections.abc import Sequence

import torch


def layer_window(sliding_window_size: int | None) -> int | None:
    """A layer's `sliding_window_size` -> its window W, or None for full attention (SGLang writes None or -1).

    Examples: 511 -> 511, -1 -> None, None -> None, 0 -> 0 (each query sees itself only)."""
    if sliding_window_size is None or sliding_window_size < 0:
        return None
    return int(sliding_window_size)


def row_positions(mask: torch.Tensor, prefix_len: int) -> torch.Tensor:
    """mask bool [n, prefix_len + n] (draft part ancestor-or-self) -> positions [n] int64 of the verify rows:
    prefix_len + depth, depth = ancestors counted in the draft part minus one (as SGLang positions a tree).

    Example: prefix 5, draft part [[1,0,0],[1,1,0],[1,0,1]] (a root and two children) -> [5, 6, 6]."""
    return prefix_len + mask[:, prefix_len:].to(torch.int64).sum(dim=1) - 1


def key_positions(rows: torch.Tensor, prefix_len: int) -> torch.Tensor:
    """rows [n] -> [prefix_len + n]: the cached prefix at 0..prefix_len - 1, then the verify rows at their own
    positions. Example: rows [5, 6, 6], prefix 5 -> [0, 1, 2, 3, 4, 5, 6, 6]."""
    prefix = torch.arange(prefix_len, dtype=torch.int64, device=rows.device)
    return torch.cat([prefix, rows.to(torch.int64)])


def window_keep(rows: torch.Tensor, keys: torch.Tensor, window: int) -> torch.Tensor:
    """rows [n], keys [kv] positions -> bool [n, kv]: key position >= row position - window (the lower edge only;
    causality comes from the mask it narrows). Example: rows [3], keys [0, 1, 2, 3], window 2 -> [[0, 1, 1, 1]]."""
    return keys.to(rows.device)[None, :] >= rows[:, None] - window


def windowed_mask(mask: torch.Tensor, prefix_len: int, window: int | None) -> torch.Tensor:
    """mask bool [n, prefix_len + n] -> the same mask with keys older than the window dropped (None: unchanged).

    Example: prefix 3, a chain of 2, window 1: [[1,1,1,1,0],[1,1,1,1,1]] -> [[0,0,1,1,0],[0,0,0,1,1]]."""
    if window is None:
        return mask
    rows = row_positions(mask, prefix_len)
    return mask & window_keep(rows, key_positions(rows, prefix_len), window).to(mask.device)


def windowed_masks(masks: Sequence[torch.Tensor], prefix_lens: Sequence[int],
                   window: int | None) -> tuple[torch.Tensor, ...]:
    """Per request bool [n_b, prefix_lens[b] + n_b] -> the windowed masks (see `windowed_mask`)."""
    return tuple(windowed_mask(m, p, window) for m, p in zip(masks, prefix_lens))
