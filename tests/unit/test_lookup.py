"""Lookup proposer and graft: literal suffix matches, the incremental index against a rebuilt one, grafts onto
greedy and sampled trees (shared prefix, branch, order, one-hot rows, no duplicate siblings), acceptance
statistics and the feedback helpers, and a statistical check that verifying grafted trees stays lossless."""

import random
import zlib

import pytest
import torch
from test_verify_stats import ALPHA, ANCHOR, DRAFT_PROBS, PARAMS, TARGET_LOGITS, V, chi_square_pvalue, \
    draft_chain, draft_tree_iid, expected_pairs

import sgl_dspark.graft as graft_mod
from sgl_dspark.graft import Grafted, fold, graft, lookup_accepted, outcome
from sgl_dspark.lookup import Candidate, LookupIndex, LookupKnobs, LookupOutcome, LookupRegistry, LookupStats
from sgl_dspark.sampling import SamplingParams, target_probs
from sgl_dspark.budget import Knobs, PlanInput, VerifyAll
from sgl_dspark.tree import DraftTree, depths
from sgl_dspark.verify import VerifyResult, children, verify

real_start = graft_mod._start
KNOBS = LookupKnobs(max_ngram=3, min_ngram=1, width=2, max_len=4)


def proposals(history: list[int], **knobs) -> list[tuple[tuple[int, ...], int]]:
    index = LookupIndex(LookupKnobs(**{"max_ngram": 3, "max_len": 4, **knobs}))
    index.append(history)
    return [(c.tokens, c.match) for c in index.propose()]


def stats() -> LookupStats:
    return LookupStats(KNOBS, LookupStats(KNOBS))


def chain(tokens: list[int], probs: bool = False) -> DraftTree:
    n = len(tokens)
    rows = torch.nn.functional.one_hot(torch.tensor(tokens), 16).float() if probs else None
    return DraftTree.chain(torch.tensor(tokens), torch.tensor([1.0] + [0.9] * (n - 1)), rows)


def cand(*tokens: int, rank: int = 0, match: int = 2) -> Candidate:
    return Candidate(tuple(tokens), match, rank)


def result(nodes: list[int], tree: DraftTree) -> VerifyResult:
    acc = torch.tensor(nodes, dtype=torch.long)
    return VerifyResult(acc, tree.tokens[acc], bonus_token=0, last_node=nodes[-1] if nodes else 0)


# -- suffix matching ------------------------------------------------------------------------------------------

def test_suffix_match_copies_what_followed():
    assert proposals([5, 6, 7, 8, 5, 6]) == [((7, 8, 5, 6), 2)]
    assert proposals([5, 6, 7, 8, 5, 6], max_len=6) == [((7, 8, 5, 6, 7, 8), 2)]  # a loop keeps looping


def test_most_recent_occurrence_first_then_older_ones():
    assert proposals([1, 2, 9, 1, 2, 8, 1, 2]) == [((8, 1, 2, 8), 2), ((9, 1, 2, 8), 2)]


def test_longer_suffix_wins_over_a_more_recent_shorter_one():
    assert proposals([3, 1, 2, 7, 4, 1, 2, 9, 3, 1, 2]) == [((7, 4, 1, 2), 3), ((9, 3, 1, 2), 2)]


def test_identical_continuations_are_proposed_once():
    assert proposals([1, 2, 5, 1, 2, 5, 1, 2], width=3) == [((5, 1, 2, 5), 3)]


def test_knobs_are_validated():
    with pytest.raises(ValueError):
        LookupKnobs(min_ngram=3, max_ngram=2)
    with pytest.raises(ValueError):
        LookupKnobs(prior_accept=1.0)


def test_no_match_no_candidate_and_width_and_min_ngram():
    assert proposals([1, 2, 3]) == []
    assert proposals([7, 1, 4, 2, 7], min_ngram=2) == []
    assert proposals([1, 2, 9, 1, 2, 8, 1, 2], width=1) == [((8, 1, 2, 8), 2)]


def test_incremental_index_equals_rebuilt_index():
    rng = random.Random(0)
    history = [rng.randrange(5) for _ in range(300)]
    whole, steps = LookupIndex(KNOBS), LookupIndex(KNOBS)
    whole.append(history)
    i = 0
    while i < len(history):
        n = rng.choice([1, 1, 2, 7])
        steps.append(history[i:i + n])
        i += n
        rebuilt = LookupIndex(KNOBS)
        rebuilt.append(history[:len(steps)])
        assert steps.propose() == rebuilt.propose()
    assert (steps.tokens, steps.last, steps.prev) == (whole.tokens, whole.last, whole.prev)


def test_index_of_a_few_thousand_tokens_is_cheap():
    import time
    rng = random.Random(1)
    history = [rng.randrange(500) for _ in range(4000)]
    index = LookupIndex(LookupKnobs())
    start = time.perf_counter()
    index.append(history)
    for t in history[:200]:
        index.append([t])
        index.propose()
    assert time.perf_counter() - start < 1.0


def test_registry_syncs_new_tokens_and_drops_finished_requests():
    reg = LookupRegistry(KNOBS)
    a = reg.sync("a", [5, 6, 7], [8, 5])
    assert a.index.tokens == [5, 6, 7, 8, 5]
    assert reg.sync("a", [5, 6, 7], [8, 5, 6]) is a and a.index.tokens == [5, 6, 7, 8, 5, 6]
    assert a.index.propose()[0].tokens == (7, 8, 5, 6)
    assert reg.sync("a", [5, 6, 7], [9]).index.tokens == [5, 6, 7, 9]  # shorter history: re-indexed
    reg.sync("b", [1], [])
    reg.retain(["b"])
    assert list(reg.entries) == ["b"]


# -- graft ----------------------------------------------------------------------------------------------------

def test_greedy_graft_reuses_the_shared_prefix_and_branches_off():
    g = graft(chain([9, 1, 2, 3]), [cand(1, 2, 4, 5)], stats(), max_nodes=8)
    assert g.tree.tokens.tolist() == [9, 1, 2, 3, 4, 5]
    assert g.tree.parents.tolist() == [-1, 0, 1, 2, 2, 4]
    assert g.neural.tolist() == [True, True, True, True, False, False]
    assert g.lookup_only.tolist() == [False, False, False, False, True, True]
    assert g.tree.draft_probs is None
    assert torch.allclose(g.tree.confidence, torch.tensor([1.0, 0.9, 0.9, 0.9, 0.5, 0.5]))  # max(drafter, lookup)


def test_candidates_share_their_prefix_too_and_the_budget_caps_new_nodes():
    g = graft(chain([9, 1]), [cand(2, 3, 4), cand(2, 5, 6, rank=1)], stats(), max_nodes=4)
    assert g.tree.tokens.tolist() == [9, 1, 2, 3, 4, 5]
    assert g.tree.parents.tolist() == [-1, 0, 0, 2, 3, 2]
    assert g.group.tolist() == [-1, -1, 1, 1, 1, 1 * 3 + 1]  # the second chain's own nodes: rank-1 group


def test_sampled_graft_keeps_lookup_apart_until_selected_then_folds():
    g = graft(chain([9, 1, 2, 3], probs=True), [cand(1, 2, 4, 5)], stats(), max_nodes=8)
    assert g.tree.tokens.tolist() == [9, 1, 2, 3, 1, 2, 4, 5]
    assert g.tree.parents.tolist() == [-1, 0, 1, 2, 0, 4, 5, 6]
    s = g.select(torch.arange(g.tree.size))
    assert s.tree.tokens.tolist() == [9, 1, 2, 3, 4, 5]
    assert s.tree.parents.tolist() == [-1, 0, 1, 2, 2, 4]
    assert s.group.tolist() == [-1, 1, 1, -1, 1, 1] and s.neural.tolist() == [True] * 4 + [False] * 2
    assert s.tree.draft_probs.argmax(1).tolist() == [9, 1, 2, 3, 4, 5]


def test_selection_without_the_drafter_node_keeps_the_lookup_branch():
    g = graft(chain([9, 1, 2], probs=True), [cand(1, 4)], stats(), max_nodes=8)
    s = g.select(torch.tensor([0, 3, 4]))
    assert s.tree.tokens.tolist() == [9, 1, 4] and s.tree.parents.tolist() == [-1, 0, 1]
    assert s.lookup_only.tolist() == [False, True, True]


def test_sampled_child_stays_first_and_new_rows_are_one_hot():
    tree = DraftTree(torch.tensor([9, 7, 8]), torch.tensor([-1, 0, 1]), torch.tensor([1.0, 0.5, 0.5]),
                     torch.softmax(torch.randn(3, 16, generator=torch.Generator().manual_seed(0)), -1))
    g = graft(tree, [cand(8, 7), cand(7, 3, rank=1)], stats(), max_nodes=8).select(torch.arange(7))
    assert g.tree.tokens.tolist() == [9, 7, 8, 8, 7, 3]
    assert children(g.tree.parents) == [[1, 3], [2, 5], [], [4], [], []]  # drafter children before lookup ones
    assert torch.equal(g.tree.draft_probs[:3], tree.draft_probs)
    assert torch.equal(g.tree.draft_probs[3:], torch.nn.functional.one_hot(torch.tensor([8, 7, 3]), 16).float())


def test_no_duplicate_siblings_after_select():
    rng = random.Random(3)
    for _ in range(50):
        tree = chain([9] + [rng.randrange(3) for _ in range(3)], probs=rng.random() < 0.5)
        cands = [cand(*[rng.randrange(3) for _ in range(3)], rank=r) for r in range(3)]
        g = graft(tree, cands, stats(), max_nodes=6)
        g = g.select(torch.arange(g.tree.size))
        pairs = list(zip(g.tree.parents.tolist(), g.tree.tokens.tolist()))[1:]
        assert len(pairs) == len(set(pairs)), pairs


def test_fold_literal_and_plain():
    tree = DraftTree(torch.tensor([9, 1, 2, 1, 4]), torch.tensor([-1, 0, 1, 0, 3]), torch.ones(5))
    g = Grafted(tree, torch.tensor([True, True, True, False, False]), torch.tensor([-1, -1, -1, 0, 0]))
    f = fold(g)
    assert f.tree.tokens.tolist() == [9, 1, 2, 4] and f.tree.parents.tolist() == [-1, 0, 1, 1]
    assert f.group.tolist() == [-1, 0, -1, 0]
    plain = Grafted.plain(tree)
    assert fold(plain) is plain and not plain.lookup_only.any()


# -- statistics and feedback ------------------------------------------------------------------------------------

def observed(accepts: int, trials: int, depth: int = 1) -> LookupOutcome:
    return LookupOutcome(torch.zeros(trials, dtype=torch.long), torch.full((trials,), depth),
                         torch.arange(trials) < accepts)


def test_stats_start_at_the_prior_and_rise_with_accepts():
    fresh = stats()
    assert fresh.conf(torch.tensor([0, 5]), torch.tensor([1, 9])).tolist() == [0.5, 0.5]
    confs = []
    for accepts in range(6):
        s = stats()
        s.observe(observed(accepts, 5))
        confs.append(float(s.conf(torch.tensor([0]), torch.tensor([1]))))
        assert float(s.conf(torch.tensor([0]), torch.tensor([2]))) == pytest.approx(0.5)  # other depth untouched
    assert confs == sorted(confs) and confs[0] < 0.5 < confs[-1]


def test_a_new_request_starts_from_the_global_estimate():
    reg = LookupRegistry(KNOBS)
    reg.sync("a", [1], []).stats.observe(observed(20, 20))
    new = reg.sync("b", [1], []).stats.conf(torch.tensor([0]), torch.tensor([1]))
    assert float(new) == pytest.approx(21 / 22)  # global Beta(1, 1) + 20 of 20


def test_outcome_counts_nodes_whose_parent_was_accepted():
    g = graft(chain([9, 1, 2, 3]), [cand(1, 2, 4, 5), cand(6, rank=1, match=1)], stats(), max_nodes=8)
    # tokens [9, 1, 2, 3, 4, 5, 6], parents [-1, 0, 1, 2, 2, 4, 0]
    r = result([1, 2, 4], g.tree)
    o = outcome(g, r)
    assert o.depth.tolist() == [1, 2, 3, 4, 1] and o.accepted.tolist() == [True, True, True, False, False]
    assert o.group.tolist() == [1, 1, 1, 1, 3 + 2]
    assert lookup_accepted(g, r) == 1
    assert lookup_accepted(g, result([], g.tree)) == 0 and outcome(g, result([], g.tree)).depth.tolist() == [1, 1]


def test_greedy_verification_of_a_grafted_tree_takes_the_argmax_path():
    g = graft(chain([9, 1, 2, 3]), [cand(1, 2, 4, 5)], stats(), max_nodes=8)
    logits = torch.zeros(g.tree.size, 16)
    logits[torch.arange(6), torch.tensor([1, 2, 4, 0, 5, 7])] = 1.0  # argmax after each node
    r = verify(g.tree, logits, SamplingParams(temperature=0.0))
    assert r.accepted_tokens.tolist() == [1, 2, 4, 5] and r.bonus_token == 7 and lookup_accepted(g, r) == 2


# -- lossless sampling verification of grafted trees ------------------------------------------------------------

LOOKUP = int(DRAFT_PROBS[0, ANCHOR].argmax())  # often the drafter's own first token: folds happen
CANDIDATES = [cand(LOOKUP, int(DRAFT_PROBS[1, LOOKUP].argmax()), 1), cand((LOOKUP + 1) % V, 2, rank=1)]
TRIALS = 2000


@pytest.fixture(autouse=True, scope="module")
def one_thread():
    """Tiny tensors: threads only add contention on the shared CPUs."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


def verify_all(g: Grafted) -> torch.Tensor:
    return torch.arange(g.tree.size)


def scheduled(cap: int):
    """The real scheduler's selection, at most `cap` draft nodes (lookup confidence 0.5 at depth 1)."""
    def select(g: Grafted) -> torch.Tensor:
        return VerifyAll(Knobs(0, cap, None, 0.0)).plan(PlanInput((g.tree,))).selections[0]
    return select


def first_two(shape, select, drafter_conf: float, params: SamplingParams, gen: torch.Generator,
              trials: int) -> torch.Tensor:
    """[trials, 2]: the first two tokens committed after verifying grafted trees (then plain sampling)."""
    drafts = shape(trials, gen)
    conf = torch.tensor([1.0] + [drafter_conf] * (drafts.parents.shape[0] - 1))
    out = torch.empty(trials, 2, dtype=torch.long)
    grafted: dict[tuple[int, ...], DraftTree] = {}  # the drafted tokens determine rows, graft and selection
    for t in range(trials):
        key = tuple(drafts.tokens[t].tolist())
        if key not in grafted:
            g = graft(DraftTree(drafts.tokens[t], drafts.parents, conf, drafts.draft_probs[t]), CANDIDATES, stats(), 8)
            grafted[key] = g.select(select(g)).tree
        tree = grafted[key]
        emitted = verify(tree, TARGET_LOGITS[depths(tree.parents), tree.tokens], params, gen).emitted_tokens
        out[t, 0] = emitted[0]
        out[t, 1] = emitted[1] if emitted.shape[0] > 1 else -1
    missing = out[:, 1] < 0
    out[missing, 1] = torch.multinomial(target_probs(TARGET_LOGITS[1, out[missing, 0]], params), 1, generator=gen)[:, 0]
    return out


def pvalues(shape, select, drafter_conf: float, name: str, trials: int = TRIALS) -> tuple[float, float]:
    params = PARAMS[name]
    gen = torch.Generator().manual_seed(zlib.crc32(f"{shape.__name__}/{drafter_conf}/{name}".encode()))
    pairs = first_two(shape, select, drafter_conf, params, gen, trials)
    joint = expected_pairs(params)
    return (chi_square_pvalue(pairs[:, 0], joint.sum(1)),
            chi_square_pvalue(pairs[:, 0] * V + pairs[:, 1], joint.flatten()))


@pytest.mark.parametrize("shape, select, drafter_conf, name", [
    (draft_chain, verify_all, 0.6, "t1.0"),  # every lookup node verified: deep folds
    (draft_chain, scheduled(4), 0.4, "top_k3"),  # lookup outranks the drafter
    (draft_tree_iid, scheduled(4), 0.6, "t0.7"),  # drafter outranks the lookup
    (draft_chain, scheduled(1), 0.4, "t1.0"),  # the negative control's setting with the real graft
], ids=["chain-all", "chain-scheduled", "tree-scheduled", "chain-one"])
def test_verifying_grafted_trees_follows_the_target(shape, select, drafter_conf, name):
    first, joint = pvalues(shape, select, drafter_conf, name)
    assert first > ALPHA and joint > ALPHA, (first, joint)


def test_negative_control_merging_sampled_nodes_before_planning_is_detected(monkeypatch):
    """Walking lookup chains into sampled nodes before the plan (as for greedy trees) lets a sampled node's
    own token decide whether it is verified: here the drafter's first node outranks the lookup branch only
    when it carries the lookup's token (merged confidence max(0.4, 0.5)), so it is verified only then."""
    monkeypatch.setattr(graft_mod, "_start", lambda tree: real_start(DraftTree(tree.tokens, tree.parents,
                                                                               tree.confidence)))
    first, joint = pvalues(draft_chain, scheduled(1), 0.4, "t1.0", trials=500)
    assert first < ALPHA and joint < ALPHA, (first, joint)
