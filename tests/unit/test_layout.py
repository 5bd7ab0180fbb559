"""Verify-row layout: trees packed into fixed-width rows with the tree mask, accepted paths unpacked."""

import torch

from sgl_dspark.layout import AcceptRows, accept_rows, kv_moves, pack_trees, padded, verify_forward_input
from sgl_dspark.tree import DraftTree
from sgl_dspark.verify import VerifyResult


def tree(tokens, parents):
    n = len(tokens)
    return DraftTree(torch.tensor(tokens), torch.tensor(parents), torch.ones(n))


def test_pack_pads_each_request_to_the_width_with_nodes_off_the_root():
    rows = pack_trees([tree([5, 6, 7], [-1, 0, 0]), tree([9], [-1])], seq_lens=[10, 3])
    assert rows.width == 3
    assert rows.tokens.tolist() == [5, 6, 7, 9, 9, 9]
    assert rows.positions.tolist() == [10, 11, 11, 3, 4, 4]
    assert rows.sizes.tolist() == [3, 1]
    assert rows.mask.int().tolist() == [
        [[1, 0, 0], [1, 1, 0], [1, 0, 1]],
        [[1, 0, 0], [1, 1, 0], [1, 0, 1]],
    ]


def test_pack_chain_mask_is_causal_and_width_can_be_fixed():
    rows = pack_trees([tree([1, 2, 3], [-1, 0, 1])], seq_lens=[4], width=4)
    assert rows.mask[0].int().tolist() == [[1, 0, 0, 0], [1, 1, 0, 0], [1, 1, 1, 0], [1, 0, 0, 1]]
    assert rows.positions.tolist() == [4, 5, 6, 5]


def test_accept_rows_keep_root_and_path_and_emit_drafts_then_bonus():
    results = [VerifyResult(torch.tensor([2, 3]), torch.tensor([7, 8]), bonus_token=4, last_node=3),
               VerifyResult(torch.tensor([], dtype=torch.long), torch.tensor([], dtype=torch.long), 11, 0)]
    out = accept_rows(results, width=4, stride=5)
    assert out.accept_index.tolist() == [[0, 2, 3, -1], [4, -1, -1, -1]]
    assert out.tokens.tolist() == [[7, 8, 4, 0, 0], [11, 0, 0, 0, 0]]
    assert out.accept_lens.tolist() == [3, 1]


def test_kv_moves_only_rows_off_the_front():
    """Request 0 kept tree rows [0, 2, 3] (two move forward); request 1 a chain prefix (in place, no move)."""
    accepted = AcceptRows(torch.tensor([[0, 2, 3, -1], [4, 5, -1, -1]]), torch.zeros(2, 5, dtype=torch.long),
                          torch.tensor([3, 2], dtype=torch.int32))
    dst, src = kv_moves(accepted, width=4)
    assert dst.tolist() == [1, 2] and src.tolist() == [2, 3]
    chain = AcceptRows(torch.tensor([[0, 1, -1], [3, -1, -1]]), torch.zeros(2, 3, dtype=torch.long),
                       torch.tensor([2, 1], dtype=torch.int32))
    assert [t.tolist() for t in kv_moves(chain, width=3)] == [[], []]


def test_the_verify_forward_input_runs_the_real_rows_alone_without_prefix_columns():
    rows = pack_trees([tree([5, 6], [-1, 0]), tree([9], [-1])], seq_lens=[3, 1])
    batch = verify_forward_input(rows, [3, 1], prefix_columns=False)
    assert batch.tokens.tolist() == [5, 6, 9] and batch.positions.tolist() == [3, 4, 1]  # no padding row
    assert batch.sizes == (2, 1) and batch.width == 2 and batch.real.tolist() == [0, 1, 2]
    assert batch.mask.int().tolist() == [1, 0, 1, 1,  # chain 5 -> 6
                                         1]  # anchor 9 alone


def test_the_verify_forward_input_puts_the_prefix_columns_first_when_asked():
    rows = pack_trees([tree([9], [-1]), tree([5, 6], [-1, 0])], seq_lens=[1, 3])
    batch = verify_forward_input(rows, [1, 3], prefix_columns=True)
    assert batch.real.tolist() == [0, 2, 3]  # request 0's padding row (flat row 1) left out
    assert batch.mask.int().tolist() == [1, 1,  # 1 cached token, then the anchor
                                         1, 1, 1, 1, 0, 1, 1, 1, 1, 1]  # 3 cached tokens, then the block


def test_padded_puts_the_real_rows_back_in_the_fixed_width():
    rows = pack_trees([tree([9], [-1]), tree([5, 6], [-1, 0])], seq_lens=[1, 3])
    values = torch.tensor([[1.0], [2.0], [3.0]])
    assert padded(values, rows.real, rows.tokens.shape[0]).tolist() == [[1.0], [0.0], [2.0], [3.0]]
    full = torch.ones(4, 2)
    assert padded(full, rows.real, 4) is full  # already in the width (every request as wide as the widest)
