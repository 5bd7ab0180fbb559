"""Tree attention over a paged KV cache with FlashInfer's BatchPrefillWithPagedKVCacheWrapper and a custom mask.

Owns the plan/run calls only, usable without SGLang: the batch record is `PagedTreeBatch` and the result must
equal `paged_tree_attention` (tests/gpu/test_flashinfer_parity.py). flashinfer is imported inside functions,
so this module imports on machines without it. The KV layout is NHD: [pages, page_size, kv_heads, dim].
"""

from __future__ import annotations

import torch

from attention_backends.paged import PagedTreeBatch

WORKSPACE_BYTES = 128 * 1024 * 1024


def new_workspace(device: torch.device | str, nbytes: int = WORKSPACE_BYTES) -> torch.Tensor:
    """The float workspace FlashInfer's wrappers share (uint8 [nbytes])."""
    return torch.zeros(nbytes, dtype=torch.uint8, device=device)


def new_wrapper(workspace: torch.Tensor):
    """A paged-prefill wrapper over `workspace`, NHD layout."""
    import flashinfer

    return flashinfer.BatchPrefillWithPagedKVCacheWrapper(workspace, "NHD")


def plan_tree_attention(wrapper, batch: PagedTreeBatch, *, num_qo_heads: int, num_kv_heads: int, head_dim: int,
                        q_dtype: torch.dtype, kv_dtype: torch.dtype, scale: float) -> None:
    """Plan `wrapper` for `batch`: CSR page table plus the per-request masks as one flat custom mask.

    FlashInfer reads request b's mask as [q_len_b, kv_len_b] row-major at the running offset (the FULL
    layout of attention_backends.mask); with a custom mask, `causal` is ignored. plan() packs the bool mask
    into bits itself (segment_packbits, little bit order).
    """
    device = wrapper.device  # the workspace's device

    def int32(t: torch.Tensor) -> torch.Tensor:
        return t.to(device=device, dtype=torch.int32)

    wrapper.plan(
        int32(batch.qo_indptr), int32(batch.kv_indptr), int32(batch.kv_indices), int32(batch.kv_last_page_len),
        num_qo_heads, num_kv_heads, head_dim, batch.page_size,
        custom_mask=batch.flat_mask.to(device), q_data_type=q_dtype, kv_data_type=kv_dtype, sm_scale=scale,
    )  # fmt: skip


def run_tree_attention(wrapper, q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                       out: torch.Tensor | None = None) -> torch.Tensor:
    """q [total_q, q_heads, dim], k/v cache [pages, page_size, kv_heads, dim] (or [slots, kv_heads, dim] when
    the page size is 1) -> [total_q, q_heads, dim], with the plan made by `plan_tree_attention`."""
    return wrapper.run(q, (k_cache, v_cache), out=out)


def tree_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, batch: PagedTreeBatch,
                   scale: float, workspace: torch.Tensor | None = None) -> torch.Tensor:
    """One-shot plan + run; the FlashInfer counterpart of `paged_tree_attention` (same arguments, same result)."""
    wrapper = new_wrapper(workspace if workspace is not None else new_workspace(q.device))
    plan_tree_attention(wrapper, batch, num_qo_heads=q.shape[1], num_kv_heads=k_cache.shape[-2],
                        head_dim=q.shape[-1], q_dtype=q.dtype, kv_dtype=k_cache.dtype, scale=scale)
    return run_tree_attention(wrapper, q, k_cache, v_cache)
