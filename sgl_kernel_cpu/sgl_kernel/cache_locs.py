"""Speculative-decoding bookkeeping ops: cache-slot gathers and token shuffles.

Semantics follow SGLang's Triton kernels for the same ops:
``assign_draft_cache_locs_contiguous`` and ``assign_extend_cache_locs``
(sglang/kernels/ops/speculative/cache_locs.py), ``fill_bonus_tokens`` and
``fill_accept_out_cache_loc`` (sglang/kernels/ops/speculative/eagle.py), and
``rotate_input_ids_kernel`` (sglang/kernels/ops/speculative/multi_layer_eagle.py).
"""

from __future__ import annotations


import torch

from ._common import flat, ragged


def assign_draft_cache_locs_contiguous_cpu(
    req_pool_indices: torch.Tensor,
    req_to_token: torch.Tensor,
    seq_lens: torch.Tensor,
    out_cache_loc: torch.Tensor,
    pool_len: int,
    topk: int,
    num_steps: int,
) -> None:
    """Gather each request's ``topk * num_steps`` draft slots, in place.

    req_pool_indices: [bs] int; req_to_token: [num_rows, pool_len] int32
    (contiguous); seq_lens: [bs] int; out_cache_loc: [>= bs * topk * num_steps]
    int64, written.

    ``out_cache_loc[i*C + j] = req_to_token[req_pool_indices[i], seq_lens[i] + j]``
    for ``j < C = topk * num_steps``.
    """
    out = flat(out_cache_loc, "out_cache_loc")
    table = flat(req_to_token, "req_to_token")
    bs = req_pool_indices.numel()
    copy_len = topk * num_steps
    if bs == 0 or copy_len <= 0:
        return
    rows = req_pool_indices.reshape(-1).to(torch.int64)
    starts = seq_lens.reshape(-1).to(torch.int64)
    cols = starts[:, None] + torch.arange(copy_len, device=starts.device)
    idx = rows[:, None] * pool_len + cols
    out[: bs * copy_len] = table[idx.reshape(-1)].to(out.dtype)


def assign_extend_cache_locs_cpu(
    req_pool_indices: torch.Tensor,
    req_to_token: torch.Tensor,
    start_offset: torch.Tensor,
    end_offset: torch.Tensor,
    out_cache_loc: torch.Tensor,
    pool_len: int,
) -> None:
    """Gather ragged slot ranges from the request-to-token table, in place.

    req_pool_indices: [bs] int; req_to_token: [num_rows, pool_len] int32
    (contiguous); start_offset, end_offset: [bs] int; out_cache_loc:
    [>= sum(end - start)] int64, written.

    ``out_cache_loc[o_i : o_i + len_i] = req_to_token[req_pool_indices[i], start[i]:end[i]]``
    with ``o_i = sum_{j<i} (end[j] - start[j])``; entries past the total are left alone.
    """
    out = flat(out_cache_loc, "out_cache_loc")
    table = flat(req_to_token, "req_to_token")
    seg, col, dst = ragged(start_offset, end_offset)
    if seg.numel() == 0:
        return
    rows = req_pool_indices.reshape(-1).to(torch.int64)[seg]
    out[dst] = table[rows * pool_len + col].to(out.dtype)


def fill_accept_out_cache_loc_cpu(
    accept_index: torch.Tensor,
    out_cache_loc: torch.Tensor,
    accept_out_cache_loc: torch.Tensor,
    size: int | None = None,
) -> None:
    """Compact the KV slots of accepted tokens, in place.

    accept_index: [bs, num_spec_tokens] int32, -1 marks an empty entry (read flat);
    out_cache_loc: [num_tokens] int64; accept_out_cache_loc: [>= #accepted] int64, written.
    size: how many entries of ``accept_index`` to scan (default: all of them;
    SGLang 0.5.23 does not pass it).

    For every ``k`` with ``accept_index[k] > -1``, in order:
    ``accept_out_cache_loc[#{m < k : accept_index[m] != -1}] = out_cache_loc[accept_index[k]]``.
    """
    out = flat(accept_out_cache_loc, "accept_out_cache_loc")
    index = accept_index.reshape(-1)
    if size is not None:
        index = index[:size]
    index = index.to(torch.int64)
    counted = (index != -1).to(torch.int64)
    dst = torch.cumsum(counted, 0) - counted
    keep = index > -1
    out[dst[keep]] = out_cache_loc.reshape(-1)[index[keep]].to(out.dtype)


def fill_bonus_tokens_cpu(
    accept_tokens: torch.Tensor,
    accept_lens: torch.Tensor,
    bonus_tokens: torch.Tensor,
    accept_stride: int,
) -> None:
    """Pick each request's last accepted token (the bonus token), in place.

    accept_tokens: [bs, accept_stride] int32 (read flat); accept_lens: [bs] int32,
    accepted count including the bonus token; bonus_tokens: [bs] int32, written.

    ``bonus_tokens[i] = accept_tokens.flat[accept_stride * i + accept_lens[i] - 1]``.
    """
    out = flat(bonus_tokens, "bonus_tokens")
    lens = accept_lens.reshape(-1).to(torch.int64)
    bs = lens.numel()
    if bs == 0:
        return
    idx = accept_stride * torch.arange(bs, device=lens.device) + lens - 1
    out[:bs] = accept_tokens.reshape(-1)[idx].to(out.dtype)


def rotate_input_ids_cpu(
    input_ids: torch.Tensor,
    extend_start_loc: torch.Tensor,
    extend_seq_lens: torch.Tensor,
    topk_index: torch.Tensor,
    select_index: torch.Tensor | None = None,
) -> None:
    """Shift each extend segment left by one and append the new token, in place.

    input_ids: [num_tokens] int64 (contiguous), segments laid out by
    extend_start_loc / extend_seq_lens ([bs] int each); topk_index: [bs] int,
    the new token per request (read flat); select_index: optional [bs] int,
    absolute position that receives the new token instead of the segment end.

    For a segment ``s = input_ids[start : start + n]`` with ``n > 0``:
    ``s[:-1] = s[1:]``, then ``input_ids[select_index[i] or start + n - 1] = topk_index[i]``.
    """
    ids = flat(input_ids, "input_ids")
    starts = extend_start_loc.reshape(-1).to(torch.int64)
    lens = extend_seq_lens.reshape(-1).to(torch.int64)
    bs = lens.numel()
    if bs == 0:
        return
    starts = starts[:bs]
    _, dst, _ = ragged(starts, starts + (lens - 1).clamp_min(0))
    ids[dst] = ids[dst + 1]  # advanced indexing gathers a copy first
    live = lens > 0
    if select_index is not None:
        last = select_index.reshape(-1).to(torch.int64)[:bs]
    else:
        last = starts + lens - 1
    ids[last[live]] = topk_index.reshape(-1)[:bs][live].to(ids.dtype)
