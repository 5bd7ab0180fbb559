"""Verify budget: literal budgets for each mode, prefix-closed tree selections, knobs, and paper appendix A
(a retrospective global search biases the output; the early stop and the lagged budget do not)."""

import copy
import dataclasses
import random

import pytest
import torch

from sgl_dspark.config import BUDGET_MODES, load_config
from sgl_dspark.cost import StepCostTable
from sgl_dspark.budget import (BUDGETS, CostedBudget, Knobs, LaggedBudget, PlanInput,
                                  PrefixBudget, StepResult, VerifyAll, candidates, early_stop_budget,
                                  global_budget, level_ends, level_sequence, make_pool, make_budget,
                                  batch_rows, path_products, rank_within_request, throughput)
from sgl_dspark.tree import DraftTree, depths, survival

KNOBS = Knobs(min_verify=0, max_verify=None, latency_target_s=None, refit_alpha=0.0)
# B -> seconds; Theta for the two-request batch below, its open nodes in level order (.9 .5 | .72 .25 | .144; a row
# per root and admitted node, B = 2 .. 7): [2.0, 2.9, 3.091, 3.433, 2.913, 2.257], looked at the level ends 0, 2, 4, 5
TABLE = StepCostTable((2, 3, 4, 5, 6, 7), (1.0, 1.0, 1.1, 1.2, 1.5, 2.0))


def chain(*conf: float) -> DraftTree:
    return DraftTree.chain(torch.arange(len(conf) + 1), torch.tensor([1.0, *conf], dtype=torch.float64))


def tree(parents: list[int], conf: list[float]) -> DraftTree:
    return DraftTree(torch.arange(len(parents)), torch.tensor(parents), torch.tensor(conf, dtype=torch.float64))


def selected(plan) -> list[list[int]]:
    return [s.tolist() for s in plan.selections]


TWO = PlanInput((chain(0.9, 0.8, 0.2), chain(0.5, 0.5)))  # survival [.9 .72 .144], [.5 .25]


def test_path_products_match_the_tree_helpers():
    t = tree([-1, 0, 0, 1, 3, 2], [1.0, 0.5, 0.4, 0.5, 0.9, 0.2])
    surv, depth = path_products(t.parents, t.confidence)
    assert torch.allclose(surv, survival(t).double()) and depth.tolist() == depths(t.parents).tolist()
    assert [round(v, 6) for v in surv.tolist()] == [1.0, 0.5, 0.4, 0.25, 0.225, 0.08]


def test_rank_within_request_and_budgets():
    assert rank_within_request(torch.tensor([1, 0, 1, 1, 0]), 2).tolist() == [0, 0, 1, 2, 1]
    assert early_stop_budget(torch.tensor([2.0, 2.9, 3.3, 3.2, 3.5])) == 2
    assert early_stop_budget(torch.tensor([2.0, 1.0, 9.0])) == 0
    assert early_stop_budget(torch.tensor([1.0, 2.0, 3.0])) == 2
    assert early_stop_budget(torch.tensor([1.0, 1.0])) == 0  # an equal Theta is not a raise
    assert global_budget(torch.tensor([2.0, 1.0, 9.0, 9.0])) == 2
    assert level_ends(torch.tensor([1, 1, 2, 3, 3])).tolist() == [0, 2, 3, 5]
    assert level_ends(torch.zeros(0, dtype=torch.long)).tolist() == [0]


def test_candidates_are_in_survival_order():
    c = candidates(TWO.trees)
    assert c.request.tolist() == [0, 0, 1, 1, 0]
    assert c.node.tolist() == [1, 2, 1, 2, 3]
    assert c.rank.tolist() == [0, 1, 0, 1, 2]
    assert level_sequence(c, torch.ones(5, dtype=torch.bool)).tolist() == [0, 2, 1, 3, 4]
    assert level_sequence(c, torch.tensor([True, True, False, True, True])).tolist() == [0, 1, 3, 4]


def test_prefix_two_requests_literal():
    plan = PrefixBudget(KNOBS, TABLE).plan(TWO)
    assert selected(plan) == [[0, 1], [0, 1]]  # level 1 raises Theta (3.091 against 2.0)
    assert plan.verify_lengths.tolist() == [1, 1]  # level 2 lowers it (2.913): the stop, though 3.433 lies inside
    assert plan.batch_tokens == 4 and plan.expected_accepts == pytest.approx(2 + 0.9 + 0.5)


def test_level_stop_admits_what_a_node_by_node_stop_misses():
    """Four requests, B = 4: the step's cost jumps at the fifth row (a kernel's row-count cliff), so the first node
    alone lowers Theta (4.6 / 1.45 < 4 / 1.2), while the whole level gains 2.4 for little more (6.4 / 1.5)."""
    table = StepCostTable((4, 5, 8, 12), (1.2, 1.45, 1.5, 2.4))
    batch = PlanInput(tuple(chain(0.6, 0.5) for _ in range(4)))
    plan = PrefixBudget(KNOBS, table).plan(batch)
    assert plan.verify_lengths.tolist() == [1, 1, 1, 1] and plan.batch_tokens == 8  # level 2: 7.6 / 2.4, stop


def test_throughput_curve_literal():
    c = candidates(TWO.trees)
    everything = torch.ones(5, dtype=torch.bool)
    pool = make_pool(c, ~everything, level_sequence(c, everything), TWO)
    theta = throughput(pool, TABLE)
    assert [round(v, 3) for v in theta.tolist()] == [2.0, 2.9, 3.091, 3.433, 2.913, 2.257]
    assert pool.level_ends.tolist() == [0, 2, 4, 5]


def test_batch_rows_count_each_root_and_admitted_node_once():
    """The verify forward runs real rows only: a node costs one row whichever request it widens."""
    two = PlanInput((chain(0.9, 0.8), chain(0.5)))
    c = candidates(two.trees)  # admission order: request 0, request 0, request 1
    everything = torch.ones(3, dtype=torch.bool)
    assert batch_rows(c, ~everything, torch.arange(3), 0).tolist() == [2, 3, 4, 5]
    assert batch_rows(c, ~everything, torch.tensor([0, 2, 1]), 0).tolist() == [2, 3, 4, 5]
    forced = torch.tensor([False, False, True])  # request 1's node forced in
    assert batch_rows(c, forced, torch.arange(2), 3).tolist() == [6, 7, 8]
    assert batch_rows(candidates(()), torch.zeros(0, dtype=torch.bool), torch.zeros(0, dtype=torch.long),
                      0).tolist() == [0]


def test_whole_step_overhead_prices_the_budget():
    """The step's seconds besides the verify forward join the table: a fixed second flattens the curve (tau / (table
    + 1)); a second per batch token makes every row dear, so the early stop admits no node instead of one."""
    c = candidates(TWO.trees)
    everything = torch.ones(5, dtype=torch.bool)
    fixed = dataclasses.replace(TWO, overhead_s=1.0)
    theta = throughput(make_pool(c, ~everything, level_sequence(c, everything), fixed), TABLE)
    assert [round(v, 3) for v in theta.tolist()] == [1.0, 1.45, 1.619, 1.873, 1.748, 1.505]
    per_token = dataclasses.replace(TWO, overhead_per_token_s=1.2)  # level 1: 3.4 / (1.1 + 4.8) < 2 / (1 + 2.4)
    assert PrefixBudget(KNOBS, TABLE).plan(TWO).verify_lengths.tolist() == [1, 1]
    assert PrefixBudget(KNOBS, TABLE).plan(per_token).verify_lengths.tolist() == [0, 0]


def test_off_verifies_everything_drafted():
    plan = VerifyAll(KNOBS).plan(TWO)
    assert selected(plan) == [[0, 1, 2, 3], [0, 1, 2]]
    assert plan.verify_lengths.tolist() == [3, 2] and plan.batch_tokens == 7  # 2 roots + 5 nodes


def test_lagged_uses_the_budget_of_two_plans_ago():
    flat = StepCostTable((1, 64), (1.0, 1.0))  # free tokens: the global argmax takes every positive entry
    lagged = LaggedBudget(KNOBS, flat)
    old = PlanInput((chain(0.9, 0.9, 0.9),))  # K = 3 once it is two plans old
    assert selected(lagged.plan(old)) == [[0, 1, 2, 3]]  # cold start: early stop (Theta keeps rising)
    assert selected(lagged.plan(PlanInput((chain(0.1),)))) == [[0, 1]]
    plan = lagged.plan(PlanInput((chain(0.5, 0.5), chain(0.6, 0.1))))  # K = 3 from `old`
    assert selected(plan) == [[0, 1, 2], [0, 1]]  # top 3 by survival: .6, .5, .25 (not .06)
    plan = lagged.plan(PlanInput((chain(0.5, 0.5), chain(0.6, 0.1))))  # K = 1 from chain(0.1)
    assert selected(plan) == [[0], [0, 1]]


def test_lagged_budget_crosses_a_cliff_the_early_stop_cannot():
    cliff = StepCostTable((1, 2, 3, 4), (1.0, 1.9, 1.9, 1.9))  # the 2nd token is dear, later ones free
    batch = PlanInput((chain(0.8, 0.8, 0.8),))
    assert selected(PrefixBudget(KNOBS, cliff).plan(batch)) == [[0]]  # Theta 1.0 -> 0.947: stop
    lagged = LaggedBudget(KNOBS, cliff)
    for _ in range(3):
        plan = lagged.plan(batch)
    assert selected(plan) == [[0, 1, 2, 3]]  # global argmax: (1 + .8 + .64 + .512) / 1.9 = 1.55


def test_tree_child_of_an_unselected_parent_is_not_selected():
    #   0 -> 1 (.9) -> 3 (.72)
    #   0 -> 2 (.3) -> 4 (.285: conf .95, but its parent is out)
    t = tree([-1, 0, 0, 1, 2], [1.0, 0.9, 0.3, 0.8, 0.95])
    table = StepCostTable((1, 2, 3, 4), (1.0, 1.0, 1.05, 1.6))  # Theta: 1, 1.9, 2.476, 1.734
    assert selected(PrefixBudget(KNOBS, table).plan(PlanInput((t,)))) == [[0, 1, 3]]
    assert selected(VerifyAll(Knobs(0, 3, None, 0.0)).plan(PlanInput((t,)))) == [[0, 1, 2, 3]]


def test_ties_keep_selections_prefix_closed():
    free = StepCostTable((1, 2), (1.0, 1.0))
    t = tree([-1, 0, 1, 0, 2], [1.0, 1.0, 1.0, 1.0, 1.0])  # every survival is 1
    knobs = Knobs(0, 2, None, 0.0)
    c = candidates((t,))
    assert c.node.tolist() == [1, 3, 2, 4]  # depth breaks the tie, so parents come first
    assert selected(PrefixBudget(knobs, free).plan(PlanInput((t,)))) == [[0, 1, 3]]


def random_tree(rng: random.Random, n: int) -> DraftTree:
    parents = [-1] + [rng.randrange(i) for i in range(1, n)]
    conf = [1.0] + [rng.choice([0.0, 1.0, 0.5, rng.random()]) for _ in range(1, n)]
    return tree(parents, conf)


@pytest.mark.parametrize("mode", sorted(BUDGETS))
def test_every_mode_selects_prefix_closed_sets_with_the_root(mode):
    rng = random.Random(0)
    table = StepCostTable((1, 8, 32), (1.0, 1.2, 3.0))
    for _ in range(40):
        max_verify = rng.choice([None, 1, 3])
        knobs = Knobs(rng.randint(0, max_verify or 2), max_verify, rng.choice([None, 1.1]), 0.0)
        scheduler = BUDGETS[mode](knobs, table)
        for _ in range(3):
            trees = tuple(random_tree(rng, rng.randint(1, 9)) for _ in range(rng.randint(1, 4)))
            plan = scheduler.plan(PlanInput(trees))
            for t, sel, length in zip(trees, plan.selections, plan.verify_lengths.tolist()):
                nodes = sel.tolist()
                assert nodes[0] == 0 and nodes == sorted(set(nodes)) and len(nodes) == length + 1
                assert all(int(t.parents[i]) in nodes for i in nodes[1:])
                assert knobs.max_verify is None or length <= knobs.max_verify
                assert length >= min(knobs.min_verify, t.size - 1)
            assert plan.batch_tokens == len(trees) + int(plan.verify_lengths.sum())


def test_min_and_max_verify():
    expensive = StepCostTable((1, 2), (1.0, 100.0))  # the budget alone would verify nothing
    batch = PlanInput((chain(0.9, 0.8, 0.7), chain(0.2)))
    assert selected(PrefixBudget(KNOBS, expensive).plan(batch)) == [[0], [0]]
    assert selected(PrefixBudget(Knobs(2, None, None, 0.0), expensive).plan(batch)) == [[0, 1, 2], [0, 1]]
    free = StepCostTable((1, 2), (1.0, 1.0))
    assert selected(PrefixBudget(Knobs(0, 1, None, 0.0), free).plan(batch)) == [[0, 1], [0, 1]]
    assert selected(VerifyAll(Knobs(0, 2, None, 0.0)).plan(batch)) == [[0, 1, 2], [0, 1]]


def test_latency_target_shrinks_the_batch():
    linear = StepCostTable((1, 10), (0.010, 0.019))  # 1 ms per token beyond the first; tokens nearly free
    batch = PlanInput((chain(0.9, 0.9, 0.9), chain(0.9, 0.9)))
    assert PrefixBudget(KNOBS, linear).plan(batch).batch_tokens == 7  # 2 roots + 5 nodes
    plan = PrefixBudget(Knobs(0, None, 0.0135, 0.0), linear).plan(batch)  # B <= 4.5 tokens
    assert plan.batch_tokens == 4 and selected(plan) == [[0, 1], [0, 1]]
    floor = PrefixBudget(Knobs(1, None, 0.001, 0.0), linear).plan(batch)  # forced nodes stay in
    assert selected(floor) == [[0, 1], [0, 1]]


def test_extra_tokens_count_in_the_batch():
    plan = PrefixBudget(KNOBS, TABLE).plan(PlanInput(TWO.trees, extra_tokens=2))
    assert plan.batch_tokens == 2 + 2 + int(plan.verify_lengths.sum())
    assert selected(plan) == [[0, 1], [0, 1]]  # B starts at 4: Theta 2/1.1, 3.4/1.5, 4.37/2.5 (padded) -> stop


def test_empty_batch_and_zero_survival():
    assert PrefixBudget(KNOBS, TABLE).plan(PlanInput(())).batch_tokens == 0
    free = StepCostTable((1, 2), (1.0, 1.0))
    assert selected(PrefixBudget(KNOBS, free).plan(PlanInput((chain(0.9, 0.0, 0.5),)))) == [[0, 1]]


def test_confidences_outside_zero_one_are_refused():
    with pytest.raises(ValueError, match=r"\[0, 1\]"):
        PrefixBudget(KNOBS, TABLE).plan(PlanInput((chain(1.2),)))


def test_observe_refits_the_cost_table():
    scheduler = PrefixBudget(Knobs(0, None, None, 0.5), StepCostTable((2, 4), (1.0, 2.0)))
    scheduler.observe(StepResult(batch_tokens=2, seconds=1.5))
    assert scheduler.cost_table.seconds == (1.25, 2.0)
    frozen = PrefixBudget(KNOBS, TABLE)
    frozen.observe(StepResult(batch_tokens=2, seconds=1.5))
    assert frozen.cost_table == TABLE


def test_registry_matches_the_config_modes_and_is_chosen_once():
    assert set(BUDGETS) == set(BUDGET_MODES)
    assert isinstance(make_budget(load_config(), TABLE), PrefixBudget)
    assert isinstance(make_budget(load_config("lagged"), TABLE), LaggedBudget)
    assert isinstance(make_budget(load_config("no-budget"), None), VerifyAll)
    with pytest.raises(ValueError, match="step-cost table"):
        make_budget(load_config(), None)


# ---- paper appendix A -------------------------------------------------------------------------------------
P_TARGET = {"A": 0.7, "B": 0.3}
P_DRAFT = {"A": 0.5, "B": 0.5}  # sum min(p, q) = 0.8 = a_1
SPS_CURVE = StepCostTable((1, 2, 3), (1.0, 2.0, 1 / 0.45))  # SPS(1) = 1, SPS(2) = .5, SPS(3) = .45


def first_token_distribution(verify_first: bool, x1: str) -> dict[str, float]:
    """Exact law of the first committed token given the draft x1 and whether x1 is verified (chain rule:
    accept with min(1, p/q), else draw from normalize(max(0, p - q)); unverified: the target's own draw)."""
    if not verify_first:
        return dict(P_TARGET)
    accept = min(1.0, P_TARGET[x1] / P_DRAFT[x1])
    residual = {y: max(0.0, P_TARGET[y] - P_DRAFT[y]) for y in P_TARGET}
    mass = sum(residual.values())
    return {y: accept * (y == x1) + (1 - accept) * residual[y] / mass for y in P_TARGET}


def output_law(scheduler_for_draft, c2_after: dict[str, float]) -> dict[str, float]:
    """Enumerate x1 ~ P_DRAFT; c2 depends on x1 (the Markov confidence feature) -> law of the first token."""
    law = {"A": 0.0, "B": 0.0}
    for x1, q in P_DRAFT.items():
        plan = scheduler_for_draft().plan(PlanInput((chain(0.8, c2_after[x1]),)))
        verify_first = int(plan.verify_lengths[0]) >= 1
        for y, p in first_token_distribution(verify_first, x1).items():
            law[y] += q * p
    return law


class RetrospectiveGlobalSearch(CostedBudget):
    """Algorithm 1 without the break, on the current step's pool: NOT lossless (it is the counterexample)."""

    def budget(self, pool):
        return global_budget(throughput(pool, self.cost_table))


def close(law: dict[str, float], want: dict[str, float]) -> bool:
    return all(abs(law[y] - want[y]) < 1e-9 for y in want)


def test_appendix_a_retrospective_global_search_is_biased():
    law = output_law(lambda: RetrospectiveGlobalSearch(KNOBS, SPS_CURVE), {"A": 0.9, "B": 0.0})
    assert close(law, {"A": 0.85, "B": 0.15})


def test_appendix_a_early_stop_is_lossless():
    law = output_law(lambda: PrefixBudget(KNOBS, SPS_CURVE), {"A": 0.9, "B": 0.0})
    assert close(law, P_TARGET)


def test_appendix_a_lagged_budget_is_lossless_even_when_it_admits_x1():
    warm = LaggedBudget(KNOBS, SPS_CURVE)
    for _ in range(2):  # history: a pool whose global argmax is K = 2 (Theta 1.0, 0.9, 1.134)
        warm.plan(PlanInput((chain(0.8, 0.9),)))
    law = output_law(lambda: copy.deepcopy(warm), {"A": 0.9, "B": 0.0})
    assert close(law, P_TARGET)
    assert int(copy.deepcopy(warm).plan(PlanInput((chain(0.8, 0.0),))).verify_lengths[0]) == 1  # x1 is in


def test_early_stop_and_lagged_are_lossless_on_random_cases():
    rng = random.Random(1)
    for _ in range(100):
        seconds = sorted(rng.uniform(0.5, 3.0) for _ in range(3))
        table = StepCostTable((1, 2, 3), tuple(seconds))
        c2 = {"A": rng.choice([0.0, 1.0, rng.random()]), "B": rng.choice([0.0, rng.random()])}
        assert close(output_law(lambda table=table: PrefixBudget(KNOBS, table), c2), P_TARGET)
        warm = LaggedBudget(KNOBS, table)
        for _ in range(2):
            warm.plan(PlanInput((chain(rng.random(), rng.random()),)))
        assert close(output_law(lambda warm=warm: copy.deepcopy(warm), c2), P_TARGET)


def batch_output_law(scheduler_for_draft, c1: tuple[float, float], c2_after: dict[str, float]) -> dict:
    """Two requests drafting independently (x1 ~ P_DRAFT each, c2 after x1 as above, first confidences c1):
    the joint law of their first committed tokens, enumerated."""
    law: dict[tuple[str, str], float] = {}
    for (xa, qa), (xb, qb) in ((a, b) for a in P_DRAFT.items() for b in P_DRAFT.items()):
        trees = (chain(c1[0], c2_after[xa]), chain(c1[1], c2_after[xb]))
        verify = scheduler_for_draft().plan(PlanInput(trees)).verify_lengths.tolist()
        for ya, pa in first_token_distribution(verify[0] >= 1, xa).items():
            for yb, pb in first_token_distribution(verify[1] >= 1, xb).items():
                law[ya, yb] = law.get((ya, yb), 0.0) + qa * qb * pa * pb
    return law


def test_level_stop_is_lossless_across_requests():
    """The level stop lets a request's node ride on another's widening; the joint law of both requests' first
    tokens is still the target's, on random step costs (B = 2, 4, 6) and confidences that follow the token."""
    rng = random.Random(2)
    want = {(a, b): P_TARGET[a] * P_TARGET[b] for a in P_TARGET for b in P_TARGET}
    admitted = 0
    for _ in range(100):
        table = StepCostTable((2, 4, 6), tuple(sorted(rng.uniform(0.5, 3.0) for _ in range(3))))
        c1 = (rng.random(), rng.random())
        c2 = {"A": rng.choice([0.0, 1.0, rng.random()]), "B": rng.choice([0.0, rng.random()])}
        law = batch_output_law(lambda table=table: PrefixBudget(KNOBS, table), c1, c2)
        assert all(abs(law[k] - want[k]) < 1e-9 for k in want)
        admitted += int(PrefixBudget(KNOBS, table).plan(PlanInput((chain(*c1), chain(*c1)))).verify_lengths.sum())
    assert admitted > 0  # the cases are not all "verify nothing"
