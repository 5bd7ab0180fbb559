"""Step-cost table: interpolation, monotone fit, profiling with a fake clock, online refit, JSON file."""

import json
import random

import pytest
import torch

from sgl_dspark.cost import (StepCostTable, from_measurements, load_cost_table, nondecreasing, profile, refit,
                             save_cost_table)


def costs(table: StepCostTable, *bs: int) -> list[float]:
    return [round(v, 9) for v in table.costs(torch.tensor(bs)).tolist()]


def test_interpolates_between_points_and_holds_flat_below():
    table = StepCostTable((2, 4, 8), (1.0, 2.0, 2.0))
    assert costs(table, 1, 2, 3, 4, 6, 8) == [1.0, 1.0, 1.5, 2.0, 2.0, 2.0]


def test_extrapolates_the_last_slope_beyond_the_table():
    table = StepCostTable((1, 3), (1.0, 2.0))
    assert costs(table, 5, 7) == [3.0, 4.0]
    assert table.cost(5) == 3.0


def test_flat_last_segment_extrapolates_flat_and_one_point_is_constant():
    assert costs(StepCostTable((2, 4), (1.0, 1.0)), 100) == [1.0]
    assert costs(StepCostTable((4,), (0.5,)), 1, 4, 64) == [0.5, 0.5, 0.5]


def test_sps_is_one_over_cost():
    table = StepCostTable((1, 2), (0.5, 0.25 * 4))
    assert table.sps(torch.tensor([1, 2])).tolist() == [2.0, 1.0]


@pytest.mark.parametrize("tokens, seconds, message", [
    ((), (), "non-empty"),
    ((2, 2), (1.0, 1.0), "strictly increasing"),
    ((0, 1), (1.0, 1.0), "integers >= 1"),
    ((1, 2), (1.0, 0.0), "finite and > 0"),
    ((1, 2), (2.0, 1.0), "must not decrease"),
])
def test_rejects_bad_tables(tokens, seconds, message):
    with pytest.raises(ValueError, match=message):
        StepCostTable(tokens, seconds)


def test_nondecreasing_pools_adjacent_violators():
    assert nondecreasing([1, 3, 2, 4]) == (1.0, 2.5, 2.5, 4.0)
    assert nondecreasing([3, 2, 1]) == (2.0, 2.0, 2.0)
    assert nondecreasing([1, 2]) == (1.0, 2.0)


def test_from_measurements_sorts_and_smooths_noise():
    table = from_measurements([8, 1, 4], [2.0, 1.0, 2.2])
    assert table.tokens == (1, 4, 8)
    assert [round(s, 9) for s in table.seconds] == [1.0, 2.1, 2.1]


def test_profile_takes_the_median_of_repeats_after_warmup():
    now = [0.0]
    durations = {1: [9.0, 1.0, 1.2, 1.1], 4: [9.0, 2.0, 5.0, 2.1]}  # first call of each is the warmup
    calls = []

    def step(n: int) -> None:
        calls.append(n)
        now[0] += durations[n].pop(0)

    table = profile(step, [4, 1, 4], repeats=3, warmup=1, clock=lambda: now[0])
    assert calls == [1, 1, 1, 1, 4, 4, 4, 4]
    assert table.tokens == (1, 4)
    assert [round(s, 9) for s in table.seconds] == [1.1, 2.1]


def test_profile_starts_no_count_once_the_budget_is_spent():
    now = [0.0]

    def step(n: int) -> None:
        now[0] += n

    table = profile(step, [1, 2, 4, 8], repeats=1, warmup=0, clock=lambda: now[0], budget_s=3.5)
    assert table.tokens == (1, 2, 4)  # 3 s spent when 4 starts, 7 s when 8 would
    assert profile(step, [8, 16], repeats=1, warmup=0, clock=lambda: now[0], budget_s=0.0).tokens == (8,)


def test_profile_times_a_real_callable():
    table = profile(lambda n: sum(range(n * 100)), [1, 64], repeats=3)
    assert table.tokens == (1, 64) and all(s > 0 for s in table.seconds)


def test_refit_at_a_table_point_is_a_moving_average():
    table = StepCostTable((2, 4), (1.0, 2.0))
    assert refit(table, 2, 1.5, alpha=0.5).seconds == (1.25, 2.0)


def test_refit_between_points_shares_the_residual_by_interpolation_weight():
    table = StepCostTable((2, 4), (1.0, 2.0))
    assert refit(table, 3, 2.5, alpha=0.5).seconds == (1.25, 2.25)  # predicted 1.5, residual 1.0


def test_refit_clips_outliers_and_moves_end_points_outside_the_table():
    table = StepCostTable((2, 4), (1.0, 2.0))
    assert refit(table, 2, 100.0, alpha=0.5).seconds == (1.5, 2.0)  # clipped to 2 x predicted
    assert refit(table, 9, 3.5, alpha=0.5).seconds == (1.0, 1.5)  # predicted 2 + 5 * 0.5 = 4.5


def test_refit_keeps_the_table_nondecreasing():
    table = StepCostTable((2, 4), (1.0, 1.1))
    assert [round(s, 9) for s in refit(table, 2, 1.9, alpha=1.0).seconds] == [1.5, 1.5]


def test_refit_converges_on_noisy_steps():
    truth = StepCostTable((1, 16, 64), (0.010, 0.012, 0.030))
    table = StepCostTable((1, 16, 64), (0.020, 0.020, 0.020))
    rng = random.Random(0)
    for _ in range(3000):
        b = rng.randint(1, 64)
        noise = 1.0 + rng.gauss(0, 0.05) + (5.0 if rng.random() < 0.01 else 0.0)  # 1% big hiccups
        table = refit(table, b, truth.cost(b) * noise, alpha=0.05)
    for want, got in zip(truth.seconds, table.seconds):
        assert abs(got - want) / want < 0.08


def test_refit_rejects_bad_inputs():
    with pytest.raises(ValueError, match="alpha"):
        refit(StepCostTable((1,), (1.0,)), 1, 1.0, alpha=1.5)


def test_json_round_trip(tmp_path):
    table = StepCostTable((1, 8, 32), (0.01, 0.0125, 0.02))
    save_cost_table(table, tmp_path / "cost.json", meta={"device": "cpu"})
    assert load_cost_table(tmp_path / "cost.json") == table
    assert json.loads((tmp_path / "cost.json").read_text())["meta"] == {"device": "cpu"}


@pytest.mark.parametrize("text, message", [
    ("{not json", "not valid JSON"),
    ("[1, 2]", "'tokens' and 'seconds'"),
    ('{"tokens": [1, 2]}', "'tokens' and 'seconds'"),
    ('{"tokens": 3, "seconds": [1]}', "must be lists"),
    ('{"tokens": [2, 1], "seconds": [1, 1]}', "strictly increasing"),
    ('{"tokens": [1, 2], "seconds": [1, -1]}', "finite and > 0"),
])
def test_load_names_the_file_and_the_problem(tmp_path, text, message):
    path = tmp_path / "bad.json"
    path.write_text(text)
    with pytest.raises(ValueError, match=message) as err:
        load_cost_table(path)
    assert "bad.json" in str(err.value)


def test_load_missing_file(tmp_path):
    with pytest.raises(FileNotFoundError, match="no such file"):
        load_cost_table(tmp_path / "missing.json")
