"""Draft-tree ops for EAGLE / NGRAM speculative decoding.

Semantics follow the kernels SGLang ships for the same ops: the JIT CUDA
kernels in sglang/kernels/jit/include/sgl_kernel/speculative/{eagle,ngram}.cuh,
and the Triton ports ``sgl_build_tree_kernel_efficient_triton`` /
``verify_tree_greedy_kernel_triton`` (sglang/kernels/ops/speculative/spec_tree.py)
and ``_reconstruct_tree_mask_kernel`` (.../speculative/reconstruct_tree.py).
The cache-slot ops live in ``sgl_kernel.cache_locs`` / ``sgl_kernel.kvcache``
and are re-exported here, as the compiled package does.
"""

from __future__ import annotations

import logging

import torch

from ._common import flat
from ._stub import module_getattr
from .cache_locs import (  # noqa: F401  (re-exported, as in the compiled package)
    assign_draft_cache_locs_contiguous_cpu,
    assign_extend_cache_locs_cpu,
    fill_accept_out_cache_loc_cpu,
    fill_bonus_tokens_cpu,
    rotate_input_ids_cpu,
)
from .kvcache import assign_req_to_token_pool_cpu  # noqa: F401

logger = logging.getLogger(__name__)

FULL_MASK, QLEN_ONLY, QLEN_ONLY_BITPACKING = 0, 1, 2


def _tree_rows(sel_row, parent_row, topk, n, seq_len, next_token, next_sibling):
    """One request of build_tree: fills the link lists in place and returns
    ``(ancestor_columns_per_token, positions)``; see build_tree_kernel_efficient_cpu."""
    first_pos = {}
    for p, token in enumerate(sel_row):
        first_pos.setdefault(token, p)

    def parent_slot(p):
        # Position in sel_row of the parent of draft slot p; -1 = the root, None = missing.
        parent_tb_idx = sel_row[p] // topk
        if parent_tb_idx == 0:
            return -1
        return first_pos.get(parent_row[parent_tb_idx])

    invalid = 0
    for i in range(n - 1, 0, -1):
        parent = parent_slot(i - 1)
        if parent is None:
            invalid += 1  # the CUDA kernel warns and ignores such a token
            continue
        parent_position = parent + 1
        if next_token[parent_position] != -1:
            next_sibling[i] = next_token[parent_position]
        next_token[parent_position] = i

    columns, positions = [[0]], [seq_len]
    for tid in range(1, n):
        cols, cur = [0], tid - 1
        while cur is not None and len(cols) <= n:
            cols.append(cur + 1)
            cur = parent_slot(cur)
            if cur == -1:
                break
        columns.append(cols)
        positions.append(seq_len + len(cols) - 1)
    if invalid:
        logger.warning(
            "invalid eagle tree: %d token(s) with no selected parent were ignored "
            "(check the draft logprobs for nan)",
            invalid,
        )
    return columns, positions


def build_tree_kernel_efficient_cpu(
    parent_list: torch.Tensor,
    selected_index: torch.Tensor,
    verified_seq_len: torch.Tensor,
    tree_mask: torch.Tensor,
    positions: torch.Tensor,
    retrive_index: torch.Tensor,
    retrive_next_token: torch.Tensor,
    retrive_next_sibling: torch.Tensor,
    topk: int,
    depth: int,
    draft_token_num: int,
    tree_mask_mode: int,
) -> None:
    """Build the EAGLE verify tree from the draft top-k choices, in place.

    parent_list: [bs, topk*(depth-1)+1] int64; selected_index: [bs, n-1] int64
    (sorted flat indices of the chosen draft tokens); verified_seq_len: [bs] int64;
    positions: [bs*n] int64; retrive_index / retrive_next_token /
    retrive_next_sibling: [bs, n] int64, the latter two pre-filled with -1.
    ``n = draft_token_num``; token 0 of each request is the root (bonus token).

    tree_mask (token ``t`` attends to root and its draft ancestors incl. itself):
      FULL_MASK (0): bool rows of width ``seq_len + n`` per request, back to
        back; only the last ``n`` columns of each row are written.
      QLEN_ONLY (1): bool [bs*n*n], fully written.
      QLEN_ONLY_BITPACKING (2): ``bs*n`` little-endian bit rows of 1/2/4 bytes
        (by n); byte 0 is assigned, the others OR-ed (caller zero-fills).
    positions[t] = seq_len + depth(t); retrive_index[b, t] = b*n + t;
    next_token / next_sibling link each node to its first child / next sibling.
    """
    n = int(draft_token_num)
    if tree_mask_mode not in (FULL_MASK, QLEN_ONLY, QLEN_ONLY_BITPACKING):
        raise ValueError(f"sgl_kernel CPU stand-in: bad tree_mask_mode {tree_mask_mode}")
    if not 0 < n <= 1024 or topk <= 0:
        raise ValueError("sgl_kernel CPU stand-in: need 0 < draft_token_num <= 1024, topk > 0")
    if tree_mask_mode == QLEN_ONLY_BITPACKING and n > 32:
        raise ValueError(
            "sgl_kernel CPU stand-in: bit-packed tree masks need draft_token_num <= 32"
        )
    bs = verified_seq_len.numel()
    if bs == 0:
        return
    seq_lens = verified_seq_len.reshape(-1).tolist()
    sel_rows = selected_index.reshape(bs, n - 1).tolist()
    parent_rows = parent_list.reshape(bs, parent_list.numel() // bs).tolist()  # may be [bs, 0]
    next_token = flat(retrive_next_token, "retrive_next_token")
    next_sibling = flat(retrive_next_sibling, "retrive_next_sibling")
    nt_rows = next_token[: bs * n].view(bs, n).tolist()
    ns_rows = next_sibling[: bs * n].view(bs, n).tolist()

    mask_b, mask_t, mask_c, pos = [], [], [], []
    for b in range(bs):
        columns, row_pos = _tree_rows(
            sel_rows[b], parent_rows[b], topk, n, seq_lens[b], nt_rows[b], ns_rows[b]
        )
        pos.extend(row_pos)
        for t, cols in enumerate(columns):
            mask_b.extend([b] * len(cols))
            mask_t.extend([t] * len(cols))
            mask_c.extend(cols)

    device = positions.device
    flat(positions, "positions")[: bs * n] = torch.tensor(pos, dtype=positions.dtype, device=device)
    flat(retrive_index, "retrive_index")[: bs * n] = torch.arange(bs * n, device=device)
    next_token[: bs * n] = torch.tensor(nt_rows, dtype=next_token.dtype, device=device).view(-1)
    next_sibling[: bs * n] = torch.tensor(ns_rows, dtype=next_sibling.dtype, device=device).view(-1)

    mb = torch.tensor(mask_b, dtype=torch.int64, device=device)
    mt = torch.tensor(mask_t, dtype=torch.int64, device=device)
    mc = torch.tensor(mask_c, dtype=torch.int64, device=device)
    dense = torch.zeros((bs, n, n), dtype=torch.bool, device=device)
    dense[mb, mt, mc] = True
    mask = flat(tree_mask, "tree_mask")
    if tree_mask_mode == QLEN_ONLY_BITPACKING:
        nbytes = 4 if n > 16 else (2 if n > 8 else 1)
        ar = torch.arange(n, device=device)
        bits = (dense.view(bs * n, n).to(torch.int64) << ar).sum(-1)
        shifts = 8 * torch.arange(nbytes, device=device)
        packed = ((bits[:, None] >> shifts) & 0xFF).to(torch.uint8)
        rows = mask.view(torch.uint8)[: bs * n * nbytes].view(bs * n, nbytes)
        rows[:, 0] = packed[:, 0]
        rows[:, 1:] |= packed[:, 1:]
        return
    if tree_mask_mode == QLEN_ONLY:
        mask[: bs * n * n] = dense.view(-1).to(mask.dtype)
        return
    sl = torch.tensor(seq_lens, dtype=torch.int64, device=device)
    base = n * n * torch.arange(bs, device=device) + n * (torch.cumsum(sl, 0) - sl) + sl
    ar = torch.arange(n, device=device)
    idx = base[:, None, None] + (sl + n)[:, None, None] * ar[None, :, None] + ar[None, None, :]
    mask[idx.view(-1)] = dense.view(-1).to(mask.dtype)


def verify_tree_greedy_cpu(
    predicts: torch.Tensor,
    accept_index: torch.Tensor,
    accept_token_num: torch.Tensor,
    candidates: torch.Tensor,
    retrive_index: torch.Tensor,
    retrive_next_token: torch.Tensor,
    retrive_next_sibling: torch.Tensor,
    target_predict: torch.Tensor,
) -> None:
    """Greedy tree verification: walk the draft tree along target argmaxes, in place.

    predicts: [bs*n] int32; accept_index: [bs, S] int32 (pre-filled with -1);
    accept_token_num: [bs] int32; candidates, retrive_*: [bs, n] int64;
    target_predict: [bs, n] int64 (read flat by global token index).

    Starting at the root, each step follows next_token / next_sibling to the
    first child whose draft token equals the target's argmax at the last
    accepted node, for at most ``S - 1`` steps. Writes the accepted global
    indices to ``accept_index[b, :k+1]``, ``k`` to ``accept_token_num[b]``,
    and the target token at every accepted node (incl. the bonus) to ``predicts``.
    """
    bs, n = candidates.shape
    spec = accept_index.shape[1]
    if bs == 0:
        return
    cand = candidates.tolist()
    ri = retrive_index.reshape(bs, n).tolist()
    nt = retrive_next_token.reshape(bs, n).tolist()
    ns = retrive_next_sibling.reshape(bs, n).tolist()
    target = target_predict.reshape(-1).tolist()

    pred_at, pred_val, acc_at, acc_val, counts = [], [], [], [], []
    for b in range(bs):
        last = ri[b][0]
        acc_at.append(b * spec)
        acc_val.append(last)
        accepted, cur = 0, 0
        for _ in range(1, spec):
            cur = nt[b][cur]
            while cur != -1:
                if cand[b][cur] == target[last]:
                    pred_at.append(last)
                    pred_val.append(target[last])
                    accepted += 1
                    last = ri[b][cur]
                    acc_at.append(b * spec + accepted)
                    acc_val.append(last)
                    break
                cur = ns[b][cur]
            if cur == -1:
                break
        counts.append(accepted)
        pred_at.append(last)
        pred_val.append(target[last])

    device = predicts.device
    flat(predicts, "predicts")[torch.tensor(pred_at, device=device)] = torch.tensor(
        pred_val, dtype=predicts.dtype, device=device
    )
    flat(accept_index, "accept_index")[torch.tensor(acc_at, device=device)] = torch.tensor(
        acc_val, dtype=accept_index.dtype, device=device
    )
    flat(accept_token_num, "accept_token_num")[:bs] = torch.tensor(
        counts, dtype=accept_token_num.dtype, device=device
    )


def reconstruct_indices_from_tree_mask(
    tree_mask: torch.Tensor,
    verified_seq_len: torch.Tensor,
    positions: torch.Tensor,
    retrive_index: torch.Tensor,
    retrive_next_token: torch.Tensor,
    retrive_next_sibling: torch.Tensor,
    batch_size: int,
    draft_token_num: int,
) -> None:
    """Rebuild NGRAM verify metadata from a dense ancestor mask, in place.

    tree_mask: [>= bs*n*n] bool/uint8, ``mask[b, i, j]`` marks node j as an
    ancestor of node i (only ``j < i`` is read); verified_seq_len: [bs] int64;
    positions: [bs*n] int64; retrive_*: [bs, n] int64.

    positions[b, i] = seq_len[b] + #ancestors(i); retrive_index[b, i] = b*n + i;
    parent(i) = max{j < i : mask[b, i, j]};
    retrive_next_token[b, i] = min{k > i : mask[b, k, i]} (else -1);
    retrive_next_sibling[b, i] = min{k > i : parent(k) == parent(i)}
    (else -1, and -1 for a root).
    """
    bs, n = int(batch_size), int(draft_token_num)
    if bs == 0:
        return
    device = tree_mask.device
    m = tree_mask.reshape(-1)[: bs * n * n].view(bs, n, n) != 0
    ar = torch.arange(n, device=device)
    anc = m & (ar[None, :] < ar[:, None])  # [b, i, j]: j is a strict ancestor of i
    seq = verified_seq_len.reshape(-1)[:bs].to(torch.int64)
    depth = anc.sum(-1)
    parent = torch.where(anc, ar, -1).amax(-1)  # [b, i]
    first_child = torch.where(anc, ar[None, :, None], n).amin(1)  # min over rows k
    later = ar[:, None] > ar[None, :]  # [k, i]: k > i
    same_parent = (parent[:, :, None] == parent[:, None, :]) & later
    first_sibling = torch.where(same_parent, ar[None, :, None], n).amin(1)

    neg = torch.full_like(first_child, -1)
    next_token = torch.where(first_child < n, first_child, neg)
    next_sibling = torch.where((parent >= 0) & (first_sibling < n), first_sibling, neg)
    flat(positions, "positions")[: bs * n] = (depth + seq[:, None]).view(-1)
    flat(retrive_index, "retrive_index")[: bs * n] = torch.arange(bs * n, device=device)
    flat(retrive_next_token, "retrive_next_token")[: bs * n] = next_token.view(-1)
    flat(retrive_next_sibling, "retrive_next_sibling")[: bs * n] = next_sibling.view(-1)


__getattr__ = module_getattr(__name__)
