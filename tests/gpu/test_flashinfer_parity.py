"""FlashInfer tree attention (attention_backends.flashinfer_tree) against the torch reference and the dense-mask
oracle, on random paged KV with tree masks. GPU only: imports neither sglang nor flashinfer at module level."""

import pytest
import torch

from attention_backends.mask import chain_mask, with_prefix
from attention_backends.oracle import dense_tree_attention
from attention_backends.paged import PagedTreeBatch, paged_tree_attention

pytestmark = pytest.mark.gpu

TOLERANCE = {torch.float16: 5e-3, torch.bfloat16: 3e-2}


def ancestor_mask(parents: list[int]) -> torch.Tensor:
    """parents [n] (root -1) -> bool [n, n]: each node sees itself and its ancestors."""
    mask = torch.eye(len(parents), dtype=torch.bool)
    for i, parent in enumerate(parents):
        if parent >= 0:
            mask[i] |= mask[parent]
    return mask


def random_tree(n: int, gen: torch.Generator) -> torch.Tensor:
    return ancestor_mask([-1] + [int(torch.randint(0, i, (1,), generator=gen)) for i in range(1, n)])


def random_batch(prefix_lens: list[int], n: int, page_size: int, num_pages: int, gen: torch.Generator,
                 draft_masks: list[torch.Tensor]) -> tuple[PagedTreeBatch, list[list[int]]]:
    """Requests with `prefix_lens` cached keys plus n verify rows, each on random distinct pages."""
    kv_lens = [p + n for p in prefix_lens]
    free = torch.randperm(num_pages, generator=gen).tolist()
    pages = [[free.pop() for _ in range(-(-kv_len // page_size))] for kv_len in kv_lens]
    counts = torch.tensor([0] + [len(p) for p in pages])
    batch = PagedTreeBatch(
        qo_indptr=torch.arange(0, n * (len(prefix_lens) + 1), n, dtype=torch.int32),
        kv_indptr=counts.cumsum(0).to(torch.int32),
        kv_indices=torch.tensor([x for p in pages for x in p], dtype=torch.int32),
        kv_last_page_len=torch.tensor([kv - (len(p) - 1) * page_size for kv, p in zip(kv_lens, pages)],
                                      dtype=torch.int32),
        masks=tuple(with_prefix(m, p) for m, p in zip(draft_masks, prefix_lens)), page_size=page_size,
    )  # fmt: skip
    return batch, pages


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
@pytest.mark.parametrize("page_size", [1, 16])
def test_flashinfer_tree_attention_matches_reference(dtype, page_size):
    pytest.importorskip("flashinfer")
    from attention_backends.flashinfer_tree import tree_attention

    gen = torch.Generator().manual_seed(page_size)
    q_heads, kv_heads, dim, n, scale = 8, 2, 128, 6, 128**-0.5
    prefix_lens = [0, 37, 100, 250]
    draft_masks = [random_tree(n, gen), chain_mask(n), random_tree(n, gen), torch.eye(n, dtype=torch.bool)]
    num_pages = sum(-(-(p + n) // page_size) for p in prefix_lens) + 8
    batch, pages = random_batch(prefix_lens, n, page_size, num_pages, gen, draft_masks)
    cache_shape = (num_pages, kv_heads, dim) if page_size == 1 else (num_pages, page_size, kv_heads, dim)
    k_cache = (torch.randn(cache_shape, generator=gen) * 2).to("cuda", dtype)
    v_cache = torch.randn(cache_shape, generator=gen).to("cuda", dtype)
    q = (torch.randn(n * len(prefix_lens), q_heads, dim, generator=gen) * 2).to("cuda", dtype)

    got = tree_attention(q, k_cache, v_cache, batch, scale).float()
    reference = paged_tree_attention(q.float(), k_cache.float(), v_cache.float(), batch, scale)
    oracle = dense_tree_attention(q.float(), k_cache.float(), v_cache.float(), batch.qo_indptr.tolist(), pages,
                                  batch.kv_lens, list(batch.masks), scale, page_size)
    torch.testing.assert_close(reference, oracle, atol=1e-4, rtol=1e-4)
    torch.testing.assert_close(got, reference, atol=TOLERANCE[dtype], rtol=TOLERANCE[dtype])


def test_flashinfer_honours_masked_prefix_columns():
    """The FULL layout may hide prefix keys too; FlashInfer must read the whole row, not just the draft part."""
    pytest.importorskip("flashinfer")
    from attention_backends.flashinfer_tree import tree_attention

    gen = torch.Generator().manual_seed(0)
    n, prefix, heads, dim = 4, 20, 4, 64
    mask = with_prefix(chain_mask(n), prefix)
    mask[:, : prefix // 2] = False
    slots = torch.randperm(64, generator=gen)[: prefix + n]
    batch = PagedTreeBatch.from_token_slots([slots], [mask])
    k_cache = torch.randn(64, heads, dim, generator=gen).to("cuda", torch.float16)
    v_cache = torch.randn(64, heads, dim, generator=gen).to("cuda", torch.float16)
    q = torch.randn(n, heads, dim, generator=gen).to("cuda", torch.float16)

    got = tree_attention(q, k_cache, v_cache, batch, dim**-0.5).float()
    want = paged_tree_attention(q.float(), k_cache.float(), v_cache.float(), batch, dim**-0.5)
    torch.testing.assert_close(got, want, atol=5e-3, rtol=5e-3)
