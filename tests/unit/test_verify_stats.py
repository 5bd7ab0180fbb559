"""Statistical check that verification is lossless: the first emitted token, and the first two jointly, are
distributed as the target's, for chains and trees under several sampling settings; negative controls show
the check detects a broken verifier. Vocabulary of 6, fixed seeds (deterministic), chi-square at 1e-3.
"""

from collections.abc import Callable
from dataclasses import dataclass

import zlib

import pytest
import torch
from law_stats import chi_square_pvalue

import sgl_dspark.verify as verify_mod
from sgl_dspark.sampling import SamplingParams, target_probs
from sgl_dspark.tree import DraftTree, depths
from sgl_dspark.verify import verify

V = 6
ANCHOR = 3
LOOKUP_TOKEN = 0  # a candidate "copied from context": one-hot, may duplicate a sampled sibling
TRIALS = 2000
ALPHA = 1e-3

# The world: logits depend on (depth, last token) of the node's prefix; the drafter is a noisy target.
_world = torch.Generator().manual_seed(1234)
TARGET_LOGITS = 1.5 * torch.randn(4, V, V, generator=_world)  # [depth, last token, V]
DRAFT_PROBS = torch.softmax(TARGET_LOGITS + 1.5 * torch.randn(4, V, V, generator=_world), -1)  # [depth, last, V]

PARAMS = {
    "t0.7": SamplingParams(temperature=0.7),
    "t1.0": SamplingParams(temperature=1.0),
    "t1.5": SamplingParams(temperature=1.5),
    "top_p0.8": SamplingParams(temperature=1.0, top_p=0.8),
    "top_k3": SamplingParams(temperature=1.0, top_k=3),
    "min_p0.2": SamplingParams(temperature=1.0, min_p=0.2),
}


@dataclass(frozen=True)
class Drafts:
    """Many trials' trees of one shape."""

    parents: torch.Tensor  # [n]
    tokens: torch.Tensor  # [trials, n]
    draft_probs: torch.Tensor  # [trials, n, V]


def _sample(probs: torch.Tensor, gen: torch.Generator) -> torch.Tensor:
    """probs [trials, V] -> tokens [trials], one draw per row."""
    return torch.multinomial(probs, 1, generator=gen).squeeze(1)


def _one_hot(tokens: torch.Tensor) -> torch.Tensor:
    return torch.nn.functional.one_hot(tokens, V).float()


def _draft(parents: list[int], node_rows: Callable, trials: int, gen: torch.Generator) -> Drafts:
    """Draft nodes 1..n-1 in order; node_rows(i, tokens, rows) -> the row node i is drawn from [trials, V]."""
    n = len(parents)
    tokens = torch.full((trials, n), ANCHOR)
    rows = torch.full((trials, n, V), 1.0 / V)  # row 0 unused
    for i in range(1, n):
        rows[:, i] = node_rows(i, tokens, rows)
        tokens[:, i] = _sample(rows[:, i], gen)
    return Drafts(torch.tensor(parents), tokens, rows)


def _q(depth: int, last: torch.Tensor) -> torch.Tensor:
    return DRAFT_PROBS[depth, last]


def draft_chain(trials: int, gen: torch.Generator) -> Drafts:
    """anchor -> x1 -> x2 -> x3, each sampled from the drafter given its prefix."""
    return _draft([-1, 0, 1, 2], lambda i, tok, _: _q(i - 1, tok[:, i - 1]), trials, gen)


def draft_tree_deterministic(trials: int, gen: torch.Generator) -> Drafts:
    """Sampled children plus one-hot alternatives (next-most-likely, lookup copy, argmax continuation).

            0
          /   \\
        1(q)   2(next-most-likely after 1, one-hot)
        /  \\     \\
     3(q)  4(lookup, one-hot)  5(drafter argmax, one-hot)
    """
    def rows(i: int, tok: torch.Tensor, r: torch.Tensor) -> torch.Tensor:
        anchor_q = _q(0, tok[:, 0])
        if i == 1:
            return anchor_q
        if i == 2:
            return _one_hot(anchor_q.scatter(1, tok[:, 1:2], -1.0).argmax(1))
        if i == 3:
            return _q(1, tok[:, 1])
        if i == 4:
            return _one_hot(torch.full_like(tok[:, 0], LOOKUP_TOKEN))
        return _one_hot(_q(1, tok[:, 2]).argmax(1))

    return _draft([-1, 0, 0, 1, 1, 2], rows, trials, gen)


def draft_tree_iid(trials: int, gen: torch.Generator) -> Drafts:
    """Two i.i.d. sampled siblings under the anchor, each with one sampled child."""
    parents = [-1, 0, 0, 1, 2]
    return _draft(parents, lambda i, tok, _: _q(int(i >= 3), tok[:, parents[i]]), trials, gen)


def draft_tree_without_replacement(trials: int, gen: torch.Generator) -> Drafts:
    """Second sibling drawn from the drafter with the first sibling's token removed (row says so)."""
    parents = [-1, 0, 0, 1, 2]

    def rows(i: int, tok: torch.Tensor, r: torch.Tensor) -> torch.Tensor:
        if i == 2:
            rest = r[:, 1].scatter(1, tok[:, 1:2], 0.0)
            return rest / rest.sum(1, keepdim=True)
        return _q(int(i >= 3), tok[:, parents[i]])

    return _draft(parents, rows, trials, gen)


SHAPES = {"chain": draft_chain, "tree_det": draft_tree_deterministic, "tree_iid": draft_tree_iid,
          "tree_wor": draft_tree_without_replacement}


def first_two_emitted(drafts: Drafts, params: SamplingParams, gen: torch.Generator) -> torch.Tensor:
    """Verify every trial; -> [trials, 2] the first two tokens the target commits (one verify step, then a
    plain target sample when only the bonus was emitted)."""
    depth = depths(drafts.parents)
    logits = TARGET_LOGITS[depth, drafts.tokens]  # [trials, n, V]: after node i, given its depth and token
    ones = torch.ones(drafts.parents.shape[0])
    out = torch.empty(drafts.tokens.shape[0], 2, dtype=torch.long)
    for t in range(drafts.tokens.shape[0]):
        tree = DraftTree(drafts.tokens[t], drafts.parents, ones, drafts.draft_probs[t])
        emitted = verify(tree, logits[t], params, gen).emitted_tokens
        out[t, 0] = emitted[0]
        out[t, 1] = emitted[1] if emitted.shape[0] > 1 else -1
    missing = out[:, 1] < 0
    next_probs = target_probs(TARGET_LOGITS[1, out[missing, 0]], params)
    out[missing, 1] = _sample(next_probs, gen)
    return out


def expected_pairs(params: SamplingParams) -> torch.Tensor:
    """[V, V]: P(y1, y2) = p(y1 | anchor) * p(y2 | y1) under the target alone."""
    first = target_probs(TARGET_LOGITS[0, ANCHOR], params)
    second = target_probs(TARGET_LOGITS[1], params)  # [y1, V]
    return first[:, None] * second


def pvalues(shape: str, params: SamplingParams, seed: int) -> tuple[float, float]:
    """(first-token p-value, first-two-joint p-value)."""
    gen = torch.Generator().manual_seed(seed)
    pairs = first_two_emitted(SHAPES[shape](TRIALS, gen), params, gen)
    joint = expected_pairs(params)
    return (chi_square_pvalue(pairs[:, 0], joint.sum(1)),
            chi_square_pvalue(pairs[:, 0] * V + pairs[:, 1], joint.flatten()))


@pytest.mark.parametrize("shape", ["chain", "tree_det", "tree_iid"])
@pytest.mark.parametrize("name", sorted(PARAMS))
def test_emitted_tokens_follow_the_target(shape: str, name: str):
    first, joint = pvalues(shape, PARAMS[name], seed=zlib.crc32(f"{shape}/{name}".encode()))
    assert first > ALPHA and joint > ALPHA, (first, joint)


def test_siblings_sampled_without_replacement_follow_the_target():
    first, joint = pvalues("tree_wor", PARAMS["t1.0"], seed=5)
    assert first > ALPHA and joint > ALPHA, (first, joint)


def test_negative_control_accepting_without_ratio_is_detected(monkeypatch):
    monkeypatch.setattr(verify_mod, "_accepts", lambda p_x, q_x, gen: True)
    first, joint = pvalues("chain", PARAMS["t1.0"], seed=11)
    assert first < ALPHA and joint < ALPHA, (first, joint)


def test_negative_control_skipping_the_residual_is_detected(monkeypatch):
    monkeypatch.setattr(verify_mod, "residual", lambda p, q: p)
    first, joint = pvalues("tree_iid", PARAMS["t1.0"], seed=11)
    assert first < ALPHA and joint < ALPHA, (first, joint)
