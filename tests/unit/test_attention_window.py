"""Sliding-window verify masks: literal cases, SGLang's own window mask for a chain, and windowed tree attention
through the paged torch reference against the dense oracle with the window written out position by position."""

import pytest
import torch

from attention_backends.mask import chain_mask, with_prefix
from attention_backends.oracle import dense_attention
from attention_backends.paged import PagedTreeBatch, paged_tree_attention
from attention_backends.window import (key_positions, layer_window, row_positions, window_keep, windowed_mask,
                                       windowed_masks)
from sgl_dspark.tree import ancestor_mask, position_ids

T, F = True, False


def bools(rows: list[list[int]]) -> torch.Tensor:
    return torch.tensor(rows, dtype=torch.bool)


def test_layer_window_reads_sglang_attribute():
    assert [layer_window(w) for w in (511, 0, -1, None)] == [511, 0, None, None]


def test_row_positions_of_a_tree_are_prefix_plus_depth():
    mask = with_prefix(ancestor_mask(torch.tensor([-1, 0, 0, 1])), 5)
    assert row_positions(mask, 5).tolist() == [5, 6, 6, 7]
    assert key_positions(torch.tensor([5, 6, 6, 7]), 2).tolist() == [0, 1, 5, 6, 6, 7]


def test_window_keep_is_inclusive_of_the_lower_edge():
    assert window_keep(torch.tensor([3]), torch.arange(4), 2).tolist() == [[F, T, T, T]]
    assert window_keep(torch.tensor([3]), torch.arange(4), 0).tolist() == [[F, F, F, T]]


def test_windowed_chain_literal():
    mask = with_prefix(chain_mask(2), 3)  # rows at positions 3, 4
    assert windowed_mask(mask, 3, 1).tolist() == [[F, F, T, T, F], [F, F, F, T, T]]
    assert torch.equal(windowed_mask(mask, 3, None), mask)
    assert torch.equal(windowed_mask(mask, 3, 10), mask)


def test_windowed_tree_keeps_siblings_apart():
    # root at 2, children 1 and 2 at 3, node 3 (child of 1) at 4; window 1
    mask = with_prefix(ancestor_mask(torch.tensor([-1, 0, 0, 1])), 2)
    assert windowed_mask(mask, 2, 1).tolist() == [
        [F, T, T, F, F, F],
        [F, F, T, T, F, F],
        [F, F, T, F, T, F],
        [F, F, F, T, F, T],
    ]


@pytest.mark.parametrize("prefix, n, window", [(0, 4, 2), (6, 3, 4), (9, 5, 3), (4, 4, 0)])
def test_chain_matches_sglang_torch_native_window(prefix, n, window):
    """A verify chain must see exactly what plain decoding sees at the same positions (SGLang's own mask)."""
    from sglang.srt.layers.attention.torch_native_backend import TorchNativeAttnBackend

    sglang = TorchNativeAttnBackend._make_sliding_window_mask(
        q_len=n, kv_len=prefix + n, sliding_window_size=window, device=torch.device("cpu"), query_offset=prefix)
    assert torch.equal(windowed_mask(with_prefix(chain_mask(n), prefix), prefix, window), sglang)


def oracle_mask(parents: torch.Tensor, prefix_len: int, window: int | None) -> torch.Tensor:
    """Written out key by key from positions: a prefix key j when j >= p - W; a tree key when it is an ancestor
    (or self) at a position >= p - W."""
    n = parents.shape[0]
    pos = position_ids(parents, prefix_len).tolist()
    lo = [p - window if window is not None else -1 for p in pos]
    anc = ancestor_mask(parents)
    out = torch.zeros(n, prefix_len + n, dtype=torch.bool)
    for i in range(n):
        for j in range(prefix_len):
            out[i, j] = j >= lo[i]
        for j in range(n):
            out[i, prefix_len + j] = bool(anc[i, j]) and pos[j] >= lo[i]
    return out


@pytest.mark.parametrize("window", [None, 0, 3, 7, 100])
def test_windowed_tree_attention_matches_dense_oracle(window):
    torch.manual_seed(0)
    trees = [torch.tensor([-1, 0, 0, 1, 3]), torch.tensor([-1, 0, 1, 2]), torch.tensor([-1])]
    prefix_lens = [6, 9, 2]
    heads, kv_heads, dim, slots_total = 4, 2, 8, 64
    k_cache = torch.randn(slots_total, kv_heads, dim)
    v_cache = torch.randn(slots_total, kv_heads, dim)
    perm = torch.randperm(slots_total)
    masks, slots, start = [], [], 0
    for parents, prefix in zip(trees, prefix_lens):
        kv = prefix + parents.shape[0]
        masks.append(with_prefix(ancestor_mask(parents), prefix))
        slots.append(perm[start:start + kv])
        start += kv
    q = torch.randn(sum(t.shape[0] for t in trees), heads, dim)
    batch = PagedTreeBatch.from_token_slots(slots, windowed_masks(masks, prefix_lens, window))
    got = paged_tree_attention(q, k_cache, v_cache, batch, scale=dim ** -0.5)
    rows = 0
    for parents, prefix, s in zip(trees, prefix_lens, slots):
        n = parents.shape[0]
        want = dense_attention(q[rows:rows + n], k_cache[s], v_cache[s], oracle_mask(parents, prefix, window),
                               dim ** -0.5)
        torch.testing.assert_close(got[rows:rows + n], want, rtol=1e-5, atol=1e-5)
        rows += n
