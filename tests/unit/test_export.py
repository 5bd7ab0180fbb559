"""Packaging a training run: bf16 weights that load unchanged, the calibration copied, a model card."""

import json

import torch

from sgl_dspark.drafter.checkpoint import load_drafter, save_drafter
from fixture_drafters import tiny_hf_config
from sgl_dspark.drafter.fresh import random_drafter
from sgl_dspark.training.export import export, read_curve


def test_export_casts_weights_and_writes_the_card(tmp_path):
    drafter, spec = random_drafter(tiny_hf_config())
    run, data, out = tmp_path / "run", tmp_path / "data", tmp_path / "out"
    save_drafter(drafter, run / "checkpoint")
    (run / "checkpoint" / "calibration.json").write_text('{"temperatures": [1.0, 2.0]}\n')
    (run / "run.json").write_text(json.dumps({"preset": "tiny", "minutes": 1.0, "target": "/home/me/models/Tiny",
                                              "data": str(data), "out": str(run)}))
    rows = [{"step": 0, "minutes": 0.0, "tau": 1.0, "cond_accept": [0.0, 0.0]},
            {"step": 9, "minutes": 1.0, "tau": 1.5, "cond_accept": [0.4, 0.2]},
            {"step": 9, "minutes": 1.0, "tau": 1.5, "cond_accept": [0.4, 0.2]}]  # the final eval repeats
    (run / "curve.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    data.mkdir()
    (data / "manifest.json").write_text(json.dumps({"records": 3, "target": "/home/me/models/Tiny"}))
    command = f"python -m sgl_dspark.training.trainer --data {data} --out {run} --minutes 1"
    export(run, data, out, torch.bfloat16, command)
    assert len(read_curve(run)) == 2
    assert [f.name for f in out.glob("model.safetensors*")] == ["model.safetensors.xz"]  # shipped compressed
    loaded = load_drafter(out, spec)
    for name, p in drafter.state_dict().items():
        if p.is_floating_point():
            torch.testing.assert_close(loaded.state_dict()[name], p.to(torch.bfloat16).float())
    card = (out / "README.md").read_text()
    assert "python -m sgl_dspark.training.trainer --data DATA --out RUN --minutes 1" in card
    assert "| 1.0 | 9 | 1.500 |" in card
    assert str(tmp_path) not in card and "/home/me" not in card and "# DSpark drafter for Tiny" in card
    assert (out / "calibration.json").is_file() and (out / "curve.png").stat().st_size > 0


def test_curve_table_has_a_column_per_source_and_dashes_for_what_a_row_lacks():
    from sgl_dspark.training.export import curve_table

    rows = [{"step": 0, "minutes": 0.0, "tau": 1.0, "tau_stdlib": 1.0, "cond_accept": [0.0, None]},
            {"step": 5, "minutes": 2.0, "tau": 1.4, "tau_hybrid": 1.9, "tau_code": 1.6, "tau_stdlib": 1.3,
             "cond_accept": [0.3, 0.2]}]  # a continued run: a new held-out set with more sources
    head, _, first, second = curve_table(rows)
    assert head.split(" | ")[2:6] == ["tau", "tau_hybrid", "tau_code", "tau_stdlib"]
    assert first == "| 0.0 | 0 | 1.000 | - | - | 1.000 | 0.00 - |"
    assert second == "| 2.0 | 5 | 1.400 | 1.900 | 1.600 | 1.300 | 0.30 0.20 |"
