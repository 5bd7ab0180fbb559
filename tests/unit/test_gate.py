"""Speculation gate: the online linear cost parts, the whole-step cost model and the per-step choice of which requests
speculate (literal cases), and the gate's bookkeeping across steps."""

from dataclasses import astuple, replace

import pytest
import torch

from sgl_dspark.cost import StepCostTable
from sgl_dspark.packed_gemm import KernelTimes
from sgl_dspark.gate import (PROBE_EVERY, Gate, GatedStep, LinearCost, Outlook, StepCosts, choose, initial_costs,
                             next_outlook)

FLAT = StepCostTable((1,), (1.0,))  # the verify forward: 1 s whatever the batch


def costs(draft_intercept: float = 0.2, draft_slope: float = 0.0) -> StepCosts:
    """Drafting costs intercept + slope * k seconds when k >= 1 requests draft; nothing else costs anything."""
    zero = LinearCost(0.0)
    return StepCosts(FLAT, draft=LinearCost(draft_intercept, draft_slope), floor=zero, tail=zero, host=zero)


def test_linear_cost_fits_and_forgets():
    fit = LinearCost(5.0, 1.0, forget=1.0)
    assert fit.coefficients == (5.0, 1.0)  # nothing observed: the prior
    one_x = fit.observe(2, 4.0)
    assert one_x.coefficients == (2.0, 1.0)  # one distinct x: the prior slope through the mean
    assert one_x.observe(0, 1.0).coefficients == pytest.approx((1.0, 1.5))
    assert LinearCost(0.0, forget=1.0).observe(0, 1.0).observe(2, 2.0).coefficients == pytest.approx((1.0, 0.5))
    falling = LinearCost(0.0, forget=1.0).observe(0, 2.0).observe(2, 1.0)
    assert falling.coefficients == pytest.approx((1.5, 0.0))  # never a negative slope
    forgetful = LinearCost(0.0, forget=0.5).observe(1, 10.0).observe(1, 2.0)
    assert forgetful.coefficients[0] + forgetful.coefficients[1] == pytest.approx((0.5 * 10 + 2) / 1.5)
    assert fit.observe(1, float("nan")) is fit


def test_step_seconds_split_drafting_from_the_floor():
    model = StepCosts(FLAT, draft=LinearCost(0.3, 0.1), floor=LinearCost(0.05, 0.01), tail=LinearCost(0.0, 0.02),
                      host=LinearCost(0.1))
    seconds = model.seconds(torch.tensor([0.0, 2.0]), torch.tensor([4.0, 10.0]), requests=4)
    assert seconds.tolist() == pytest.approx([0.09 + 1 + 0.08 + 0.1, 0.5 + 1 + 0.2 + 0.1])
    assert model.besides_verify(drafted=2, requests=4) == pytest.approx((0.6, 0.02))


def test_one_request_speculates_when_it_pays():
    assert choose([Outlook(1.0, 2.0)], costs(), margin=0.0).speculate.tolist() == [True]  # 2 / 1.2 > 1 / 1
    low = choose([Outlook(0.1, 2.0)], costs(), margin=0.0)  # 1.1 / 1.2 < 1
    assert low.speculate.tolist() == [False] and low.predicted_gain == 1.0
    assert choose([Outlook(0.25, 2.0)], costs(), margin=0.0).speculate.tolist() == [True]  # 1.25 / 1.2
    assert choose([Outlook(0.25, 2.0)], costs(), margin=0.1).speculate.tolist() == [False]  # not by 10%


def test_the_best_requests_speculate_first():
    outlooks = [Outlook(0.1, 1.0), Outlook(2.0, 3.0)]
    both = choose(outlooks, costs(0.2, 0.0), margin=0.0)  # 4.1 / 1.2 beats 4 / 1.2 and 2 / 1
    assert both.speculate.tolist() == [True, True] and both.predicted_gain == pytest.approx(4.1 / 1.2 / 2)
    top = choose(outlooks, costs(0.0, 0.2), margin=0.0)  # 4 / 1.2 beats 4.1 / 1.4
    assert top.speculate.tolist() == [False, True]


def test_the_batch_is_priced_by_its_real_rows():
    """Verifying costs 1 s plus 0.1 s per row beyond 2. Alone, 4 verified drafts make 5 rows (1.3 s): 2 tokens per
    1.3 s beats 1 per second. Beside an idle request they make 6 rows (1.4 s: the verify forward runs no padding):
    3 tokens per 1.4 s beat 2 per second; padded to the widest (10 rows, 1.8 s) they would have lost."""
    steep = StepCostTable((2, 10), (1.0, 1.8))
    zero = LinearCost(0.0)
    model = StepCosts(steep, draft=zero, floor=zero, tail=zero, host=zero)
    alone = choose([Outlook(1.0, 4.0)], model, 0.0)
    assert alone.speculate.tolist() == [True] and alone.predicted_gain == pytest.approx(2 / 1.3)
    beside = choose([Outlook(1.0, 4.0), Outlook(0.0, 0.0)], model, 0.0)
    assert beside.speculate.tolist() == [True, False] and beside.predicted_gain == pytest.approx(3 / 1.4 / 2)


def test_the_baseline_is_the_faster_of_this_servers_floor_and_plain_sglangs_step():
    """Without drafts a step costs 1 s here (the verify table). Plain SGLang's kernel saving 0.1 s makes plain's step
    0.9 s: a request gaining 0.15 tokens at 1.2 s (1.15 / 1.2 = 0.96 / s) beats neither; gaining 0.25 (1.04 / s)
    beats this server's floor (1 / s) but not plain (1.11 / s), so it is declined; 0.5 (1.25 / s) beats both.
    Plain's kernel 0.1 s slower leaves the floor the baseline."""
    faster = KernelTimes(StepCostTable((1,), (0.5,)), StepCostTable((1,), (0.6,)))  # plain's pass 0.1 s shorter
    slower = KernelTimes(StepCostTable((1,), (0.7,)), StepCostTable((1,), (0.6,)))
    plain_fast, plain_slow = replace(costs(), kernels=faster), replace(costs(), kernels=slower)
    assert plain_fast.plain_seconds(1) == pytest.approx(0.9) and plain_slow.plain_seconds(1) == pytest.approx(1.1)
    assert costs().plain_seconds(1) == pytest.approx(1.0)
    assert choose([Outlook(0.25, 2.0)], costs(), margin=0.0).speculate.tolist() == [True]
    declined = choose([Outlook(0.25, 2.0)], plain_fast, margin=0.0)
    assert declined.speculate.tolist() == [False] and declined.predicted_gain == pytest.approx(0.9)
    assert choose([Outlook(0.5, 2.0)], plain_fast, margin=0.0).predicted_gain == pytest.approx(1.5 / 1.2 * 0.9)
    assert choose([Outlook(0.25, 2.0)], plain_slow, margin=0.0).speculate.tolist() == [True]
    assert initial_costs(FLAT, faster).kernels is faster
    slow_pass = KernelTimes(StepCostTable((1,), (2.0,)), StepCostTable((1,), (1.5,)))  # more than the whole step
    assert replace(costs(), kernels=slow_pass).plain_seconds(1) == pytest.approx(2.0)  # at least plain's pass


def test_new_requests_and_probe_steps_speculate_regardless():
    outlooks = [None, Outlook(0.0, 0.0)]
    assert choose(outlooks, costs(), margin=0.0).speculate.tolist() == [True, False]
    assert choose(outlooks, costs(), margin=0.0, probe=True).speculate.tolist() == [True, True]
    assert choose([], costs(), margin=0.0).speculate.tolist() == []


def test_next_outlook():
    assert next_outlook(None, True, 3, 4) == Outlook(2.0, 4.0)
    assert next_outlook(None, False, 1, 0) is None
    assert next_outlook(Outlook(2.0, 4.0), False, 1, 0) == Outlook(2.0, 4.0)
    assert astuple(next_outlook(Outlook(2.0, 4.0), True, 1, 0)) == pytest.approx((1.9, 3.8))  # weight 0.05
    assert next_outlook(Outlook(2.0, 4.0), True, 1, 0, weight=0.5) == Outlook(1.0, 2.0)
    # gated: RECOVER (2%) of the way back to the batch-wide mean
    assert astuple(next_outlook(Outlook(0.0, 1.0), False, 1, 0, prior=Outlook(1.0, 3.0))) == pytest.approx((0.02, 1.04))


def step(rids, speculated, accepted, verified, draft_s=0.1, host_s=None) -> GatedStep:
    return GatedStep(rids, speculated, accepted, verified, draft_s, tail_s=0.01, host_s=host_s)


def test_gate_learns_that_a_request_does_not_pay_and_probes_it_again():
    gate = Gate(initial_costs(FLAT), margin=0.05)
    assert gate.decide(["a", "b"], FLAT).speculate.tolist() == [True, True]  # no outlook yet
    for _ in range(30):  # a gains nothing from drafting, b 3 tokens a step
        gate.observe(step(["a", "b"], [True, True], accepted=[1, 4], verified=[3, 4]))
    chosen = [gate.decide(["a", "b"], FLAT).speculate.tolist()]
    assert chosen[0] == [False, True]
    for _ in range(PROBE_EVERY):
        gate.observe(step(["a", "b"], chosen[-1], [1, 4], [0, 4]))
        chosen.append(gate.decide(["a", "b"], FLAT).speculate.tolist())
    assert [True, True] in chosen[1:]  # a probe step refreshed a's outlook
    assert gate.decide(["b", "c"], FLAT).speculate.tolist() == [True, True] and set(gate.outlooks) == {"b"}


def test_gate_refits_its_cost_parts():
    gate = Gate(initial_costs(FLAT), margin=0.0)
    for _ in range(50):
        gate.observe(step(["a"], [True], [1], [0], draft_s=0.5, host_s=0.2))
        gate.observe(step(["a"], [False], [1], [0], draft_s=0.01, host_s=0.2))
    c = gate.costs
    assert c.draft.coefficients[0] + c.draft.coefficients[1] == pytest.approx(0.5)
    assert float(c.floor.seconds(torch.tensor([1.0]))[0]) == pytest.approx(0.01)
    assert float(c.host.seconds(torch.tensor([1.0]))[0]) == pytest.approx(0.2)
