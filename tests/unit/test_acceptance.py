"""Batched acceptance (sgl_dspark.acceptance and the step's accept stage) against the per-request verifier, its
oracle: literal cases, random trees, and a mixed batch of greedy, seeded and sampled requests."""

import random

import pytest
import torch

from sgl_dspark.acceptance import inverse_cdf, match_paths, sample_chains, sample_trees
from sgl_dspark.graft import Grafted
from sgl_dspark.layout import accept_rows, pack_trees, verify_results
from sgl_dspark.sampling import SamplerBatch, SamplingParams, greedy_choices, target_probs
from sgl_dspark.seeded import seeded_choices
from sgl_dspark.step import DecodeStep, StepRequest, accept, accept_on_device, tree_bounds
from sgl_dspark.tree import DraftTree
from sgl_dspark.verify import children, verify_choices, verify_sampling


def tree(tokens, parents, probs=None):
    n = len(tokens)
    return DraftTree(torch.tensor(tokens), torch.tensor(parents), torch.ones(n), probs)


def paths(trees, choices, stride=6, width=None):
    rows = pack_trees(trees, [0] * len(trees), width)
    return match_paths(rows.tokens.view(len(trees), -1), rows.parents, rows.mask, rows.sizes, choices, stride)


def test_the_first_matching_child_is_taken_and_its_choice_is_the_bonus():
    out = paths([tree([5, 6, 7, 8], [-1, 0, 0, 1])], torch.tensor([[7, 8, 2, 3]]))
    assert out.accept_index.tolist() == [[0, 2, -1, -1]]
    assert out.tokens.tolist() == [[7, 2, 0, 0, 0, 0]]
    assert out.accept_lens.tolist() == [2]


def test_a_whole_chain_then_its_bonus_and_a_second_request_in_its_own_rows():
    out = paths([tree([1, 2, 3], [-1, 0, 1]), tree([4, 9, 9], [-1, 0, 1])],
                torch.tensor([[2, 3, 4], [8, 0, 0]]))
    assert out.accept_index.tolist() == [[0, 1, 2], [3, -1, -1]]
    assert out.tokens.tolist() == [[2, 3, 4, 0, 0, 0], [8, 0, 0, 0, 0, 0]]
    assert out.accept_lens.tolist() == [3, 1]


def test_padding_nodes_are_never_accepted_even_when_they_match():
    """A lone anchor 5 padded to width 3: the padding nodes repeat token 5 off the root, whose choice is 5."""
    out = paths([tree([5], [-1]), tree([1, 2, 3], [-1, 0, 1])], torch.tensor([[5, 5, 5], [7, 0, 0]]))
    assert out.accept_index.tolist() == [[0, -1, -1], [3, -1, -1]]
    assert out.tokens[:, :2].tolist() == [[5, 0], [7, 0]]


def test_equal_siblings_take_the_elder_and_never_its_younger_twin():
    """Nodes 1 and 2 both carry the root's choice 6: node 1 is taken, node 3 (under node 2) cannot be reached."""
    out = paths([tree([5, 6, 6, 7, 8], [-1, 0, 0, 2, 1])], torch.tensor([[6, 8, 7, 0, 1]]))
    assert out.accept_index.tolist() == [[0, 1, 4, -1, -1]]
    assert out.tokens.tolist() == [[6, 8, 1, 0, 0, 0]]


def random_tree(rng: random.Random, vocab: int) -> DraftTree:
    n = rng.randint(1, 7)
    parents = [-1] + [rng.randrange(i) if rng.random() < 0.5 else i - 1 for i in range(1, n)]
    return tree([rng.randrange(vocab) for _ in range(n)], parents)


def test_random_trees_match_the_per_request_walk():
    rng = random.Random(0)
    for _ in range(300):
        bs, vocab = rng.randint(1, 5), rng.choice([2, 3, 5])
        trees = [random_tree(rng, vocab) for _ in range(bs)]
        width = max(t.size for t in trees) + rng.randint(0, 2)
        choices = torch.randint(vocab, (bs, width), generator=torch.Generator().manual_seed(rng.randrange(1 << 30)))
        out = paths(trees, choices, stride=width + 1, width=width)
        oracle = accept_rows([verify_choices(t, choices[b, :t.size]) for b, t in enumerate(trees)], width, width + 1)
        assert torch.equal(out.accept_index, oracle.accept_index), trees
        assert torch.equal(out.tokens, oracle.tokens) and torch.equal(out.accept_lens, oracle.accept_lens)


def test_results_read_back_from_the_rows_are_the_walks():
    trees = [tree([5, 6, 7, 8], [-1, 0, 0, 1]), tree([1, 2], [-1, 0])]
    choices = torch.tensor([[7, 8, 2, 3], [2, 9, 0, 0]])
    walks = [verify_choices(t, choices[b, :t.size]) for b, t in enumerate(trees)]
    back = verify_results(paths(trees, choices, stride=5), width=4)
    for walk, result in zip(walks, back):
        assert result.accepted_nodes.tolist() == walk.accepted_nodes.tolist()
        assert result.emitted_tokens.tolist() == walk.emitted_tokens.tolist() and result.last_node == walk.last_node


class Replay:
    """The per-request verifier's draws (sgl_dspark.verify.Draws) replayed from given coins: the i-th acceptance test
    reads coins[i + 1] (node i + 1's), the bonus is the inverse CDF at `bonus`."""

    def __init__(self, coins: torch.Tensor, bonus: torch.Tensor):
        self.coins, self.bonus, self.used = coins.tolist(), bonus, 1

    def accept(self, p_x, q_x) -> bool:
        u, self.used = self.coins[self.used], self.used + 1
        return bool(u * q_x < p_x)

    def sample(self, p) -> int:
        return int(inverse_cdf(p[None], self.bonus[None])[0])


def test_a_rejection_draws_the_bonus_from_the_residual():
    """p after the root (.5, .5); node 1 drafted token 0 with q = (1, 0); coin .7: .7 * 1 < .5 fails, so the bonus
    comes from normalize(max(0, p - q)) = (0, 1) whatever its coin."""
    on_path, bonus = sample_chains(torch.tensor([[1, 0]]), torch.tensor([2]), torch.tensor([[[.5, .5], [.9, .1]]]),
                                   torch.tensor([[[0., 0.], [1., 0.]]]), torch.tensor([[0., .7]], dtype=torch.float64),
                                   torch.tensor([0.01], dtype=torch.float64))
    assert on_path.tolist() == [[True, False]] and bonus.tolist() == [1]
    assert inverse_cdf(torch.tensor([[.2, 0., .8]]), torch.tensor([.5])).tolist() == [2]


def test_a_step_of_lone_anchors_draws_each_bonus_from_the_target():
    """Width 1 (nothing drafted anywhere, e.g. --speculative-dspark-max-verify 0): every sampled request's token is
    the inverse CDF of its target row."""
    on_path, bonus = sample_chains(torch.tensor([[3], [1]]), torch.tensor([1, 1]), torch.tensor([[[.1, .2, .7]],
                                                                                                 [[.5, .5, 0.]]]),
                                   torch.zeros(2, 1, 3), torch.rand(2, 1, dtype=torch.float64),
                                   torch.tensor([0.35, 0.75], dtype=torch.float64))
    assert on_path.tolist() == [[True], [True]] and bonus.tolist() == [2, 1]


def test_sampled_chains_accept_as_the_per_request_verifier_fed_the_same_coins():
    gen = torch.Generator().manual_seed(5)
    for _ in range(200):
        k, w, vocab = 3, int(torch.randint(1, 6, (), generator=gen)), 4
        sizes = torch.randint(1, w + 1, (k,), generator=gen)
        probs = torch.softmax(2 * torch.randn(k, w, vocab, generator=gen), -1)
        q = torch.softmax(2 * torch.randn(k, w, vocab, generator=gen), -1)
        tokens = torch.multinomial(q.view(-1, vocab), 1, generator=gen).view(k, w)
        coins = torch.rand(k, w, generator=gen, dtype=torch.float64)
        bonus_coins = torch.rand(k, generator=gen, dtype=torch.float64)
        on_path, bonus = sample_chains(tokens, sizes, probs, q, coins, bonus_coins)
        for b in range(k):
            n = int(sizes[b])
            chain = DraftTree.chain(tokens[b, :n], torch.ones(n), q[b, :n])
            walk = verify_sampling(chain, probs[b, :n], Replay(coins[b], bonus_coins[b]))
            assert on_path[b].nonzero().flatten().tolist() == [0, *walk.accepted_nodes.tolist()]
            assert int(bonus[b]) == walk.bonus_token


def test_a_mixed_step_accepts_as_the_per_request_verifier_with_the_same_draws():
    """Greedy, seeded and sampled requests (a chain, and a tree with a one-hot sibling) in one step: the step's accept
    stage gives the rows the per-request verifier gives, the sampled requests fed the coins the step draws first from
    the generator (a row per sampled request, then a bonus coin each)."""
    vocab, width = 6, 4
    gen = torch.Generator().manual_seed(3)
    logits = torch.randn(4 * width, vocab, generator=gen) * 2
    q = torch.softmax(torch.randn(4, vocab, generator=gen), -1)
    onehot = torch.nn.functional.one_hot(torch.tensor([0, 2, 5, 1]), vocab).float()
    trees = [tree([1, 2, 3, 4], [-1, 0, 1, 2]),
             tree([2, 4, 1], [-1, 0, 1], torch.cat([torch.zeros(1, vocab), q[:2]])),
             tree([3, 0, 5, 2], [-1, 0, 0, 1], torch.stack([torch.zeros(vocab), q[2], onehot[2], q[3]])),
             tree([0, 5], [-1, 0], torch.cat([torch.zeros(1, vocab), q[:1]]))]
    params = [SamplingParams(temperature=0.0), SamplingParams(temperature=0.8),
              SamplingParams(temperature=1.0, top_k=3), SamplingParams(temperature=0.7)]
    seeds = [None, None, None, 11]
    rows = pack_trees(trees, [5, 7, 9, 3], width)
    step = DecodeStep([Grafted.plain(t) for t in trees], [t.size - 1 for t in trees], [True] * 4, rows, [5, 7, 9, 3])
    reqs = [StepRequest(f"r{b}", [1], [t.tokens[0]], n, torch.arange(n), p, s)
            for b, (t, p, s, n) in enumerate(zip(trees, params, seeds, [5, 7, 9, 3]))]
    sampler = SamplerBatch.of(params)
    accepted = set()
    for seed in range(40):
        verdict = accept(step, reqs, logits.clone(), sampler, torch.Generator().manual_seed(seed), stride=5)
        draws = torch.Generator().manual_seed(seed)
        coins = torch.rand(2, width, generator=draws, dtype=torch.float64)
        bonus = torch.rand(2, generator=draws, dtype=torch.float64)
        rows_of = [logits[b * width:b * width + t.size] for b, t in enumerate(trees)]
        oracle = accept_rows([
            verify_choices(trees[0], greedy_choices(rows_of[0], sampler)),
            verify_sampling(trees[1], target_probs(rows_of[1], params[1], sampler), Replay(coins[0], bonus[0])),
            verify_sampling(trees[2], target_probs(rows_of[2], params[2], sampler), Replay(coins[1], bonus[1])),
            verify_choices(trees[3], seeded_choices(rows_of[3], params[3], 11, rows.positions[12:14],
                                                    sampler.filtered))], width, 5)
        assert torch.equal(verdict.rows.accept_index, oracle.accept_index)
        assert torch.equal(verdict.rows.tokens, oracle.tokens)
        assert torch.equal(verdict.rows.accept_lens, oracle.accept_lens)
        assert [r.tau for r in verdict.results] == oracle.accept_lens.tolist()
        accepted |= {(b, int(n)) for b, n in enumerate(oracle.accept_lens)}
    assert {(1, 1), (1, 2), (2, 1)} <= accepted  # the sampled requests both accept and reject over the seeds


@pytest.mark.parametrize("sampler", [SamplerBatch(True, False, None), SamplerBatch(False, True, None)],
                         ids=["all-greedy", "greedy-in-a-sorting-batch"])
def test_greedy_acceptance_reads_nothing_back_to_the_host(sampler):
    """On the meta device (tensors without data) any read back to the host raises: the batched pass of a greedy step
    runs there whole, so on a GPU its logits never leave the device; the verdict crosses once (`to_host`)."""
    trees = [tree([5, 6, 7, 8], [-1, 0, 0, 1]), tree([1, 2], [-1, 0])]
    rows = pack_trees(trees, [3, 4])
    step = DecodeStep([Grafted.plain(t) for t in trees], [3, 1], [True, True], rows, [3, 4])
    reqs = [StepRequest(f"r{b}", [1], [t.tokens[0]], n, torch.arange(n), SamplingParams(temperature=0.0))
            for b, (t, n) in enumerate(zip(trees, [3, 4]))]
    out = accept_on_device(step, reqs, torch.empty(8, 10, device="meta"), sampler, torch.Generator(), stride=5)
    assert out.accept_index.device.type == "meta" and out.tokens.shape == (2, 5)
    with pytest.raises(NotImplementedError):
        out.to_host()  # the one transfer, which meta cannot make


def random_forest(gen: torch.Generator, k: int, w: int, vocab: int):
    """k random trees of 1..w nodes padded to w as `pack_trees` pads them (padding hangs off the root), each node's q a
    softmax row or a one-hot row (a lookup candidate), its token drawn from q; sibling tokens may repeat."""
    tokens, parents = torch.zeros(k, w, dtype=torch.long), torch.zeros(k, w, dtype=torch.long)
    q, sizes = torch.zeros(k, w, vocab), torch.randint(1, w + 1, (k,), generator=gen)
    for b in range(k):
        parents[b, 0] = -1
        for i in range(1, int(sizes[b])):
            parents[b, i] = int(torch.randint(0, i, (), generator=gen))
            if bool(torch.rand((), generator=gen) < 0.5):
                q[b, i] = torch.softmax(2 * torch.randn(vocab, generator=gen), -1)
            else:
                q[b, i, int(torch.randint(vocab, (), generator=gen))] = 1.0
            tokens[b, i] = int(torch.multinomial(q[b, i], 1, generator=gen))
    return tokens, parents, sizes, q


def test_sampled_trees_accept_as_the_per_request_verifier_fed_the_same_coins():
    """300 random forests (one-hot and drafted siblings, repeated sibling tokens, padding): the batched tree rule gives
    the per-request verifier's path and bonus, each request's i-th acceptance test reading coins[i + 1]."""
    gen = torch.Generator().manual_seed(7)
    later_sibling = 0
    for _ in range(300):
        k, w, vocab = 3, int(torch.randint(1, 7, (), generator=gen)), 4
        tokens, parents, sizes, q = random_forest(gen, k, w, vocab)
        probs = torch.softmax(2 * torch.randn(k, w, vocab, generator=gen), -1)
        coins = torch.rand(k, w, generator=gen, dtype=torch.float64)
        bonus_coins = torch.rand(k, generator=gen, dtype=torch.float64)
        real = [DraftTree(tokens[b, :int(n)], parents[b, :int(n)], torch.ones(int(n)), q[b, :int(n)])
                for b, n in enumerate(sizes)]
        on_path, bonus = sample_trees(tokens, parents, sizes, probs, q, coins, bonus_coins, *tree_bounds(real))
        for b, t in enumerate(real):
            walk = verify_sampling(t, probs[b, :t.size], Replay(coins[b], bonus_coins[b]))
            assert on_path[b].nonzero().flatten().tolist() == [0, *walk.accepted_nodes.tolist()]
            assert int(bonus[b]) == walk.bonus_token
            kids = children(t.parents)
            later_sibling += any(n not in (kids[int(t.parents[n])][:1]) for n in walk.accepted_nodes.tolist())
    assert later_sibling > 10  # accepted after an elder sibling's rejection, many times


def test_a_rejected_one_hot_sibling_leaves_the_next_one_the_residual():
    """p after the root (.5, .5); children token 0 and token 1, both one-hot; coin .7 rejects the first (.7 >= .5), p
    becomes (0, 1) and the second is accepted whatever its coin."""
    on_path, bonus = sample_trees(torch.tensor([[9, 0, 1]]), torch.tensor([[-1, 0, 0]]), torch.tensor([3]),
                                  torch.tensor([[[.5, .5], [.3, .7], [.6, .4]]]),
                                  torch.tensor([[[0., 0.], [1., 0.], [0., 1.]]]),
                                  torch.tensor([[0., .7, .99]], dtype=torch.float64),
                                  torch.tensor([0.5], dtype=torch.float64), depth=1, fanout=2)
    assert on_path.tolist() == [[True, False, True]] and bonus.tolist() == [0]  # then node 2's p (.6, .4) at .5
