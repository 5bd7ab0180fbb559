"""Confidence calibration (a temperature and a bias per position): literal ECE/AUC, the fit on synthetic
over-confident and constantly biased records, JSON file."""

import math

import pytest
import torch

from sgl_dspark.calibration import (Calibration, auc, average_ranks, calibrate_confidence, calibration_report, ece,
                                    ece_grid, fit_calibration, fit_platt, load_calibration, prefix_events,
                                    save_calibration)


def records(n: int, k: int, truth, seed: int = 0):
    """n rollouts of k positions: raw confidence c ~ U(.55, .99), accepted with probability truth(c)."""
    g = torch.Generator().manual_seed(seed)
    conf = 0.55 + 0.44 * torch.rand(n, k, generator=g)
    accepted = torch.rand(n, k, generator=g) < truth(conf)
    return conf, accepted, torch.ones(n, k, dtype=torch.bool)


def test_calibrate_confidence_literal():
    conf = torch.tensor([[0.5, torch.sigmoid(torch.tensor(2.0)).item()]])
    out = calibrate_confidence(conf, torch.tensor([3.0, 2.0]))
    assert out[0].tolist() == pytest.approx([0.5, torch.sigmoid(torch.tensor(1.0)).item()])
    assert torch.allclose(calibrate_confidence(conf, torch.ones(2)), conf)
    shifted = calibrate_confidence(conf, torch.ones(2), torch.tensor([1.0, -2.0]))
    assert shifted[0].tolist() == pytest.approx([torch.sigmoid(torch.tensor(1.0)).item(), 0.5])


def test_prefix_events():
    accepted = torch.tensor([[True, False, True], [True, True, True]])
    valid = torch.tensor([[True, True, False], [True, True, True]])
    event, scored = prefix_events(accepted, valid)
    assert event.tolist() == [[True, False, False], [True, True, True]]
    assert scored.tolist() == [[True, True, False], [True, True, True]]


def test_ece_literal():
    assert ece(torch.tensor([0.1, 0.1, 0.9, 0.9]), torch.tensor([0, 0, 1, 0]), bins=10) == pytest.approx(0.25)
    assert ece(torch.tensor([0.5, 0.5]), torch.tensor([1, 0]), bins=10) == 0.0
    assert ece(torch.tensor([1.0, 0.0]), torch.tensor([1, 0]), bins=10) == 0.0  # p = 1 lands in the last bin
    grid = ece_grid(torch.tensor([[0.5, 0.5], [1.0, 1.0]]), torch.tensor([1, 0]), bins=10)
    assert grid.tolist() == [0.0, 0.5]


def test_auc_literal_ties_and_missing_class():
    assert auc(torch.tensor([0.1, 0.4, 0.35, 0.8]), torch.tensor([0, 0, 1, 1])) == 0.75
    assert auc(torch.tensor([0.5, 0.5]), torch.tensor([0, 1])) == 0.5
    assert math.isnan(auc(torch.tensor([0.1, 0.2]), torch.tensor([1, 1])))
    assert average_ranks(torch.tensor([3.0, 1.0, 3.0])).tolist() == [2.5, 1.0, 2.5]


def test_auc_is_unchanged_by_monotone_scaling():
    conf, accepted, _ = records(2000, 1, lambda c: c ** 2)
    score, label = conf[:, 0], accepted[:, 0]
    for scaled in (score ** 3, calibrate_confidence(score[:, None], torch.tensor([2.5]))[:, 0], score * 0.1):
        assert auc(scaled, label) == pytest.approx(auc(score, label), abs=1e-12)


def test_the_fit_reduces_ece_on_overconfident_records():
    conf, accepted, valid = records(6000, 3, lambda c: c ** 2)  # true acceptance c^2: overconfident head
    cal = fit_calibration(conf, accepted, valid)
    report = cal.report
    assert report.samples == (6000, 6000, 6000)
    assert all(after < 0.6 * before for before, after in zip(report.ece_before, report.ece_after))
    assert report.auc_after[0] == pytest.approx(report.auc_before[0], abs=1e-6)  # order kept (up to float32 ties)


def test_a_constant_bias_is_removed_where_a_temperature_alone_cannot():
    """A head whose logit is 1 too high everywhere (confidences on both sides of 1/2): the fitted bias brings ECE at
    every position below a quarter of the raw one, and below half of what the best temperature alone (b = 0)
    reaches at position 1 (a temperature moves low and high confidences in opposite directions)."""
    g = torch.Generator().manual_seed(3)
    conf = 0.05 + 0.9 * torch.rand(8000, 3, generator=g)
    accepted = torch.rand(8000, 3, generator=g) < torch.sigmoid(torch.logit(conf) - 1.0)
    cal = fit_calibration(conf, accepted, torch.ones(8000, 3, dtype=torch.bool))
    assert all(after < before / 4 for before, after in zip(cal.report.ece_before, cal.report.ece_after))
    assert all(-1.3 < b < -0.7 for b in cal.biases.tolist()) and all(0.8 < t < 1.25 for t in cal.temperatures)
    best_t = min(ece(calibrate_confidence(conf[:, :1], torch.tensor([t]))[:, 0], accepted[:, 0])
                 for t in torch.logspace(-1, 1, 81).tolist())
    assert cal.report.ece_after[0] < best_t / 2


def test_calibrated_records_stay_near_identity():
    conf, accepted, valid = records(6000, 2, lambda c: c)
    temps, biases = fit_platt(conf, accepted, valid)
    assert all(0.7 < t < 1.4 for t in temps.tolist()) and all(abs(b) < 0.3 for b in biases.tolist())


def test_each_position_fits_on_the_rows_that_reached_it():
    """Position 2 is fitted on rows whose position 1 was accepted only: there it is always accepted, elsewhere
    never (a rejected position 1 makes position 2's outcome meaningless), so its fit must rise above the raw c."""
    conf, accepted, valid = records(4000, 2, lambda c: c)
    accepted[:, 1] = accepted[:, 0]
    cal = fit_calibration(conf, accepted, valid)
    assert float(calibrate_confidence(conf, cal.temperatures, cal.biases)[:, 1].min()) > 0.9


def test_positions_without_scored_rows_keep_the_identity():
    conf, accepted, valid = records(500, 3, lambda c: c)
    valid[:, 2] = False
    cal = fit_calibration(conf, accepted, valid)
    assert (cal.temperatures[2].item(), cal.biases[2].item()) == (1.0, 0.0) and cal.report.samples[2] == 0
    assert math.isnan(cal.report.auc_before[2])


def test_records_are_checked():
    conf = torch.rand(4, 2)
    with pytest.raises(ValueError, match=r"\[N, k\]"):
        fit_platt(conf, torch.ones(4, 3, dtype=torch.bool), torch.ones(4, 2, dtype=torch.bool))
    with pytest.raises(ValueError, match="bool"):
        fit_platt(conf, torch.ones(4, 2), torch.ones(4, 2, dtype=torch.bool))


def test_json_round_trip_with_nan(tmp_path):
    conf, accepted, valid = records(300, 2, lambda c: c)
    valid[:, 1] = False
    cal = fit_calibration(conf, accepted, valid)
    save_calibration(cal, tmp_path / "sts.json")
    back = load_calibration(tmp_path / "sts.json")
    assert torch.equal(back.temperatures, cal.temperatures) and torch.equal(back.biases, cal.biases)
    assert back.report.ece_after == cal.report.ece_after and back.report.samples == cal.report.samples
    assert math.isnan(back.report.auc_after[1])
    save_calibration(Calibration(torch.tensor([1.5]), None), tmp_path / "bare.json")
    assert load_calibration(tmp_path / "bare.json").report is None


@pytest.mark.parametrize("text, message", [
    ("{", "not valid JSON"),
    ('{"temperatures": []}', "non-empty list"),
    ('{"temperatures": [1.0, -2]}', "numbers > 0"),
    ('{"temperatures": [1.0], "report": {"samples": [1]}}', "'report' must be null"),
    ('{"temperatures": [1.0], "biases": [0.1, 0.2]}', "'biases' must be absent or a list of 1"),
])
def test_load_names_the_file_and_the_problem(tmp_path, text, message):
    path = tmp_path / "bad.json"
    path.write_text(text)
    with pytest.raises(ValueError, match=message) as err:
        load_calibration(path)
    assert "bad.json" in str(err.value)


def test_report_on_given_temperatures():
    conf = torch.tensor([[0.9, 0.9], [0.9, 0.9]])
    accepted = torch.tensor([[True, True], [False, True]])
    report = calibration_report(conf, accepted, torch.ones(2, 2, dtype=torch.bool), torch.ones(2), bins=10)
    assert report.ece_before[0] == pytest.approx(0.4)  # predicted .9, observed .5
    assert report.ece_before[1] == pytest.approx(0.31)  # predicted .81, observed .5
