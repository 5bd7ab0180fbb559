"""Drafting: greedy chain against a hand-written loop, dynamic window, LM-head rows, reduced vocabulary, trees,
sampling from the returned draft_probs, seeded determinism."""

import pytest
import torch
from scipy.stats import chisquare

from sgl_dspark.drafter import DraftKnobs, Proposer, ProposeInput, pad_contexts
from fixture_drafters import tiny_hf_config
from sgl_dspark.drafter.fresh import random_drafter
from sgl_dspark.sampling import SamplingParams
from sgl_dspark.tree import position_ids

SAMPLED = SamplingParams(temperature=1.0)
GREEDY = SamplingParams(temperature=0.0)


def make_input(drafter, batch=2, sampling=(), seed=0, anchors=None):
    lens = [5 + i for i in range(batch)]
    ctxs = [drafter.context_kv(torch.randn(n, 64, generator=torch.Generator().manual_seed(n)), torch.arange(n))
            for n in lens]
    anchors = torch.tensor(anchors or [3 + i for i in range(batch)])
    return ProposeInput(pad_contexts(ctxs), anchors, torch.tensor(lens), tuple(sampling),
                        torch.Generator().manual_seed(seed))


def set_confidence(drafter, bias, markov_weight=None):
    head = drafter.confidence_head.proj
    head.weight.zero_()
    head.bias.fill_(bias)
    if markov_weight is not None:
        head.weight[0, 32:] = markov_weight


def test_greedy_chain_matches_a_hand_written_loop():
    drafter, _ = random_drafter(tiny_hf_config())
    inp = make_input(drafter, batch=1)
    tree = Proposer(drafter).propose(inp).trees[0]
    h = drafter.block_hidden(inp.context, inp.anchors, inp.anchor_positions)[0]  # [4, 32]
    prev, tokens, conf = 3, [3], [1.0]
    for k in range(4):
        w1 = drafter.markov_head.markov_w1.weight[prev]
        logits = drafter.target.lm_head @ h[k] + drafter.markov_head.markov_w2.weight @ w1
        conf.append(float(torch.sigmoid(drafter.confidence_head.proj(torch.cat([h[k], w1])))))
        prev = int(logits.argmax())
        tokens.append(prev)
    assert tree.tokens.tolist() == tokens and tree.parents.tolist() == [-1, 0, 1, 2, 3]
    torch.testing.assert_close(tree.confidence, torch.tensor(conf))
    assert tree.draft_probs is None


@pytest.mark.parametrize("bias, knobs, length", [
    (-20.0, DraftKnobs(min_window=2, max_window=4, survival_threshold=0.5), 2),
    (20.0, DraftKnobs(min_window=1, max_window=3, survival_threshold=0.5), 3),
    (1.3862944, DraftKnobs(min_window=1, survival_threshold=0.5), 3),  # c = 0.8: survival .8 .64 .512 .41
    (-20.0, DraftKnobs(min_window=0, survival_threshold=0.5), 0),
])
def test_dynamic_window_and_lm_head_rows(bias, knobs, length):
    drafter, _ = random_drafter(tiny_hf_config())
    set_confidence(drafter, bias)
    out = Proposer(drafter, knobs).propose(make_input(drafter, batch=3))
    assert out.draft_lengths == [length] * 3
    assert out.lm_head_rows == 3 * length


def test_lm_head_projects_only_rows_still_drafting():
    """Request 2's anchor makes its first confidence ~0, so it drafts nothing; request 1 drafts on."""
    drafter, _ = random_drafter(tiny_hf_config())
    set_confidence(drafter, 0.0, markov_weight=torch.eye(8)[0])
    drafter.markov_head.markov_w1.weight[:, 0] = 20.0
    drafter.markov_head.markov_w1.weight[9, 0] = -20.0
    projected = []
    base_logits = drafter.base_logits
    drafter.base_logits = lambda hid: projected.append(hid.shape[0]) or base_logits(hid)
    out = Proposer(drafter, DraftKnobs(min_window=0, survival_threshold=0.5)).propose(
        make_input(drafter, anchors=[3, 9]))
    assert out.draft_lengths[1] == 0 and out.draft_lengths[0] >= 1
    assert out.lm_head_rows == sum(projected) == sum(out.draft_lengths)
    assert projected == [1] * out.draft_lengths[0]


@pytest.mark.parametrize("knobs", [DraftKnobs(), DraftKnobs(tree_width=2, branch_threshold=0.9),
                                   DraftKnobs(min_window=2, survival_threshold=0.5)])
def test_certain_depths_project_in_one_call_and_draft_as_depth_by_depth(knobs, monkeypatch):
    """Without a survival stop every depth is certain: one LM-head call of batch x window rows; the min window
    is certain otherwise. The trees equal those of projecting depth by depth (the slow oracle)."""
    from sgl_dspark.drafter import sequential

    drafter, _ = random_drafter(tiny_hf_config())
    projected = []
    base_logits = drafter.base_logits
    drafter.base_logits = lambda hid: projected.append(hid.shape[0]) or base_logits(hid)
    fast = Proposer(drafter, knobs).propose(make_input(drafter, batch=3))
    eager = sequential.certain_depths(Proposer(drafter, knobs).knobs)
    assert projected[0] == 3 * eager and eager == (4 if knobs.survival_threshold == 0 else 2)
    monkeypatch.setattr(sequential, "certain_depths", lambda knobs: 0)
    slow = Proposer(drafter, knobs).propose(make_input(drafter, batch=3))
    assert fast.lm_head_rows == slow.lm_head_rows
    for a, b in zip(fast.trees, slow.trees):
        assert a.tokens.tolist() == b.tokens.tolist() and a.parents.tolist() == b.parents.tolist()
        torch.testing.assert_close(a.confidence, b.confidence)


def test_calibration_temperatures_rescale_confidence():
    drafter, _ = random_drafter(tiny_hf_config())
    inp = make_input(drafter, batch=1)
    raw = Proposer(drafter).propose(inp).trees[0].confidence[1:]
    temps = (2.0, 0.5, 1.0, 3.0)
    cal = Proposer(drafter, DraftKnobs(confidence_temperatures=temps)).propose(inp).trees[0].confidence[1:]
    want = torch.sigmoid(torch.logit(raw) / torch.tensor(temps))
    torch.testing.assert_close(cal, want, atol=1e-5, rtol=1e-5)


def test_reduced_vocab_gives_exact_zeros_outside_the_map():
    drafter, _ = random_drafter(tiny_hf_config(draft_vocab_size=20))
    ids = drafter.draft_to_target
    out = Proposer(drafter).propose(make_input(drafter, batch=4, sampling=[SAMPLED] * 4))
    outside = torch.ones(50, dtype=torch.bool)
    outside[ids] = False
    for tree in out.trees:
        assert bool(torch.isin(tree.tokens[1:], ids).all())
        assert bool((tree.draft_probs[1:, outside] == 0).all())
        torch.testing.assert_close(tree.draft_probs[1:].sum(-1), torch.ones(tree.size - 1))


def test_tree_branches_with_deterministic_alternatives():
    drafter, _ = random_drafter(tiny_hf_config())
    set_confidence(drafter, -1.0)  # c ~ 0.27 < branch threshold everywhere
    inp = make_input(drafter, batch=1)  # greedy: only greedy requests get alternatives
    knobs = DraftKnobs(tree_width=3, branch_threshold=0.5, max_nodes=8)
    tree = Proposer(drafter, knobs).propose(inp).trees[0]
    # depth 1: main child 1, alternatives 2, 3; depth 2: one child each (alternatives of 4 would eat the budget
    # reserved for the main chain); depths 3-4: the main chain alone, which still reaches max_window.
    assert tree.parents.tolist() == [-1, 0, 0, 0, 1, 2, 3, 4, 7]
    assert position_ids(tree.parents, prefix_len=5).tolist() == [5, 6, 6, 6, 7, 7, 7, 8, 9]
    h = drafter.block_hidden(inp.context, inp.anchors, inp.anchor_positions)[0]
    markov = drafter.markov_head
    logits = drafter.target.lm_head @ h[0] + markov.markov_w2.weight @ markov.markov_w1.weight[3]
    rank = [t for t in logits.argsort(descending=True).tolist() if t != int(tree.tokens[1])]
    assert tree.tokens[2:4].tolist() == rank[:2]
    p = torch.softmax(logits, -1)
    share = p[tree.tokens[2:4]] / (1 - p[tree.tokens[1]])
    torch.testing.assert_close(tree.confidence[2:4], (1 - tree.confidence[1]) * share)


def test_sampled_requests_branch_with_iid_siblings():
    """A sampled request's siblings are further draws from its child's q (the same row), their number and
    confidences c * (1 - c)**j fixed by the parent's confidence; with sampled_trees off its block is a chain."""
    drafter, _ = random_drafter(tiny_hf_config())
    set_confidence(drafter, -1.0)  # c ~ 0.27 < branch threshold everywhere
    knobs = DraftKnobs(tree_width=3, branch_threshold=0.5, max_nodes=8)
    greedy, sampled = Proposer(drafter, knobs).propose(make_input(drafter, sampling=[GREEDY, SAMPLED])).trees
    assert not greedy.is_chain and not sampled.is_chain and sampled.draft_probs is not None
    assert sampled.parents.tolist() == greedy.parents.tolist()  # the same shape: decided before any draw
    c = float(sampled.confidence[1])
    torch.testing.assert_close(sampled.confidence[1:4], torch.tensor([c, c * (1 - c), c * (1 - c) ** 2]))
    for sibling in (2, 3):  # drawn from the main child's distribution, which the tree carries for each
        torch.testing.assert_close(sampled.draft_probs[sibling], sampled.draft_probs[1])
        assert float(sampled.draft_probs[1][sampled.tokens[sibling]]) > 0
    off = Proposer(drafter, DraftKnobs(tree_width=3, branch_threshold=0.5, max_nodes=8, sampled_trees=False))
    chain = off.propose(make_input(drafter, sampling=[GREEDY, SAMPLED])).trees[1]
    assert chain.is_chain and chain.size == 5


def test_sampled_siblings_follow_their_draft_probs():
    """Each i.i.d. sibling is distributed as q, independently of the main child: pooled counts of sibling tokens
    against the mean returned row, and the pair (main child, sibling) against the product of the rows."""
    drafter, _ = random_drafter(tiny_hf_config(vocab_size=6, mask_token_id=5))
    set_confidence(drafter, -1.0)
    n = 3000
    one = make_input(drafter, batch=1, anchors=[2])
    ctx = one.context
    batch = type(ctx)(ctx.keys.expand(-1, n, -1, -1, -1), ctx.values.expand(-1, n, -1, -1, -1), ctx.lengths.expand(n))
    inp = ProposeInput(batch, one.anchors.expand(n), one.anchor_positions.expand(n), (SAMPLED,) * n,
                       torch.Generator().manual_seed(3))
    trees = Proposer(drafter, DraftKnobs(tree_width=2, branch_threshold=0.5, max_nodes=8)).propose(inp).trees
    assert all(t.parents[2] == 0 for t in trees)  # node 2: the main child's sibling at depth 1
    q = torch.stack([t.draft_probs[1] for t in trees]).double().mean(0)
    pairs = torch.bincount(torch.stack([t.tokens[1] * 6 + t.tokens[2] for t in trees]), minlength=36).double()
    expected = (q[:, None] * q[None, :]).flatten() * n
    keep = expected > 5
    observed = torch.cat([pairs[keep], pairs[~keep].sum(0, keepdim=True)])
    exp = torch.cat([expected[keep], expected[~keep].sum(0, keepdim=True)])
    observed, exp = observed[exp > 0], exp[exp > 0]
    assert chisquare(observed.numpy(), exp.numpy() * n / exp.sum().item()).pvalue > 1e-3


def test_no_branching_above_the_threshold_gives_a_chain():
    drafter, _ = random_drafter(tiny_hf_config())
    set_confidence(drafter, 3.0)
    tree = Proposer(drafter, DraftKnobs(tree_width=3, branch_threshold=0.5)).propose(make_input(drafter)).trees[0]
    assert tree.is_chain and tree.size == 5


@pytest.mark.parametrize("head", ["vanilla", "gated", "rnn"])
def test_sampled_tokens_follow_the_returned_draft_probs(head):
    """For every position k, E[1{x_k = v}] = E[q_k(v)]: pooled counts vs the mean returned distribution."""
    drafter, _ = random_drafter(tiny_hf_config(markov_head_type=head))
    n = 3000
    one = make_input(drafter, batch=1)
    ctx = one.context
    batch = type(ctx)(ctx.keys.expand(-1, n, -1, -1, -1), ctx.values.expand(-1, n, -1, -1, -1), ctx.lengths.expand(n))
    inp = ProposeInput(batch, one.anchors.expand(n), one.anchor_positions.expand(n), (SAMPLED,) * n,
                       torch.Generator().manual_seed(7))
    trees = Proposer(drafter).propose(inp).trees
    for k in (1, 3):
        counts = torch.bincount(torch.stack([t.tokens[k] for t in trees]), minlength=50).float()
        expected = torch.stack([t.draft_probs[k] for t in trees]).sum(0)
        keep = expected > 5  # pool the rare tokens into one bin
        observed = torch.cat([counts[keep], counts[~keep].sum(0, keepdim=True)])
        exp = torch.cat([expected[keep], expected[~keep].sum(0, keepdim=True)])
        observed, exp = observed[exp > 0], exp[exp > 0]
        assert chisquare(observed.numpy(), exp.numpy() * n / exp.sum().item()).pvalue > 1e-3


def test_seeded_generator_is_deterministic():
    drafter, _ = random_drafter(tiny_hf_config())
    knobs = DraftKnobs(tree_width=2, branch_threshold=0.6)
    runs = [Proposer(drafter, knobs).propose(make_input(drafter, batch=3, sampling=[SAMPLED] * 3, seed=s)).trees
            for s in (11, 11, 12)]
    assert all(torch.equal(a.tokens, b.tokens) and torch.equal(a.parents, b.parents) for a, b in zip(runs[0], runs[1]))
    assert any(not torch.equal(a.tokens, b.tokens) for a, b in zip(runs[0], runs[2]))


def test_knobs_outside_gamma_are_refused():
    drafter, _ = random_drafter(tiny_hf_config())
    with pytest.raises(ValueError, match="exceed the drafter's gamma 4"):
        Proposer(drafter, DraftKnobs(max_window=5))
    with pytest.raises(ValueError, match="max_nodes 2 must be >= max_window 4"):
        Proposer(drafter, DraftKnobs(max_nodes=2))
