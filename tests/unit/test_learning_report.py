"""benchmarks.learning's report: variants' curves -> table, plot and JSON beside the shipped drafter's curve."""

import json
import math

from benchmarks.learning import DONE, VARIANTS, draft_ms, main, tau_at, trend
from fixture_drafters import tiny_hf_config
from sgl_dspark.drafter.fresh import random_drafter
from sgl_dspark.drafter.checkpoint import save_drafter
from sgl_dspark.training.trainer import parse_args


def test_tau_at_takes_the_last_evaluation_within_the_minutes():
    curve = [{"minutes": 0.0, "tau": 1.0}, {"minutes": 6.0, "tau": 1.2}, {"minutes": 12.0, "tau": 1.3}]
    assert tau_at(curve, 8.0) == 1.2 and tau_at(curve, 12.0) == 1.3 and tau_at(curve[1:], 1.0) is None


def test_report_only_writes_a_row_per_trained_variant(tmp_path):
    for name, taus in (("baseline", (1.0, 1.10)), ("bigram", (1.0, 1.25))):
        run = tmp_path / name
        run.mkdir()
        rows = [{"step": 10 * i, "minutes": 6.0 * i, "tau": t, "tau_hybrid": t + 0.5} for i, t in enumerate(taus)]
        (run / "curve.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    (tmp_path / "bigram" / DONE).write_text(json.dumps({"draft_ms": 9.5}))
    assert main(["--out", str(tmp_path), "--report-only"]) == 0
    doc = json.loads((tmp_path / "learning.json").read_text())
    got = {r["variant"]: r for r in doc["variants"]}
    assert set(got) == {"baseline", "bigram"}  # depth1 and constant-lr never ran: no rows
    assert got["bigram"]["tau"] == 1.25 and got["bigram"]["draft_ms"] == 9.5 and got["baseline"]["draft_ms"] is None
    assert got["bigram"]["shipped_tau_same_minutes"] == 1.131  # the shipped curve's row at 6.0 minutes
    table = (tmp_path / "learning.md").read_text()
    assert "| bigram | `--markov-init bigram` | 6.0 | 10 | 1.250 | 1.750 | 1.131 | 9.5 |" in table
    assert (tmp_path / "learning.png").stat().st_size > 0


def test_draft_ms_times_a_drafter_of_the_checkpoints_shape(tmp_path):
    drafter, _ = random_drafter(tiny_hf_config())
    save_drafter(drafter, tmp_path)
    assert 0 < draft_ms(tmp_path, repeats=2) < 1000


def test_trend_fits_the_log_of_minutes_and_solves_for_the_target():
    curve = [{"minutes": m, "tau": 9.0, "tau_code": 1.0 + 0.1 * math.log2(m)} for m in (10.0, 20.0, 40.0, 80.0)]
    curve.append({"minutes": 90.0, "tau": 9.0})  # no tau_code: not fitted
    got = trend(curve, "tau_code", target=1.8, points=3)
    assert got["from_minutes"] == 20.0 and got["to_minutes"] == 80.0
    assert math.isclose(got["gain_per_doubling"], 0.1) and math.isclose(got["minutes_to_target"], 256.0)
    flat = [{"minutes": m, "tau_code": 1.5} for m in (10.0, 20.0)]
    assert trend(flat, "tau_code", 2.0)["minutes_to_target"] is None and trend(flat[:1], "tau_code", 2.0) is None


def test_the_common_flags_pin_zero_markov_init_and_a_variant_overrides_them():
    common = ["--data", "D", "--out", "O", "--markov-init", "zero"]
    assert parse_args(common).markov_init == "zero"
    assert parse_args([*common, *VARIANTS["bigram"]]).markov_init == "bigram"
