"""Tree attention over a paged KV cache with FlashInfer's BatchPrefillWithPagedKVCacheWrapper and a custom mask.

Owns the plan/run calls only, usable without SGLang: one plan per verify batch (`plan_tree_attention`, from a
`TreeCSR` and the `PlanDims` every layer shares), then one run per layer with that layer's KV scales. The result
must equal the dense oracle (tests/gpu). flashinfer is imported inside functions, so this module imports on
machines without it. The KV layout is NHD: [pages, page_size, kv_heads, dim] (or [slots, kv_heads, dim]).

plan() reads the indptrs on the host (TreeCSR keeps them there) and packs the bool mask into bits itself
(segment_packbits, little bit order): that packing reads one length back from the GPU, the only host sync.
"""

from __future__ import annotations

import torch

from attention_backends.csr import TreeCSR, csr_of
from attention_backends.layers import PlanDims
from attention_backends.paged import PagedTreeBatch

WORKSPACE_BYTES = 128 * 1024 * 1024


def new_workspace(device: torch.device | str, nbytes: int = WORKSPACE_BYTES) -> torch.Tensor:
    """The float workspace FlashInfer's wrappers share (uint8 [nbytes])."""
    return torch.zeros(nbytes, dtype=torch.uint8, device=device)


def new_wrapper(workspace: torch.Tensor):
    """A paged-prefill wrapper over `workspace`, NHD layout, on FlashInfer's fa2 kernels (the ones that take a
    custom mask; SGLang's verify wrappers use the same)."""
    import flashinfer

    return flashinfer.BatchPrefillWithPagedKVCacheWrapper(workspace, "NHD", backend="fa2")


def plan_tree_attention(wrapper, csr: TreeCSR, dims: PlanDims, *, q_dtype: torch.dtype,
                        kv_dtype: torch.dtype) -> None:
    """Plan `wrapper` for one verify batch; every layer of the forward then runs on this plan. With a custom
    mask, `causal` is ignored."""
    wrapper.plan(
        csr.qo_indptr, csr.kv_indptr, csr.kv_indices, csr.kv_last_page_len,
        dims.num_qo_heads, dims.num_kv_heads, dims.head_dim_qk, csr.page_size,
        head_dim_vo=dims.head_dim_vo, custom_mask=csr.mask, sm_scale=dims.sm_scale,
        logits_soft_cap=dims.logits_soft_cap, q_data_type=q_dtype, kv_data_type=kv_dtype, non_blocking=True,
    )  # fmt: skip


def run_tree_attention(wrapper, q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, *,
                       k_scale: float | None = None, v_scale: float | None = None,
                       out: torch.Tensor | None = None) -> torch.Tensor:
    """q [total_q, q_heads, dim_qk], k/v cache [pages, page_size, kv_heads, dim] (or [slots, kv_heads, dim]) ->
    [total_q, q_heads, dim_vo]. k_scale/v_scale: the layer's KV dequantization scales (scaled FP8 caches)."""
    return wrapper.run(q, (k_cache, v_cache), k_scale=k_scale, v_scale=v_scale, out=out)


def tree_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, batch: PagedTreeBatch,
                   scale: float, *, logits_soft_cap: float = 0.0, k_scale: float | None = None,
                   v_scale: float | None = None, workspace: torch.Tensor | None = None) -> torch.Tensor:
    """One-shot plan + run; the FlashInfer counterpart of `paged_tree_attention` (same arguments, same result)."""
    wrapper = new_wrapper(workspace if workspace is not None else new_workspace(q.device))
    dims = PlanDims(q.shape[1], k_cache.shape[-2], q.shape[-1], v_cache.shape[-1], scale, logits_soft_cap)
    plan_tree_attention(wrapper, csr_of(batch, q.device), dims, q_dtype=q.dtype, kv_dtype=k_cache.dtype)
    return run_tree_attention(wrapper, q, k_cache, v_cache, k_scale=k_scale, v_scale=v_scale)
