"""Training ideas of issue 13 (pure parts): the bigram warm start of the Markov head, the learning-rate
schedules and complementary training (the lookup's coverage of a sequence, the loss scale it gives)."""

import math

import pytest
import torch

from fixture_drafters import tiny_hf_config
from sgl_dspark.drafter.fresh import random_drafter
from sgl_dspark.training.coverage import complement_scale, lookup_depths
from sgl_dspark.training.init import bigram_markov, bigram_pmi
from sgl_dspark.training.objective import LossWeights, SparseTarget, dspark_loss
from sgl_dspark.training.rollout import hybrid_length, stepped_lengths
from sgl_dspark.training.trainer import lr_factor


def test_bigram_pmi_counts_seen_pairs_inside_the_draft_vocabulary():
    rows, pmi = bigram_pmi([[5, 7, 5, 7, 5, 8]], torch.tensor([7, 8]))
    assert rows.tolist() == [5]  # 7 -> 5 leaves the draft vocabulary
    assert pmi[0].tolist() == pytest.approx([math.log((2 / 4) / (2 / 3)), math.log((1 / 4) / (1 / 3))])
    rows, pmi = bigram_pmi([[1, 2, 1, 3]], torch.tensor([1, 2, 3]))
    assert rows.tolist() == [1, 2] and pmi[0, 0] == 0  # 1 -> 1 never seen: neutral


def test_bigram_markov_head_ranks_each_tokens_successor_first():
    drafter, _ = random_drafter(tiny_hf_config(markov_rank=16))
    # every token t in 0..9 is followed by (3t + 1) mod 10, in many shuffled sequences
    gen = torch.Generator().manual_seed(0)
    sequences = []
    for _ in range(40):
        t = int(torch.randint(10, (1,), generator=gen))
        seq = [t]
        for _ in range(12):
            t = (3 * t + 1) % 10
            seq.append(t)
        sequences.append(seq)
    kept = bigram_markov(drafter, sequences, scale=1.0)
    assert 0.99 < kept <= 1.0 + 1e-6  # ten predecessor rows: rank 10 holds all of it
    head = drafter.markov_head
    bias = head.markov_w2(head.markov_w1(torch.arange(10)))
    assert bias.argmax(-1).tolist() == [(3 * t + 1) % 10 for t in range(10)]
    assert head.markov_w1.weight[10:].abs().sum() == 0  # never a predecessor: no bias


def test_lr_schedule_warms_up_then_decays_to_a_tenth_or_stays():
    assert lr_factor(0.5, 10) == pytest.approx(0.5)
    assert lr_factor(1.0, 10) == pytest.approx(1.0)
    assert lr_factor(10.0, 10) == pytest.approx(0.1)
    assert lr_factor(0.5, 10, schedule="constant") == pytest.approx(0.5)
    assert lr_factor(10.0, 10, schedule="constant") == pytest.approx(1.0)


def test_lookup_depths_replay_the_serving_lookup_over_a_sequence():
    assert lookup_depths([1, 2, 3, 1, 2, 3, 9], 2).tolist() == [0, 0, 0, 2, 1, 0, 0]
    assert lookup_depths([4, 5, 6, 7], 3).tolist() == [0, 0, 0, 0]  # nothing repeats: nothing covered


def test_complement_scale_lowers_only_the_covered_positions_of_ce_and_tv():
    assert complement_scale(torch.tensor([0, 2]), 3, 0.5).tolist() == [[1, 1, 1], [0.5, 0.5, 1]]
    drafter, _ = random_drafter(tiny_hf_config())
    g, vocab = drafter.config.gamma, drafter.config.vocab_size
    gen = torch.Generator().manual_seed(0)
    logits = torch.randn(2, g, vocab, generator=gen)
    conf = torch.randn(2, g, generator=gen)
    target = SparseTarget(torch.randint(vocab, (2, g, 3), generator=gen), torch.full((2, g, 3), 0.3))
    valid = torch.ones(2, g, dtype=torch.bool)
    args = (logits, conf, target, valid, torch.arange(vocab), LossWeights())
    plain = dspark_loss(*args)
    half = dspark_loss(*args, scale=torch.full((2, g), 0.5))
    assert half.ce == pytest.approx(plain.ce / 2) and half.tv == pytest.approx(plain.tv / 2)
    assert half.bce == pytest.approx(plain.bce)  # the confidence head learns every position as it is
    assert dspark_loss(*args, scale=torch.ones(2, g)).tv == pytest.approx(plain.tv)


def test_hybrid_length_takes_the_longer_leading_run_of_drafter_and_lookup():
    accepted = torch.tensor([[True, False, False], [True, True, False], [True, True, True]])
    valid = torch.tensor([[True] * 3, [True] * 3, [True, True, False]])  # the last row is cut: not counted
    assert hybrid_length(accepted, valid, torch.tensor([2, 0, 3])).tolist() == [3.0, 3.0]


def test_stepped_lengths_start_each_step_where_the_last_one_ended():
    accepted = torch.tensor([[1, 1], [0, 0], [0, 0], [1, 0]]).bool()
    valid = torch.ones(4, 2, dtype=torch.bool)
    assert stepped_lengths(accepted, valid) == [3, 2]  # anchors 0 and 3; rows 1 and 2 are inside step 0
    tail = torch.tensor([[True, False], [False, False]])  # the last anchor's second token lies past the end
    assert stepped_lengths(torch.ones(2, 2, dtype=torch.bool), tail) == [2]  # one step covers both rows
    per_anchor = (1 + torch.cumprod(accepted.long(), 1).sum(1)).float().mean()
    per_step = sum(stepped_lengths(accepted, valid)) / 2
    assert per_anchor == 1.75 and per_step == 2.5  # the two means differ; per step is what a server reports
