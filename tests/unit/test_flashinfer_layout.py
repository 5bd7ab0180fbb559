"""What FlashInfer will read from the verify plan, checked on CPU: `TreeCSR` (indptrs, key slots, flat mask) against
a pure-Python model of FlashInfer's documented layout, mixed-size trees as the worker's ragged verify batch lays them
out (and padded to one width, as SGLang's own verify batches are), and the key gather through SGLang's KV index
table."""

from types import SimpleNamespace

import pytest
import torch

from attention_backends.csr import TreeCSR, csr_of, table_slots, verify_csr
from attention_backends.mask import MaskLayout, chain_mask, flatten_masks, full_layout, with_prefix
from attention_backends.paged import PagedTreeBatch
from sgl_dspark.layout import pack_trees, verify_forward_input
from sgl_dspark.tree import DraftTree

T, F = True, False


def flashinfer_reads(csr: TreeCSR) -> tuple[list[torch.Tensor], list[list[int]]]:
    """Per request, the mask and key slots FlashInfer's plan + fa2 kernel read from `csr`, re-derived from its
    documentation and source (flashinfer 0.7.2): mask_indptr = running sum of q_len * kv_len
    (`_compute_page_mask_indptr`); each request's segment packed to its own bytes, little bit order
    (`segment_packbits`); the kernel tests bit (qo * kv_len + kv) of its segment (`DefaultAttention`); key j is slot
    kv_indices[kv_indptr[b] + j // page_size] * page_size + j % page_size."""
    qo, kv, pages, last = (csr.qo_indptr.tolist(), csr.kv_indptr.tolist(), csr.kv_indices.tolist(),
                           csr.kv_last_page_len.tolist())
    bits = csr.mask.tolist()
    masks, slots, bit_start = [], [], 0
    for b in range(len(qo) - 1):
        q_len = qo[b + 1] - qo[b]
        kv_len = (kv[b + 1] - kv[b] - 1) * csr.page_size + last[b]
        seg = bits[bit_start:bit_start + q_len * kv_len]
        packed = [sum(int(x) << i for i, x in enumerate(seg[k:k + 8])) for k in range(0, len(seg), 8)]
        masks.append(torch.tensor([[bool((packed[(i * kv_len + j) // 8] >> ((i * kv_len + j) % 8)) & 1)
                                    for j in range(kv_len)] for i in range(q_len)], dtype=torch.bool))
        slots.append([pages[kv[b] + j // csr.page_size] * csr.page_size + j % csr.page_size for j in range(kv_len)])
        bit_start += q_len * kv_len
    return masks, slots


# --- the CSR record ---------------------------------------------------------------------------------------


def test_verify_csr_literal():
    csr = verify_csr([2, 0], 2, torch.tensor([7, 8, 9, 10, 3, 4]), torch.ones(2 * 4 + 2 * 2, dtype=torch.bool))
    assert csr.qo_indptr.tolist() == [0, 2, 4] and csr.kv_indptr.tolist() == [0, 4, 6]
    assert csr.kv_last_page_len.tolist() == [1, 1] and csr.kv_indices.dtype == torch.int32
    assert csr.q_lens == [2, 2] and csr.kv_lens == [4, 2]


def test_csr_rejects_device_indptrs_and_wrong_mask_size():
    with pytest.raises(ValueError, match="mask has 3 elements"):
        verify_csr([1], 1, torch.tensor([0, 1]), torch.ones(3, dtype=torch.bool))
    meta = torch.zeros(2, dtype=torch.int32, device="meta")
    with pytest.raises(ValueError, match="host"):
        TreeCSR(meta, meta, torch.zeros(0, dtype=torch.int32), torch.ones(1, dtype=torch.int32),
                torch.zeros(0, dtype=torch.bool))


def test_flashinfer_reads_a_paged_batch_as_the_reference_does():
    # two requests on pages of 3: keys [5, 1] with 1 in the last page, keys [2] with 2; masks with hidden columns
    masks = (torch.tensor([[1, 0, 1, 1]], dtype=torch.bool), torch.tensor([[1, 0], [1, 1]], dtype=torch.bool))
    batch = PagedTreeBatch(
        qo_indptr=torch.tensor([0, 1, 3], dtype=torch.int32), kv_indptr=torch.tensor([0, 2, 3], dtype=torch.int32),
        kv_indices=torch.tensor([5, 1, 2], dtype=torch.int32), kv_last_page_len=torch.tensor([1, 2], dtype=torch.int32),
        masks=masks, page_size=3,
    )  # fmt: skip
    got_masks, got_slots = flashinfer_reads(csr_of(batch, "cpu"))
    assert got_slots == [[15, 16, 17, 3], [6, 7]]
    assert got_slots == [s.tolist() for s in batch.kv_slots]
    assert [m.tolist() for m in got_masks] == [[[T, F, T, T]], [[T, F], [T, T]]]


def tree(parents: list[int]) -> DraftTree:
    n = len(parents)
    return DraftTree(torch.arange(100, 100 + n), torch.tensor(parents), torch.ones(n))


def worker_full_mask(rows, seq_lens: list[int]) -> torch.Tensor:
    """SGLang's FULL layout as the worker (scheduler_patch/runtime/worker.py) writes it on GPUs: every prefix
    column visible, then the block."""
    return flatten_masks([with_prefix(m, n) for m, n in zip(rows.mask, seq_lens)])


def test_mixed_tree_sizes_padded_as_pack_trees_pads_them():
    # a 4-node tree, a lone root and a 2-chain, padded to width 4; padding nodes hang off the root
    seq_lens = [4, 0, 2]
    rows = pack_trees([tree([-1, 0, 1, 1]), tree([-1]), tree([-1, 0])], seq_lens)
    assert rows.width == 4 and rows.sizes.tolist() == [4, 1, 2]
    mask = full_layout(worker_full_mask(rows, seq_lens), seq_lens, rows.width, MaskLayout.FULL)
    slots = torch.arange(sum(seq_lens) + 3 * rows.width)
    masks, got_slots = flashinfer_reads(verify_csr(seq_lens, rows.width, slots, mask))
    assert masks[0].tolist() == [[T, T, T, T, T, F, F, F],
                                 [T, T, T, T, T, T, F, F],
                                 [T, T, T, T, T, T, T, F],
                                 [T, T, T, T, T, T, F, T]]  # fmt: skip
    assert masks[1].tolist() == [[T, F, F, F], [T, T, F, F], [T, F, T, F], [T, F, F, T]]  # root, 3 padding rows
    assert masks[2].tolist() == [[T, T, T, F, F, F],
                                 [T, T, T, T, F, F],
                                 [T, T, T, F, T, F],
                                 [T, T, T, F, F, T]]  # fmt: skip
    assert got_slots == [list(range(0, 8)), list(range(8, 12)), list(range(12, 18))]


def test_mixed_tree_sizes_in_the_workers_ragged_batch_read_their_own_rows_only():
    """The same three trees as the worker hands them to the forward (`verify_forward_input`): 4, 1 and 2 rows."""
    seq_lens = [4, 0, 2]
    rows = pack_trees([tree([-1, 0, 1, 1]), tree([-1]), tree([-1, 0])], seq_lens)
    verify = verify_forward_input(rows, seq_lens, prefix_columns=True)
    mask = full_layout(verify.mask, seq_lens, verify.sizes, MaskLayout.FULL)
    slots = torch.arange(sum(seq_lens) + sum(verify.sizes))
    csr = verify_csr(seq_lens, verify.sizes, slots, mask)
    assert csr.qo_indptr.tolist() == [0, 4, 5, 7] and csr.kv_indptr.tolist() == [0, 8, 9, 13]
    masks, got_slots = flashinfer_reads(csr)
    assert masks[0].tolist() == [[T, T, T, T, T, F, F, F],
                                 [T, T, T, T, T, T, F, F],
                                 [T, T, T, T, T, T, T, F],
                                 [T, T, T, T, T, T, F, T]]  # fmt: skip
    assert masks[1].tolist() == [[T]]  # the lone root: no padding rows
    assert masks[2].tolist() == [[T, T, T, F], [T, T, T, T]]
    assert got_slots == [list(range(0, 8)), [8], list(range(9, 13))]
    draft_only = verify_forward_input(rows, seq_lens, prefix_columns=False).mask
    assert torch.equal(full_layout(draft_only, seq_lens, verify.sizes, MaskLayout.DRAFT_ONLY), mask)


def test_draft_only_and_full_layouts_give_one_flashinfer_mask():
    seq_lens, n = [3, 1], 4
    rows = pack_trees([tree([-1, 0, 1, 0]), tree([-1, 0])], seq_lens)
    full = full_layout(worker_full_mask(rows, seq_lens), seq_lens, n, MaskLayout.FULL)
    draft_only = full_layout(rows.mask.flatten(), seq_lens, n, MaskLayout.DRAFT_ONLY)
    assert torch.equal(full, draft_only)
    masks, _ = flashinfer_reads(verify_csr(seq_lens, n, torch.arange(sum(seq_lens) + 2 * n), full))
    assert all(torch.equal(m, with_prefix(d, p)) for m, d, p in zip(masks, rows.mask, seq_lens))


def test_full_layout_is_a_view_of_a_full_bool_buffer_and_drops_graph_padding():
    buffer = torch.cat([with_prefix(chain_mask(2), 1).flatten(), torch.ones(5, dtype=torch.bool)])
    flat = full_layout(buffer, [1], 2, MaskLayout.FULL)
    assert flat.tolist() == [T, T, F, T, T, T] and flat.data_ptr() == buffer.data_ptr()
    with pytest.raises(ValueError, match="needs 6"):
        full_layout(buffer[:5], [1], 2, MaskLayout.FULL)


# --- key slots through a KV index table ---------------------------------------------------------------------


def test_table_slots_passthrough_rows():
    ids = torch.tensor([[9, 8, 7, 6], [1, 2, 3, 4], [5, 5, 5, 5]])
    table = SimpleNamespace(ids=ids, row_ids=torch.tensor([1, 0, 2]), entry_page_size=1, v2p=None)
    assert table_slots(table, [3, 2]).tolist() == [1, 2, 3, 9, 8]


def test_table_slots_expand_page_entries():
    # a page table (pages of 4): row 0 holds pages 3, 1 -> tokens 12..15 then 4..
    table = SimpleNamespace(ids=torch.tensor([[3, 1], [0, 0]]), row_ids=torch.tensor([0]), entry_page_size=4, v2p=None)
    assert table_slots(table, [6]).tolist() == [12, 13, 14, 15, 4, 5]


def test_table_slots_translate_virtual_ids_through_v2p():
    # virtual pages of 2: page 0 -> 5, page 1 -> 2; virtual tokens 0, 1, 2 -> 10, 11, 4; the sink (-1) reads page 0
    table = SimpleNamespace(ids=torch.tensor([[0, 1, 2, -1]]), row_ids=torch.tensor([0]), entry_page_size=1,
                            v2p=torch.tensor([5, 2]))
    assert table_slots(table, [4], v2p_page_size=2).tolist() == [10, 11, 4, 10]


def test_table_slots_with_sglangs_translator_on_cpu_pools():
    from sglang.srt.mem_cache.allocator import TokenToKVPoolAllocator
    from sglang.srt.mem_cache.kv_index_translator import KVIndexTranslator
    from sglang.srt.mem_cache.memory_pool import MHATokenToKVPool, ReqToTokenPool

    pool = MHATokenToKVPool(size=32, page_size=1, dtype=torch.bfloat16, head_num=1, head_dim=4, layer_num=1,
                            device="cpu", enable_memory_saver=False)
    req_to_token = ReqToTokenPool(size=3, max_context_len=8, device="cpu", enable_memory_saver=False).req_to_token
    allocator = TokenToKVPoolAllocator(32, torch.bfloat16, "cpu", pool, need_sort=False)
    req_to_token[2, :5] = allocator.alloc(5).to(req_to_token.dtype)
    req_to_token[0, :3] = allocator.alloc(3).to(req_to_token.dtype)
    translator = KVIndexTranslator(req_to_token=req_to_token, token_to_kv_pool_allocator=allocator,
                                   token_to_kv_pool=pool, page_size=1, device="cpu")
    table = translator.read_source(None, req_pool_indices=torch.tensor([2, 0]), bs=2)
    got = table_slots(table, [5, 3], translator.page_size)
    assert got.tolist() == req_to_token[2, :5].tolist() + req_to_token[0, :3].tolist()
