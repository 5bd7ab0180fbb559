"""The slow oracle every attention path is checked against: explicit softmax(q k^T * scale) v under a dense mask.

Owns nothing else. Deliberately shares no code with the backends (no SDPA, no page-table helpers): float64,
heads repeated by hand, keys gathered slot by slot.
"""

import torch


def dense_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor,
                    scale: float, logits_soft_cap: float = 0.0) -> torch.Tensor:
    """q [q_len, q_heads, dim], k [kv_len, kv_heads, dim], v [kv_len, kv_heads, v_dim], mask bool [q_len, kv_len]
    -> [q_len, q_heads, v_dim] in q's dtype. q_heads must be a multiple of kv_heads. logits_soft_cap > 0 caps the
    scaled logits to cap * tanh(logits / cap) (Gemma-2)."""
    group = q.shape[1] // k.shape[1]
    k = k.double().repeat_interleave(group, dim=1)
    v = v.double().repeat_interleave(group, dim=1)
    scores = torch.einsum("qhd,khd->hqk", q.double(), k) * scale
    if logits_soft_cap > 0:
        scores = logits_soft_cap * torch.tanh(scores / logits_soft_cap)
    scores = scores.masked_fill(~mask.to(device=scores.device, dtype=torch.bool), float("-inf"))
    return torch.einsum("hqk,khd->qhd", scores.softmax(dim=-1), v).to(q.dtype)


def gather_keys(cache: torch.Tensor, pages: list[int], page_size: int, kv_len: int) -> torch.Tensor:
    """cache [pages, page_size, heads, dim] or [slots, heads, dim]; page ids -> the first kv_len keys
    [kv_len, heads, dim]."""
    rows = [cache[page * page_size + i] if cache.dim() == 3 else cache[page, i]
            for page in pages for i in range(page_size)]
    return torch.stack(rows[:kv_len])


def dense_tree_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, qo_indptr: list[int],
                         kv_pages: list[list[int]], kv_lens: list[int], masks: list[torch.Tensor], scale: float,
                         page_size: int = 1) -> torch.Tensor:
    """Per request b: dense_attention of q[qo_indptr[b]:qo_indptr[b + 1]] over the first kv_lens[b] keys of
    pages kv_pages[b], under masks[b] [q_len_b, kv_len_b]. Returns [total_q, q_heads, v_dim]."""
    outs = []
    for b, mask in enumerate(masks):
        k = gather_keys(k_cache, kv_pages[b], page_size, kv_lens[b])
        v = gather_keys(v_cache, kv_pages[b], page_size, kv_lens[b])
        outs.append(dense_attention(q[qo_indptr[b]:qo_indptr[b + 1]], k, v, mask, scale))
    return torch.cat(outs)
