"""The torch reference attention path: SGLang's verify-mask layouts as literal cases, the paged torch reference
and the dspark_torch backend against the dense-mask oracle, and the registration patch."""

from types import SimpleNamespace

import pytest
import torch

from attention_backends.mask import (ROW_COUNTS, MaskLayout, chain_mask, dense_verify_masks, flatten_masks,
                                     layout_numel, row_counts, with_prefix)
from attention_backends.oracle import dense_attention, dense_tree_attention
from attention_backends.paged import PagedTreeBatch, paged_tree_attention
from sgl_dspark.tree import ancestor_mask, random_parents

T, F = True, False


def bools(rows: list[list[int]]) -> torch.Tensor:
    return torch.tensor(rows, dtype=torch.bool)


# --- masks ------------------------------------------------------------------------------------------------


def test_chain_mask_is_lower_triangular():
    assert chain_mask(3).tolist() == [[T, F, F], [T, T, F], [T, T, T]]


def test_with_prefix_prepends_visible_prefix_columns():
    assert with_prefix(bools([[1, 0], [1, 1]]), 2).tolist() == [[T, T, T, F], [T, T, T, T]]
    assert with_prefix(bools([[1]]), 0).tolist() == [[T]]


def test_layout_numel():
    assert layout_numel(MaskLayout.DRAFT_ONLY, [1, 2], 2) == 8
    assert layout_numel(MaskLayout.FULL, [1, 2], 2) == 2 * 3 + 8
    assert layout_numel(MaskLayout.DRAFT_ONLY, [1, 2], [3, 1]) == 9 + 1  # ragged: 3 rows, then 1
    assert layout_numel(MaskLayout.FULL, [1, 2], [3, 1]) == 3 * 4 + 1 * 3
    assert row_counts(2, 3) == [2, 2, 2] and row_counts([1, 3], 2) == [1, 3]
    with pytest.raises(ValueError, match="3 verify row counts for a batch of 2"):
        row_counts([1, 2, 3], 2)


def test_draft_only_layout_two_requests():
    # request 0: chain of 2 after a 1-token prefix; request 1: two siblings after a 2-token prefix
    flat = torch.tensor([1, 0, 1, 1,
                         1, 0, 0, 1], dtype=torch.bool)  # fmt: skip
    m0, m1 = dense_verify_masks(flat, [1, 2], 2, MaskLayout.DRAFT_ONLY)
    assert m0.tolist() == [[T, T, F], [T, T, T]]
    assert m1.tolist() == [[T, T, T, F], [T, T, F, T]]


def test_full_layout_two_requests():
    # same batch, FULL layout: [2, 1 + 2] then [2, 2 + 2], prefix columns included
    flat = torch.tensor([1, 1, 0,  1, 1, 1,
                         1, 1, 1, 0,  1, 1, 0, 1], dtype=torch.bool)  # fmt: skip
    m0, m1 = dense_verify_masks(flat, [1, 2], 2, MaskLayout.FULL)
    assert m0.tolist() == [[T, T, F], [T, T, T]]
    assert m1.tolist() == [[T, T, T, F], [T, T, F, T]]


def test_full_layout_keeps_masked_prefix_columns():
    flat = torch.tensor([0, 1, 0, 1, 1, 1], dtype=torch.bool)
    (m0,) = dense_verify_masks(flat, [1], 2, MaskLayout.FULL)
    assert m0.tolist() == [[F, T, F], [T, T, T]]


def test_padded_buffer_tail_is_ignored_and_short_buffer_raises():
    flat = torch.tensor([1, 0, 1, 1, 1, 1, 1, 1], dtype=torch.bool)  # one request of 2, padded by 4
    (m0,) = dense_verify_masks(flat, [3], 2, MaskLayout.DRAFT_ONLY)
    assert m0.tolist() == [[T, T, T, T, F], [T, T, T, T, T]]
    with pytest.raises(ValueError, match="needs 8"):
        dense_verify_masks(flat[:6], [0, 0], 2, MaskLayout.DRAFT_ONLY)


def test_layouts_agree_and_flatten_round_trips():
    tree = ancestor_mask(torch.tensor([-1, 0, 0, 1]))  # [4, 4]
    prefix_lens = [3, 1]
    draft_only = torch.cat([tree.reshape(-1), chain_mask(4).reshape(-1)])
    masks = dense_verify_masks(draft_only, prefix_lens, 4, MaskLayout.DRAFT_ONLY)
    full = flatten_masks(masks)
    assert full.numel() == layout_numel(MaskLayout.FULL, prefix_lens, 4)
    again = dense_verify_masks(full, prefix_lens, 4, MaskLayout.FULL)
    assert all(torch.equal(a, b) for a, b in zip(masks, again))
    assert masks[0][3].tolist() == [T, T, T, T, T, F, T]  # node 3 sees the prefix, root, node 1, itself


# --- paged torch reference vs the dense oracle ------------------------------------------------------------


def test_kv_slots_follow_pages_and_last_page_len():
    batch = PagedTreeBatch(
        qo_indptr=torch.tensor([0, 1, 3], dtype=torch.int32), kv_indptr=torch.tensor([0, 2, 3], dtype=torch.int32),
        kv_indices=torch.tensor([5, 1, 2], dtype=torch.int32), kv_last_page_len=torch.tensor([1, 2], dtype=torch.int32),
        masks=(torch.ones(1, 3, dtype=torch.bool), torch.ones(2, 2, dtype=torch.bool)), page_size=2,
    )  # fmt: skip
    assert [s.tolist() for s in batch.kv_slots] == [[10, 11, 2], [4, 5]]
    assert batch.q_lens == [1, 2] and batch.kv_lens == [3, 2]


def test_batch_rejects_mask_of_wrong_shape():
    with pytest.raises(ValueError, match="mask 0"):
        PagedTreeBatch.from_token_slots([torch.arange(3)], [torch.ones(2, 4, dtype=torch.bool)])


def random_tree_mask(n: int, gen: torch.Generator) -> torch.Tensor:
    return ancestor_mask(torch.tensor(random_parents(n, gen)))


@pytest.mark.parametrize("page_size", [1, 3])
def test_paged_tree_attention_matches_oracle(page_size):
    gen = torch.Generator().manual_seed(page_size)
    q_heads, kv_heads, dim, n = 6, 2, 8, 4
    prefix_lens = [5, 0, 9]
    kv_lens = [p + n for p in prefix_lens]
    num_pages = 40
    k_cache = torch.randn(num_pages, page_size, kv_heads, dim, generator=gen)
    v_cache = torch.randn(num_pages, page_size, kv_heads, dim, generator=gen)
    free = torch.randperm(num_pages, generator=gen).tolist()
    pages = [[free.pop() for _ in range(-(-kv_len // page_size))] for kv_len in kv_lens]
    masks = [with_prefix(random_tree_mask(n, gen), p) for p in prefix_lens]
    q = torch.randn(n * len(prefix_lens), q_heads, dim, generator=gen)
    batch = PagedTreeBatch(
        qo_indptr=torch.arange(0, n * (len(prefix_lens) + 1), n, dtype=torch.int32),
        kv_indptr=torch.tensor([0, *torch.tensor([len(p) for p in pages]).cumsum(0).tolist()], dtype=torch.int32),
        kv_indices=torch.tensor([x for p in pages for x in p], dtype=torch.int32),
        kv_last_page_len=torch.tensor([kv - (len(p) - 1) * page_size for kv, p in zip(kv_lens, pages)],
                                      dtype=torch.int32),
        masks=tuple(masks), page_size=page_size,
    )  # fmt: skip
    got = paged_tree_attention(q, k_cache, v_cache, batch, scale=0.3)
    want = dense_tree_attention(q, k_cache, v_cache, batch.qo_indptr.tolist(), pages, kv_lens, masks, 0.3, page_size)
    torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)


def test_oracle_chain_row_equals_plain_causal_attention():
    gen = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(4, 2, 8, generator=gen) for _ in range(3))
    got = dense_attention(q, k, v, chain_mask(4), scale=0.5)
    want = torch.nn.functional.scaled_dot_product_attention(q.movedim(0, 1), k.movedim(0, 1), v.movedim(0, 1),
                                                            is_causal=True, scale=0.5).movedim(1, 0)
    torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)


def test_oracle_soft_cap_bounds_the_logits():
    # one query, two keys with logits 3 and -3 (scale 1): a cap of 1 makes them tanh(3) and tanh(-3)
    q = torch.tensor([[[1.0]]])
    k = torch.tensor([[[3.0]], [[-3.0]]])
    v = torch.tensor([[[1.0]], [[0.0]]])
    mask = torch.ones(1, 2, dtype=torch.bool)
    capped = torch.tensor([3.0, -3.0]).tanh().softmax(0)[0]
    assert dense_attention(q, k, v, mask, 1.0, logits_soft_cap=1.0).item() == pytest.approx(capped.item())
    assert dense_attention(q, k, v, mask, 1.0).item() == pytest.approx(torch.tensor([3.0, -3.0]).softmax(0)[0].item())


# --- the dspark_torch SGLang backend ----------------------------------------------------------------------


class FakeKVPool:
    """The three methods of SGLang's token_to_kv_pool that the torch backends call."""

    def __init__(self, slots: int, kv_heads: int, dim: int, gen: torch.Generator):
        self.k = torch.randn(slots, kv_heads, dim, generator=gen)
        self.v = torch.randn(slots, kv_heads, dim, generator=gen)

    def set_kv_buffer(self, layer, loc, k, v):
        self.k[loc.loc] = k.view(-1, *self.k.shape[1:])
        self.v[loc.loc] = v.view(-1, *self.v.shape[1:])

    def get_key_buffer(self, layer_id):
        return self.k

    def get_value_buffer(self, layer_id):
        return self.v


def make_layer(q_heads: int, kv_heads: int, dim: int, scale: float):
    from sglang.srt.layers.radix_attention import AttentionType

    return SimpleNamespace(tp_q_head_num=q_heads, tp_k_head_num=kv_heads, qk_head_dim=dim, v_head_dim=dim,
                           head_dim=dim, layer_id=0, scaling=scale, is_cross_attention=False,
                           attn_type=AttentionType.DECODER, sliding_window_size=-1, logit_cap=0.0)


@pytest.mark.parametrize("layout", [MaskLayout.DRAFT_ONLY, MaskLayout.FULL])
@pytest.mark.parametrize("counts", [None, [4, 1], [2, 4]])
def test_backend_target_verify_matches_oracle_and_writes_kv(layout, counts):
    """Two requests of 4 verify rows each (SGLang's uniform batch, counts None), or ragged as the dspark worker hands
    them (the spec info's ROW_COUNTS): each request's own rows, its keys its prefix and those rows."""
    from sglang.srt.model_executor.forward_batch_info import ForwardMode

    from attention_backends.reference import TreeTorchNativeAttnBackend

    gen = torch.Generator().manual_seed(7)
    q_heads, kv_heads, dim, n, scale = 6, 2, 8, 4, 0.25
    sizes = counts or [n, n]
    prefix_lens, pool_rows = [3, 6], [2, 0]
    pool = FakeKVPool(32, kv_heads, dim, gen)
    req_to_token = torch.zeros(3, 16, dtype=torch.int64)
    free = torch.randperm(32, generator=gen).tolist()
    for row, p in zip(pool_rows, prefix_lens):
        req_to_token[row, :p + n] = torch.tensor([free.pop() for _ in range(p + n)])
    runner = SimpleNamespace(device="cpu", req_to_token_pool=SimpleNamespace(req_to_token=req_to_token),
                             token_to_kv_pool=pool)
    backend = TreeTorchNativeAttnBackend(runner, mask_layout=layout)

    drafts = [random_tree_mask(sizes[0], gen), chain_mask(sizes[1])]
    dense = [with_prefix(m, p) for m, p in zip(drafts, prefix_lens)]
    draft_only = layout is MaskLayout.DRAFT_ONLY
    custom_mask = torch.cat([m.reshape(-1) for m in drafts]) if draft_only else flatten_masks(dense)
    out_cache_loc = torch.cat([req_to_token[row, p:p + c] for row, p, c in zip(pool_rows, prefix_lens, sizes)])
    seq_lens = torch.tensor(prefix_lens)
    spec_info = SimpleNamespace(draft_token_num=n, custom_mask=custom_mask)
    if counts is not None:
        setattr(spec_info, ROW_COUNTS, counts)
    batch = SimpleNamespace(forward_mode=ForwardMode.TARGET_VERIFY, seq_lens=seq_lens, seq_lens_cpu=seq_lens,
                            req_pool_indices=torch.tensor(pool_rows), out_cache_loc=out_cache_loc, encoder_lens=None,
                            spec_info=spec_info)
    total = sum(sizes)
    q = torch.randn(total, q_heads * dim, generator=gen)
    k = torch.randn(total, kv_heads * dim, generator=gen)
    v = torch.randn(total, kv_heads * dim, generator=gen)
    prefix_kv = [(pool.k[req_to_token[row, :p]].clone(), pool.v[req_to_token[row, :p]].clone())
                 for row, p in zip(pool_rows, prefix_lens)]

    backend.init_forward_metadata(batch)
    got = backend.forward(q, k, v, make_layer(q_heads, kv_heads, dim, scale), batch)

    torch.testing.assert_close(pool.k[out_cache_loc], k.view(-1, kv_heads, dim))
    torch.testing.assert_close(pool.v[out_cache_loc], v.view(-1, kv_heads, dim))
    start = 0
    for (pk, pv), mask, c in zip(prefix_kv, dense, sizes):
        rows = slice(start, start + c)
        start += c
        keys = torch.cat([pk, k[rows].view(c, kv_heads, dim)])
        values = torch.cat([pv, v[rows].view(c, kv_heads, dim)])
        want = dense_attention(q[rows].view(c, q_heads, dim), keys, values, mask, scale)
        torch.testing.assert_close(got[rows].view(c, q_heads, dim), want, atol=1e-5, rtol=1e-5)


def test_backend_chain_verify_equals_torch_native_extend():
    """A chain verify of n tokens is exactly a causal extend of those n tokens after the same prefix."""
    from sglang.srt.model_executor.forward_batch_info import ForwardMode

    from attention_backends.reference import TreeTorchNativeAttnBackend

    gen = torch.Generator().manual_seed(3)
    q_heads, kv_heads, dim, n, p = 4, 2, 8, 3, 5
    req_to_token = torch.arange(16).view(1, 16)
    pool = FakeKVPool(16, kv_heads, dim, gen)
    runner = SimpleNamespace(device="cpu", req_to_token_pool=SimpleNamespace(req_to_token=req_to_token),
                             token_to_kv_pool=pool)
    backend = TreeTorchNativeAttnBackend(runner, mask_layout=MaskLayout.DRAFT_ONLY)
    layer = make_layer(q_heads, kv_heads, dim, 0.35)
    q, k, v = (torch.randn(n, h * dim, generator=gen) for h in (q_heads, kv_heads, kv_heads))
    common = dict(req_pool_indices=torch.tensor([0]), out_cache_loc=torch.arange(p, p + n), encoder_lens=None)
    verify = SimpleNamespace(forward_mode=ForwardMode.TARGET_VERIFY, seq_lens=torch.tensor([p]),
                             seq_lens_cpu=torch.tensor([p]), **common,
                             spec_info=SimpleNamespace(draft_token_num=n, custom_mask=chain_mask(n).reshape(-1)))
    extend = SimpleNamespace(forward_mode=ForwardMode.EXTEND, seq_lens=torch.tensor([p + n]),
                             extend_prefix_lens=torch.tensor([p]), extend_seq_lens=torch.tensor([n]), **common)
    backend.init_forward_metadata(verify)
    got = backend.forward(q, k, v, layer, verify)
    backend.init_forward_metadata(extend)
    assert backend.verify is None
    want = backend.forward(q, k, v, layer, extend)
    torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)


def test_backend_refuses_soft_capped_layers():
    from attention_backends.reference import check_verify_layer

    layer = make_layer(2, 2, 8, 0.3)
    layer.logit_cap = 30.0
    with pytest.raises(NotImplementedError, match="soft-capping"):
        check_verify_layer(layer)


def test_sglang_mask_layout_is_one_of_ours():
    from attention_backends.reference import sglang_mask_layout

    assert sglang_mask_layout() in (MaskLayout.DRAFT_ONLY, MaskLayout.FULL)


# --- registration -----------------------------------------------------------------------------------------


def test_register_is_idempotent_and_undoable():
    from sglang.srt.arg_groups.choices import ATTENTION_BACKEND_CHOICES, DRAFT_ATTENTION_BACKEND_CHOICES
    from sglang.srt.layers.attention.attention_registry import ATTENTION_BACKENDS

    from scheduler_patch.backends import FACTORIES, register_attention_backends, unregister_attention_backends

    before = (list(ATTENTION_BACKEND_CHOICES), list(DRAFT_ATTENTION_BACKEND_CHOICES), dict(ATTENTION_BACKENDS))
    try:
        register_attention_backends()
        register_attention_backends()
        for name, factory in FACTORIES.items():
            assert ATTENTION_BACKENDS[name] is factory
            assert ATTENTION_BACKEND_CHOICES.count(name) == 1
            assert DRAFT_ATTENTION_BACKEND_CHOICES.count(name) == 1
    finally:
        unregister_attention_backends()
    assert (ATTENTION_BACKEND_CHOICES, DRAFT_ATTENTION_BACKEND_CHOICES, ATTENTION_BACKENDS) == before


def test_register_fails_loudly_on_drift(monkeypatch):
    import sglang.srt.arg_groups.choices as choices

    from scheduler_patch.backends import register_attention_backends

    monkeypatch.setattr(choices, "add_attention_backend_choices", lambda names: None)
    with pytest.raises(RuntimeError, match="add_attention_backend_choices"):
        register_attention_backends()
