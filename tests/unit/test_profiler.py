"""Start-up cost profiling: the token counts and verify shapes timed, the pool limits, and saving the table."""

import json

import pytest
import torch

from sgl_dspark.config import load_config
from sgl_dspark.cost import StepCostTable, load_cost_table
from sgl_dspark.budget import PlanInput, StepResult, make_budget
from sgl_dspark.tree import DraftTree

from scheduler_patch.runtime.profiler import (ProfileLimits, SavingBudget, describe, startup_table, token_counts,
                                              verify_shape)

TABLE = StepCostTable((1, 8), (0.1, 0.2))


@pytest.mark.parametrize("max_tokens, expected", [(1, (1,)), (8, (1, 2, 4, 8)), (20, (1, 2, 4, 8, 16, 20))])
def test_token_counts_are_powers_of_two_and_the_max(max_tokens, expected):
    assert token_counts(max_tokens) == expected


@pytest.mark.parametrize("tokens, width, expected", [(1, 8, (1, 1)), (4, 8, (1, 4)), (32, 8, (4, 8)),
                                                     (12, 8, (2, 6)), (7, 4, (7, 1))])
def test_verify_shape_lays_tokens_out_as_requests_of_the_widest_rows(tokens, width, expected):
    assert verify_shape(tokens, width) == expected


def test_profile_limits_cap_the_largest_batch_by_requests_kv_and_the_maximum():
    assert ProfileLimits(max_width=8, max_requests=4, kv_slots=8192).max_tokens() == 32
    assert ProfileLimits(max_width=8, max_requests=64, kv_slots=8192).max_tokens() == 64
    assert ProfileLimits(max_width=8, max_requests=64, kv_slots=300, context=128).max_tokens() == 16  # 2 fit
    assert ProfileLimits(max_width=8, max_requests=4, kv_slots=10).max_tokens() == 1


def test_describe_is_one_line_in_milliseconds():
    assert describe(TABLE) == "tokens=[1, 8] ms=[100.0, 200.0]"


def test_saving_budget_writes_on_set_and_every_n_steps(tmp_path):
    path = tmp_path / "cost.json"
    inner = make_budget(load_config(overrides={"cost_refit_alpha": 0.5}), TABLE)
    saving = SavingBudget(inner, TABLE, str(path), every=2, meta={"device": "cpu"})
    assert not path.exists()
    saving.cost_table = StepCostTable((1, 8), (0.2, 0.4))
    assert load_cost_table(path) == inner.cost_table == StepCostTable((1, 8), (0.2, 0.4))
    tree = DraftTree.chain(torch.tensor([5, 6]), torch.tensor([1.0, 0.9]))
    assert saving.plan(PlanInput((tree,))).batch_tokens >= 1
    saving.observe(StepResult(1, 0.3))
    assert load_cost_table(path).seconds == (0.2, 0.4)  # not yet: every 2 steps
    saving.observe(StepResult(1, 0.3))
    assert load_cost_table(path).seconds[0] == pytest.approx(0.275)  # 0.2 -> 0.25 -> 0.275 (towards 0.3, alpha 0.5)
    assert json.loads(path.read_text())["meta"] == {"device": "cpu", "refit_steps": 2}


def test_saving_budget_keeps_the_table_of_a_budget_without_one(tmp_path):
    saving = SavingBudget(make_budget(load_config(overrides={"budget": "off"}), None), TABLE,
                             str(tmp_path / "cost.json"), every=1)
    saving.cost_table = StepCostTable((1,), (0.5,))
    saving.observe(StepResult(3, 0.1))
    assert load_cost_table(tmp_path / "cost.json") == StepCostTable((1,), (0.5,))


def test_startup_table_falls_back_with_a_warning_when_the_dummy_verify_fails(caplog):
    assert startup_table(object(), 8, TABLE) is TABLE  # a runner without pools: AttributeError, not a crash
    assert "step-cost profiling failed (AttributeError" in caplog.text
