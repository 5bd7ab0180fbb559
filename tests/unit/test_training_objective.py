"""The training objective: block layout, anchors, the packed block pass and the DSpark loss."""

import torch

from sgl_dspark.drafter.context import PaddedContext
from fixture_drafters import tiny_hf_config
from sgl_dspark.drafter.fresh import random_drafter
from sgl_dspark.training.objective import (LossWeights, SparseTarget, accepted_length, block_rows, draft_index,
                                           dspark_loss, packed_block_hidden, sample_anchors, with_tokens)


def test_block_rows_layout_and_teacher_forced_tokens():
    ids = torch.tensor([10, 11, 12, 13, 14])
    blocks = with_tokens(block_rows(torch.tensor([1, 3]), length=5, gamma=3), ids)
    assert blocks.rows.tolist() == [[1, 2, 3], [3, 4, 4]]  # logit row a+k-1 predicts position a+k
    assert blocks.prev.tolist() == [[11, 12, 13], [13, 14, 14]]  # x_{a+k-1}: the anchor first
    assert blocks.valid.tolist() == [[True, True, True], [True, True, False]]


def test_sample_anchors_stay_in_range_and_distinct():
    g = torch.Generator().manual_seed(0)
    anchors = sample_anchors(length=10, first=4, count=100, generator=g)
    assert anchors.tolist() == [4, 5, 6, 7, 8, 9]
    assert sample_anchors(length=3, first=5, count=4, generator=g).numel() == 0
    assert sample_anchors(length=6, first=0, count=2, generator=g).min() >= 1  # an anchor needs context


def test_packed_blocks_equal_one_block_per_request():
    drafter, _ = random_drafter(tiny_hf_config())
    t = 12
    features, ids = torch.randn(t, 2 * 32), torch.randint(0, 49, (t,))
    anchors = torch.tensor([1, 4, 7, 11])
    ctx = drafter.context_kv(features, torch.arange(t))
    keys = ctx.keys[:, None].expand(-1, 4, -1, -1, -1)
    values = ctx.values[:, None].expand(-1, 4, -1, -1, -1)
    ref = drafter.block_hidden(PaddedContext(keys, values, anchors), ids[anchors], anchors)
    torch.testing.assert_close(packed_block_hidden(drafter, features, ids, anchors), ref, atol=1e-5, rtol=1e-5)


def test_draft_index_maps_target_ids_into_the_draft_vocabulary():
    assert draft_index(torch.tensor([2, 5]), 6).tolist() == [-1, -1, 0, -1, -1, 1]
    assert draft_index(None, 3).tolist() == [0, 1, 2]


def _target(ids, probs):
    return SparseTarget(torch.tensor(ids), torch.tensor(probs))


def test_loss_is_zero_tv_for_a_drafter_that_matches_the_target():
    to_draft = draft_index(torch.tensor([0, 1, 2]), 4)  # target id 3 is outside the draft vocabulary
    target = _target([[[1, 0]]], [[[0.75, 0.25]]])  # [B=1, g=1, k=2]
    logits = torch.log(torch.tensor([[[0.25, 0.75, 1e-9]]]))
    parts = dspark_loss(logits, torch.tensor([[5.0]]), target, torch.tensor([[True]]), to_draft, LossWeights())
    assert parts.tv < 1e-6
    assert parts.accepted.tolist() == [[True]]
    # mass the drafter cannot place (target id 3) counts fully in TV
    off = dspark_loss(logits, None, _target([[[1, 3]]], [[[0.5, 0.5]]]), torch.tensor([[True]]), to_draft,
                      LossWeights())
    assert abs(off.tv - 0.5 * (0.25 + 0.25 + 0.5)) < 1e-5


def test_loss_gradient_moves_the_draft_towards_the_target():
    to_draft = draft_index(None, 3)
    target = _target([[[2, 0]]], [[[0.9, 0.1]]])
    logits = torch.zeros(1, 1, 3, requires_grad=True)
    parts = dspark_loss(logits, None, target, torch.tensor([[True]]), to_draft, LossWeights())
    parts.total.backward()
    assert logits.grad[0, 0, 2] < 0 < logits.grad[0, 0, 1]  # raise the target's token, lower the absent one
    assert parts.accepted.tolist() == [[False]]


def test_accepted_length_counts_leading_accepts_plus_bonus_on_complete_rows():
    acc = torch.tensor([[True, False, True], [True, True, True], [False, True, True]])
    valid = torch.tensor([[True] * 3, [True] * 3, [True, True, False]])
    assert accepted_length(acc, valid).tolist() == [2.0, 4.0]
