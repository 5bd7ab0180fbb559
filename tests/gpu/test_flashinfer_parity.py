"""FlashInfer tree attention (attention_backends.flashinfer_tree) against the torch reference and the dense-mask
oracle: random trees, GQA, fp16/bf16, page sizes 1 and 16, mixed tree sizes padded as `pack_trees` pads them, a
long prefix (FlashInfer splits the KV), hidden prefix columns. GPU only: imports neither sglang nor flashinfer at
module level."""

import pytest
import torch
from cases import HEAD_DIM, TOLERANCE, cache_shape, draft_tree, pages_needed, random_batch, random_tree

from attention_backends.mask import chain_mask, with_prefix
from attention_backends.oracle import dense_tree_attention
from attention_backends.paged import PagedTreeBatch, paged_tree_attention
from sgl_dspark.layout import pack_trees

pytestmark = pytest.mark.gpu


def check_against_oracle(draft_masks: list[torch.Tensor], prefix_lens: list[int], page_size: int,
                         dtype: torch.dtype, seed: int, q_heads: int = 8, kv_heads: int = 2) -> None:
    """FlashInfer == torch reference == dense oracle on one random paged batch."""
    from attention_backends.flashinfer_tree import tree_attention

    gen = torch.Generator().manual_seed(seed)
    scale = HEAD_DIM**-0.5
    kv_lens = [p + m.shape[0] for p, m in zip(prefix_lens, draft_masks)]
    num_pages = pages_needed(kv_lens, page_size) + 8
    batch, pages = random_batch(prefix_lens, draft_masks, page_size, num_pages, gen)
    shape = cache_shape(num_pages, page_size, kv_heads)
    k_cache = (torch.randn(shape, generator=gen) * 2).to("cuda", dtype)
    v_cache = torch.randn(shape, generator=gen).to("cuda", dtype)
    q = (torch.randn(int(batch.qo_indptr[-1]), q_heads, HEAD_DIM, generator=gen) * 2).to("cuda", dtype)

    got = tree_attention(q, k_cache, v_cache, batch, scale).float()
    reference = paged_tree_attention(q.float(), k_cache.float(), v_cache.float(), batch, scale)
    oracle = dense_tree_attention(q.float(), k_cache.float(), v_cache.float(), batch.qo_indptr.tolist(), pages,
                                  batch.kv_lens, list(batch.masks), scale, page_size)
    torch.testing.assert_close(reference, oracle, atol=1e-4, rtol=1e-4)
    torch.testing.assert_close(got, oracle, atol=TOLERANCE[dtype], rtol=TOLERANCE[dtype])


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
@pytest.mark.parametrize("page_size", [1, 16])
def test_random_trees_match_the_oracle(dtype, page_size):
    gen = torch.Generator().manual_seed(page_size)
    n = 6
    draft_masks = [random_tree(n, gen), chain_mask(n), random_tree(n, gen), torch.eye(n, dtype=torch.bool)]
    check_against_oracle(draft_masks, [0, 37, 100, 250], page_size, dtype, seed=page_size)


@pytest.mark.parametrize("page_size", [1, 16])
def test_mixed_tree_sizes_padded_by_pack_trees(page_size):
    """Trees of 7, 1, 4 and 3 nodes in one verify batch: every request gets 7 rows, padding rows off the root."""
    gen = torch.Generator().manual_seed(11)
    prefix_lens = [0, 37, 100, 250]
    rows = pack_trees([draft_tree(n, gen) for n in (7, 1, 4, 3)], prefix_lens)
    assert rows.width == 7 and rows.sizes.tolist() == [7, 1, 4, 3]
    check_against_oracle(list(rows.mask), prefix_lens, page_size, torch.bfloat16, seed=page_size)


@pytest.mark.parametrize("page_size", [1, 16])
def test_long_prefix_split_kv(page_size):
    """Two requests with long prefixes and few rows: FlashInfer splits each request's KV across CTAs and merges."""
    gen = torch.Generator().manual_seed(3)
    draft_masks = [random_tree(8, gen), random_tree(5, gen)]
    check_against_oracle(draft_masks, [16_000, 3_001], page_size, torch.bfloat16, seed=page_size)


def test_hidden_prefix_columns_are_honoured():
    """The FULL layout may hide prefix keys too; FlashInfer must read the whole row, not just the draft part."""
    from attention_backends.flashinfer_tree import tree_attention

    gen = torch.Generator().manual_seed(0)
    n, prefix, heads = 4, 20, 4
    mask = with_prefix(chain_mask(n), prefix)
    mask[:, : prefix // 2] = False
    slots = torch.randperm(64, generator=gen)[: prefix + n]
    batch = PagedTreeBatch.from_token_slots([slots], [mask])
    k_cache, v_cache, q = (torch.randn(shape, generator=gen).to("cuda", torch.float16)
                           for shape in ((64, heads, HEAD_DIM), (64, heads, HEAD_DIM), (n, heads, HEAD_DIM)))
    got = tree_attention(q, k_cache, v_cache, batch, HEAD_DIM**-0.5).float()
    want = paged_tree_attention(q.float(), k_cache.float(), v_cache.float(), batch, HEAD_DIM**-0.5)
    torch.testing.assert_close(got, want, atol=5e-3, rtol=5e-3)
