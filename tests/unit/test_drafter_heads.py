"""Tiny literal cases for the sequential heads, the step sampler, the context records and the knobs."""

import math

import pytest
import torch

from sgl_dspark.drafter.config import parse_drafter_config
from sgl_dspark.drafter.context import ContextKV, pad_contexts
from fixture_drafters import tiny_hf_config
from sgl_dspark.drafter.heads import ConfidenceHead, build_markov_head
from sgl_dspark.drafter.knobs import DraftKnobs
from sgl_dspark.drafter.sampler import alternatives, sample_rows
from sgl_dspark.sampling import SamplingParams


def head(kind):
    """W1[3] = e_0 and W2[7, 0] = 2: after token 3, token 7 gets bias 2 * (whatever reaches rank channel 0)."""
    h = build_markov_head(parse_drafter_config(tiny_hf_config(markov_head_type=kind)))
    for p in h.parameters():
        p.data.zero_()
    h.markov_w1.weight.data[3, 0] = 1.0
    h.markov_w2.weight.data[7, 0] = 2.0
    return h


def bias_at(bias):
    return [round(v, 4) for v in bias[0, [6, 7, 8]].tolist()]


def test_vanilla_bias_is_w2_of_w1_row():
    bias, state = head("vanilla").step(torch.tensor([3]), torch.zeros(1, 32), None)
    assert bias_at(bias) == [0.0, 2.0, 0.0] and state is None
    bias, _ = head("vanilla").step(torch.tensor([4]), torch.zeros(1, 32), None)
    assert bias_at(bias) == [0.0, 0.0, 0.0]


def test_gated_bias_halves_with_a_zero_gate_logit():
    bias, _ = head("gated").step(torch.tensor([3]), torch.zeros(1, 32), None)
    assert bias_at(bias) == [0.0, 1.0, 0.0]


def test_rnn_state_and_bias():
    h = head("rnn")
    h.joint_proj.bias.data[8:16] = 50.0  # candidate -> tanh = 1
    h.joint_proj.bias.data[16:24] = math.atanh(0.5)  # output -> tanh = 0.5
    state = h.init_state(1, torch.zeros(1, 32))
    assert state.tolist() == [[0.0] * 8]
    bias, state = h.step(torch.tensor([3]), torch.zeros(1, 32), state)  # gate 0.5: s = .5*0 + .5*1
    assert bias_at(bias) == [0.0, 1.0, 0.0] and state[0, 0].item() == pytest.approx(0.5)
    _, state = h.step(torch.tensor([3]), torch.zeros(1, 32), state)
    assert state[0, 0].item() == pytest.approx(0.75)


def test_confidence_head_features():
    cfg = parse_drafter_config(tiny_hf_config())
    c = ConfidenceHead(cfg)
    c.proj.weight.data.zero_()
    c.proj.weight.data[0, 0] = 1.0  # h[0]
    c.proj.weight.data[0, 32] = -2.0  # W1[prev][0]
    c.proj.bias.data.fill_(0.5)
    hidden, emb = torch.zeros(1, 32), torch.zeros(1, 8)
    hidden[0, 0], emb[0, 0] = 1.0, 1.0
    assert c(hidden, emb).tolist() == [-0.5]
    off = ConfidenceHead(parse_drafter_config(tiny_hf_config(confidence_head_with_markov=False)))
    assert off.proj.weight.shape == (1, 32)


def test_alternatives_docstring_example():
    ids, shares = alternatives(torch.tensor([0.5, 0.3, 0.2]).log(), taken=0, count=2, params=SamplingParams())
    assert ids.tolist() == [1, 2]
    torch.testing.assert_close(shares, torch.tensor([0.6, 0.4]))
    ids, _ = alternatives(torch.tensor([0.5, 0.3, 0.2]).log(), taken=1, count=1, params=SamplingParams())
    assert ids.tolist() == [0]


def test_sample_rows_greedy_is_argmax_with_one_hot_q():
    logits = torch.tensor([[0.0, 3.0, 1.0], [2.0, 0.0, 1.0]])
    out = sample_rows(logits, [SamplingParams(temperature=0.0)] * 2)
    assert out.tokens.tolist() == [1, 0]
    assert out.probs.tolist() == [[0.0, 1.0, 0.0], [1.0, 0.0, 0.0]]


def test_sample_rows_applies_each_rows_params():
    logits = torch.tensor([[0.0, 1.0, 2.0], [0.0, 1.0, 2.0]])
    out = sample_rows(logits, [SamplingParams(top_k=1), SamplingParams(temperature=1.0)],
                      torch.Generator().manual_seed(0))
    assert out.probs[0].tolist() == [0.0, 0.0, 1.0] and out.tokens[0].item() == 2
    torch.testing.assert_close(out.probs[1], torch.softmax(logits[1], -1))


def test_pad_contexts_lengths_and_mask():
    rows = [ContextKV(torch.ones(2, n, 1, 4), torch.ones(2, n, 1, 4)) for n in (2, 0, 3)]
    padded = pad_contexts(rows)
    assert padded.keys.shape == (2, 3, 3, 1, 4) and padded.lengths.tolist() == [2, 0, 3]
    assert padded.valid().tolist() == [[True, True, False], [False, False, False], [True, True, True]]
    assert padded.row(0).keys.shape == (2, 1, 2, 1, 4)


def test_gather_padded_matches_pad_contexts():
    from sgl_dspark.drafter.context import gather_padded

    pool = ContextKV(torch.arange(2 * 8.0).view(2, 8, 1, 1), -torch.arange(2 * 8.0).view(2, 8, 1, 1))
    slots = (torch.tensor([4, 7]), torch.tensor([], dtype=torch.long), torch.tensor([2, 5, 1]))
    padded, ref = gather_padded(pool, slots), pad_contexts([pool.select(s) for s in slots])
    assert padded.lengths.tolist() == [2, 0, 3] and padded.keys.shape == ref.keys.shape
    assert padded.keys[0, :, :, 0, 0].tolist() == [[4, 7, 4], [0, 0, 0], [2, 5, 1]]
    valid = padded.valid()[None, :, :, None, None]
    assert torch.equal(padded.keys * valid, ref.keys) and torch.equal(padded.values * valid, ref.values)


def test_knobs_resolve_and_temperature():
    k = DraftKnobs(tree_width=2, confidence_temperatures=(2.0,), confidence_biases=(0.3,)).resolve(gamma=5)
    assert (k.max_window, k.max_nodes, k.calibration(1), k.calibration(2)) == (5, 10, (2.0, 0.3), (1.0, 0.0))
    with pytest.raises(ValueError, match="max_window 1 must be >="):
        DraftKnobs(min_window=2, max_window=1)
    with pytest.raises(ValueError, match="tree_width"):
        DraftKnobs(tree_width=0)


def test_alternative_shares_stay_probabilities_when_the_top_choice_is_certain():
    from sgl_dspark.drafter.sampler import alternatives
    from sgl_dspark.sampling import SamplingParams

    ids, shares = alternatives(torch.tensor([20.0, 0.0, 0.0]), 0, 2, SamplingParams(temperature=0.0))
    assert ids.tolist() in ([1, 2], [2, 1])
    assert torch.allclose(shares, torch.tensor([0.5, 0.5]))
    ids, shares = alternatives(torch.tensor([0.5, 0.3, 0.2]).log(), 0, 2, SamplingParams(temperature=1.0))
    assert ids.tolist() == [1, 2] and torch.allclose(shares, torch.tensor([0.6, 0.4]))
