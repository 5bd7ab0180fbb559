"""Tiny literal cases for lossless verification (vocabulary of 6 tokens, expected outcomes written out)."""

import pytest
import torch

from sgl_dspark.sampling import SamplingParams
from sgl_dspark.tree import DraftTree
from sgl_dspark.verify import (VerifyInput, children, kv_split, residual, verify, verify_requests, verify_greedy,
                               verify_sampling)

V = 6
GREEDY = SamplingParams(temperature=0.0)


def peaked(*argmaxes: int) -> torch.Tensor:
    """[n, V] logits whose row i has its argmax at argmaxes[i]."""
    logits = torch.zeros(len(argmaxes), V)
    logits[torch.arange(len(argmaxes)), torch.tensor(argmaxes)] = 5.0
    return logits


def tree(tokens: list[int], parents: list[int], draft_probs: torch.Tensor | None = None) -> DraftTree:
    n = len(tokens)
    return DraftTree(torch.tensor(tokens), torch.tensor(parents), torch.ones(n), draft_probs)


def one_hot_rows(tokens: list[int]) -> torch.Tensor:
    return torch.nn.functional.one_hot(torch.tensor(tokens), V).float()


def test_children():
    assert children(torch.tensor([-1, 0, 0, 1])) == [[1, 2], [3], [], []]
    assert children(torch.tensor([-1])) == [[]]


def test_greedy_chain_fully_accepted():
    chain = tree([4, 1, 2, 3], [-1, 0, 1, 2])
    r = verify_greedy(chain, peaked(1, 2, 3, 5))
    assert r.accepted_nodes.tolist() == [1, 2, 3]
    assert r.accepted_tokens.tolist() == [1, 2, 3]
    assert (r.bonus_token, r.last_node, r.tau) == (5, 3, 4)
    assert r.emitted_tokens.tolist() == [1, 2, 3, 5]


def test_greedy_chain_rejected_at_second_draft():
    chain = tree([4, 1, 2, 3], [-1, 0, 1, 2])
    r = verify_greedy(chain, peaked(1, 0, 3, 5))  # target wants 0 after node 1, draft says 2
    assert r.accepted_tokens.tolist() == [1]
    assert (r.bonus_token, r.last_node, r.tau) == (0, 1, 2)


def test_greedy_chain_rejected_at_first_draft_gives_tau_one():
    chain = tree([4, 1, 2], [-1, 0, 1])
    r = verify(chain, peaked(3, 2, 0), GREEDY)
    assert r.accepted_tokens.tolist() == []
    assert (r.bonus_token, r.last_node, r.tau) == (3, 0, 1)


def test_greedy_tree_picks_second_branch():
    #      0(anchor 4)
    #     /          \
    #   1(tok 1)    2(tok 2)
    #    |            |
    #   3(tok 5)    4(tok 3)
    t = tree([4, 1, 2, 5, 3], [-1, 0, 0, 1, 2])
    r = verify(t, peaked(2, 5, 3, 0, 1), GREEDY)
    assert r.accepted_nodes.tolist() == [2, 4]
    assert r.accepted_tokens.tolist() == [2, 3]
    assert (r.bonus_token, r.last_node, r.tau) == (1, 4, 3)


def test_greedy_duplicate_children_take_the_first():
    t = tree([4, 2, 2], [-1, 0, 0])
    assert verify_greedy(t, peaked(2, 0, 1)).accepted_nodes.tolist() == [1]


def test_sampling_with_greedy_target_matches_greedy_walk():
    t = tree([4, 1, 2, 5, 3], [-1, 0, 0, 1, 2], one_hot_rows([0, 1, 2, 5, 3]))
    probs = torch.nn.functional.one_hot(torch.tensor([2, 5, 3, 0, 1]), V).float()
    r = verify_sampling(t, probs, torch.Generator().manual_seed(0))
    assert r.accepted_nodes.tolist() == [2, 4] and r.bonus_token == 1


def test_sampling_with_p_equal_q_accepts_everything():
    torch.manual_seed(0)
    probs = torch.softmax(torch.randn(4, V), -1)
    # draft_probs[i] is the distribution node i was drawn from: here the target's after its parent.
    chain = DraftTree.chain(torch.tensor([4, 1, 2, 3]), torch.ones(4), torch.cat([probs[:1], probs[:3]]))
    gen = torch.Generator().manual_seed(1)
    for _ in range(50):
        r = verify_sampling(chain, probs, gen)
        assert r.accepted_tokens.tolist() == [1, 2, 3] and r.tau == 4 and r.last_node == 3


def test_one_hot_draft_on_zero_target_token_is_rejected_and_residual_is_p():
    p = torch.tensor([0.5, 0.0, 0.25, 0.25, 0.0, 0.0], dtype=torch.float64)
    q = one_hot_rows([1])[0].double()
    assert torch.equal(residual(p, q), p)
    t = tree([4, 1], [-1, 0], one_hot_rows([0, 1]))
    probs = torch.stack([p.float(), p.float()])
    gen = torch.Generator().manual_seed(0)
    for _ in range(50):
        r = verify_sampling(t, probs, gen)
        assert r.tau == 1 and r.bonus_token in (0, 2, 3)


def test_residual_literal():
    p = torch.tensor([0.5, 0.3, 0.2, 0.0, 0.0, 0.0], dtype=torch.float64)
    q = torch.tensor([0.2, 0.4, 0.2, 0.2, 0.0, 0.0], dtype=torch.float64)
    assert torch.allclose(residual(p, q), torch.tensor([1.0, 0, 0, 0, 0, 0], dtype=torch.float64))


def test_residual_of_equal_distributions_falls_back_to_p():
    p = torch.full((V,), 1 / V, dtype=torch.float64)
    assert torch.equal(residual(p, p.clone()), p)


def test_sampling_rejects_draft_token_with_zero_draft_probability():
    q = one_hot_rows([0, 2])  # node 1 holds token 1 but its row says token 2
    t = tree([4, 1], [-1, 0], q)
    with pytest.raises(ValueError, match="draft probability 0"):
        verify_sampling(t, torch.full((2, V), 1 / V), torch.Generator().manual_seed(0))


def test_sampling_without_draft_probs_raises():
    with pytest.raises(ValueError, match="draft_probs"):
        verify(tree([4, 1], [-1, 0]), torch.zeros(2, V), SamplingParams(temperature=1.0))


def test_logits_shape_is_checked():
    with pytest.raises(ValueError, match="target_logits"):
        verify(tree([4, 1], [-1, 0]), torch.zeros(3, V), GREEDY)


def test_same_seed_same_result():
    torch.manual_seed(0)
    logits = torch.randn(3, V)
    t = tree([4, 1, 2], [-1, 0, 0], torch.softmax(torch.randn(3, V), -1))
    params = SamplingParams(temperature=1.0)
    runs = [verify(t, logits, params, torch.Generator().manual_seed(7)).emitted_tokens.tolist() for _ in range(2)]
    assert runs[0] == runs[1]


def test_batch_mixes_greedy_and_sampling_requests():
    chain = tree([4, 1, 2], [-1, 0, 1], one_hot_rows([0, 1, 2]))
    sharp = peaked(1, 0, 3) * 20  # at temperature 1 the target is one-hot up to ~e-44
    inputs = [VerifyInput(chain, peaked(1, 2, 3), GREEDY),
              VerifyInput(chain, sharp, SamplingParams(temperature=1.0))]
    results = verify_requests(inputs, torch.Generator().manual_seed(0))
    assert [r.emitted_tokens.tolist() for r in results] == [[1, 2, 3], [1, 0]]


def test_kv_split_keeps_root_and_accepted_path():
    t = tree([4, 1, 2, 5, 3], [-1, 0, 0, 1, 2])
    split = kv_split(verify_greedy(t, peaked(2, 5, 3, 0, 1)), t.size)
    assert split.keep.tolist() == [0, 2, 4]
    assert split.free.tolist() == [1, 3]


def test_kv_split_when_nothing_accepted():
    t = tree([4, 1, 2], [-1, 0, 0])
    split = kv_split(verify_greedy(t, peaked(3, 0, 0)), t.size)
    assert split.keep.tolist() == [0] and split.free.tolist() == [1, 2]


@pytest.mark.parametrize("params", [SamplingParams(temperature=1.0), SamplingParams(temperature=0.7, top_k=3),
                                    SamplingParams(temperature=0.9, top_p=0.8), SamplingParams(min_p=0.2), GREEDY])
def test_a_lone_root_is_verified_in_every_sampling_mode(params):
    """The fallback block (nothing drafted: the draft worker is down) needs no draft_probs; its one token is the
    target's own draw (distributed as target_probs), or the argmax when greedy."""
    from sgl_dspark.sampling import target_probs

    logits = torch.tensor([[0.5, 2.0, -1.0, 1.0, 0.0, -3.0]])
    gen = torch.Generator().manual_seed(3)
    draws = [verify(tree([4], [-1]), logits, params, gen).emitted_tokens.tolist() for _ in range(400)]
    assert all(len(d) == 1 for d in draws)
    counts = torch.bincount(torch.tensor([d[0] for d in draws]), minlength=V).double() / 400
    assert (counts[target_probs(logits, params)[0] == 0] == 0).all()
    assert torch.allclose(counts, target_probs(logits, params)[0].double(), atol=0.08)


def test_choices_are_matched_like_the_argmax():
    """Seeded requests: the target's token after each node is fixed beforehand and drafts are matched to it."""
    t = tree([4, 1, 2, 5], [-1, 0, 0, 2])
    r = verify(t, torch.zeros(4, V), SamplingParams(temperature=1.0), choices=torch.tensor([2, 0, 5, 3]))
    assert r.emitted_tokens.tolist() == [2, 5, 3]


def test_residual_of_a_tiny_difference_is_exact():
    """The issue's case: p = (.5 + 4e-7, .5 - 4e-7), q = (.5, .5). After a rejection the bonus must be token 0
    (a mass threshold drew it from p instead); the first token's exact law equals p within 1e-12."""
    p = torch.tensor([0.5 + 4e-7, 0.5 - 4e-7], dtype=torch.float64)
    q = torch.tensor([0.5, 0.5], dtype=torch.float64)
    assert torch.equal(residual(p, q), torch.tensor([1.0, 0.0], dtype=torch.float64))
    law = [0.0, 0.0]
    for x in (0, 1):  # the drafted token, drawn from q; then accepted w.p. min(1, p/q), else the residual's token
        accept = min(1.0, float(p[x] / q[x]))
        law[x] += float(q[x]) * accept
        for y, r in enumerate(residual(p, q).tolist()):
            law[y] += float(q[x]) * (1 - accept) * r
    assert law == pytest.approx(p.tolist(), abs=1e-12)
