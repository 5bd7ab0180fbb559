"""The verify path the dspark_flashinfer backend runs, on FlashInfer, without SGLang: the CSR built as the backend
builds it (host lengths, keys gathered through a KV index table, the worker's FULL mask) with no host sync, one plan
shared by layers of different query-head counts and caches, a soft-capped plan, and a scaled FP8 KV cache; each
against the dense oracle. Page size 1, as SGLang verifies. GPU only."""

from types import SimpleNamespace

import pytest
import torch
from cases import HEAD_DIM, SOFT_CAP, TOLERANCE, draft_tree

from attention_backends.csr import TreeCSR, table_slots, verify_csr
from attention_backends.layers import PlanDims
from attention_backends.mask import MaskLayout, flatten_masks, full_layout, with_prefix
from attention_backends.oracle import dense_attention
from sgl_dspark.layout import pack_trees

pytestmark = pytest.mark.gpu

KV_HEADS, SLOTS = 2, 4096
PREFIX_LENS = [0, 300, 41, 1200]


def random_tree_batch(gen: torch.Generator) -> tuple[TreeCSR, list[torch.Tensor], list[torch.Tensor]]:
    """Mixed trees packed by pack_trees, their rows on random slots of a req_to_token-like table on the GPU ->
    the backend's CSR, and per request the key slots and the dense mask the oracle uses."""
    rows = pack_trees([draft_tree(n, gen) for n in (5, 1, 8, 3)], PREFIX_LENS)
    kv_lens = [p + rows.width for p in PREFIX_LENS]
    req_to_token = torch.zeros(6, 2048, dtype=torch.int32)
    pool_rows = [4, 0, 5, 2]
    free = torch.randperm(SLOTS, generator=gen)
    slots, start = [], 0
    for row, n in zip(pool_rows, kv_lens):
        slots.append(free[start:start + n])
        req_to_token[row, :n] = slots[-1].to(torch.int32)
        start += n
    table = SimpleNamespace(ids=req_to_token.cuda(), row_ids=torch.tensor(pool_rows).cuda(), entry_page_size=1,
                            v2p=None)
    custom_mask = flatten_masks([with_prefix(m, p) for m, p in zip(rows.mask, PREFIX_LENS)]).cuda()
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")  # building the plan's inputs must not wait for the GPU
    try:
        csr = verify_csr(PREFIX_LENS, rows.width, table_slots(table, kv_lens),
                         full_layout(custom_mask, PREFIX_LENS, rows.width, MaskLayout.FULL))
    finally:
        torch.cuda.set_sync_debug_mode("default")
    masks = [with_prefix(m, p) for m, p in zip(rows.mask, PREFIX_LENS)]
    return csr, slots, masks


def oracle(q, k_cache, v_cache, csr: TreeCSR, slots, masks, scale, cap=0.0):
    rows = csr.qo_indptr.tolist()
    return torch.cat([dense_attention(q[rows[b]:rows[b + 1]].float(), k_cache[s.cuda()].float(),
                                      v_cache[s.cuda()].float(), m, scale, cap)
                      for b, (s, m) in enumerate(zip(slots, masks))])


def planned(csr: TreeCSR, dims: PlanDims, q_dtype, kv_dtype):
    from attention_backends.flashinfer_tree import new_workspace, new_wrapper, plan_tree_attention

    wrapper = new_wrapper(new_workspace("cuda"))
    plan_tree_attention(wrapper, csr, dims, q_dtype=q_dtype, kv_dtype=kv_dtype)
    return wrapper


def test_one_plan_serves_layers_of_different_head_counts():
    """Planned with 8 query heads; layers of 8 and of 4 query heads (fewer is safe) and their own caches run on it."""
    from attention_backends.flashinfer_tree import run_tree_attention

    gen = torch.Generator().manual_seed(1)
    csr, slots, masks = random_tree_batch(gen)
    scale = HEAD_DIM**-0.5
    wrapper = planned(csr, PlanDims(8, KV_HEADS, HEAD_DIM, HEAD_DIM, scale, 0.0), torch.bfloat16, torch.bfloat16)
    for q_heads in (8, 4, 8):
        k_cache, v_cache = (torch.randn(SLOTS, KV_HEADS, HEAD_DIM, generator=gen).to("cuda", torch.bfloat16)
                            for _ in range(2))
        q = (torch.randn(int(csr.qo_indptr[-1]), q_heads, HEAD_DIM, generator=gen) * 2).to("cuda", torch.bfloat16)
        got = run_tree_attention(wrapper, q, k_cache, v_cache).float()
        want = oracle(q, k_cache, v_cache, csr, slots, masks, scale)
        torch.testing.assert_close(got, want, atol=TOLERANCE[torch.bfloat16], rtol=TOLERANCE[torch.bfloat16])


def test_soft_capped_plan_matches_the_capped_oracle():
    from attention_backends.flashinfer_tree import run_tree_attention

    gen = torch.Generator().manual_seed(2)
    csr, slots, masks = random_tree_batch(gen)
    scale = HEAD_DIM**-0.5
    wrapper = planned(csr, PlanDims(8, KV_HEADS, HEAD_DIM, HEAD_DIM, scale, SOFT_CAP), torch.bfloat16,
                      torch.bfloat16)
    k_cache = (torch.randn(SLOTS, KV_HEADS, HEAD_DIM, generator=gen) * 4).to("cuda", torch.bfloat16)
    v_cache = torch.randn(SLOTS, KV_HEADS, HEAD_DIM, generator=gen).to("cuda", torch.bfloat16)
    q = (torch.randn(int(csr.qo_indptr[-1]), 8, HEAD_DIM, generator=gen) * 4).to("cuda", torch.bfloat16)
    got = run_tree_attention(wrapper, q, k_cache, v_cache).float()
    want = oracle(q, k_cache, v_cache, csr, slots, masks, scale, SOFT_CAP)
    uncapped = oracle(q, k_cache, v_cache, csr, slots, masks, scale)
    assert (want - uncapped).abs().max() > 0.1  # the cap matters for these logits
    torch.testing.assert_close(got, want, atol=TOLERANCE[torch.bfloat16], rtol=TOLERANCE[torch.bfloat16])


def test_scaled_fp8_kv_cache():
    """KV stored as SGLang stores a scaled FP8 cache (value / scale); run() gets the layer's scales."""
    from attention_backends.flashinfer_tree import run_tree_attention

    gen = torch.Generator().manual_seed(3)
    csr, slots, masks = random_tree_batch(gen)
    scale, k_scale, v_scale = HEAD_DIM**-0.5, 0.5, 2.0
    wrapper = planned(csr, PlanDims(8, KV_HEADS, HEAD_DIM, HEAD_DIM, scale, 0.0), torch.bfloat16,
                      torch.float8_e4m3fn)
    k, v = (torch.randn(SLOTS, KV_HEADS, HEAD_DIM, generator=gen).cuda() for _ in range(2))
    k_fp8, v_fp8 = (k / k_scale).to(torch.float8_e4m3fn), (v / v_scale).to(torch.float8_e4m3fn)
    q = torch.randn(int(csr.qo_indptr[-1]), 8, HEAD_DIM, generator=gen).to("cuda", torch.bfloat16)
    got = run_tree_attention(wrapper, q, k_fp8, v_fp8, k_scale=k_scale, v_scale=v_scale).float()
    want = oracle(q, k_fp8.float() * k_scale, v_fp8.float() * v_scale, csr, slots, masks, scale)
    torch.testing.assert_close(got, want, atol=TOLERANCE[torch.bfloat16], rtol=TOLERANCE[torch.bfloat16])
