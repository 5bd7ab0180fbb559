"""The launch record: what the main process resolves once (config, drafter config, knobs, verify width, tables)."""

import json
import pickle

import pytest

from scheduler_patch.launch import DSparkLaunch
from sgl_dspark.calibration import drafter_calibration
from sgl_dspark.config import load_config
from sgl_dspark.cost import StepCostTable
from sgl_dspark.drafter import DraftKnobs, parse_drafter_config
from fixture_drafters import tiny_hf_config
from sgl_dspark.lookup import LookupKnobs

DRAFTER = parse_drafter_config(tiny_hf_config())  # gamma 4


def test_the_record_carries_the_knobs_and_the_verify_width_computed_once():
    launch = DSparkLaunch.of(load_config("tree"), "/d", DRAFTER, "dspark_torch")
    assert (launch.draft_nodes, launch.verify_tokens) == (16, 17)  # tree: max_tree_nodes 16
    assert launch.draft_knobs == load_config("tree").draft_knobs()
    assert launch.lookup is None and launch.cost_table is None and launch.drafter is DRAFTER


def test_lookup_knobs_ride_on_the_record_and_widen_the_verify_width():
    launch = DSparkLaunch.of(load_config("tree", {"lookup": True}), "/d", DRAFTER, None)
    assert launch.lookup == LookupKnobs()
    assert launch.draft_nodes == 16 + LookupKnobs().max_nodes


def test_the_calibration_and_the_cost_table_are_kept_as_read():
    table = StepCostTable((1, 8), (0.05, 0.08))
    launch = DSparkLaunch.of(load_config(), "/d", DRAFTER, None, ((1.5, 2.0), (0.1, -0.2)), table)
    assert launch.draft_knobs.confidence_temperatures == (1.5, 2.0) and launch.cost_table == table
    assert launch.draft_knobs.confidence_biases == (0.1, -0.2)
    assert launch.draft_nodes == 4  # default: a chain as long as gamma
    assert pickle.loads(pickle.dumps(launch)) == launch
    assert "num_hidden_layers" not in repr(launch)  # the log line stays one short line


def test_knobs_that_do_not_fit_the_drafter_are_refused():
    with pytest.raises(ValueError, match="max_window 9 / min_window 1 exceed the drafter's gamma 4"):
        DSparkLaunch.of(load_config("default", {"max_window": 9}), "/d", DRAFTER, None)


def test_the_drafting_defaults_are_those_of_configs_default_json():
    """DraftKnobs' own defaults (for direct Proposer users) are the preset's, so the two cannot disagree."""
    assert load_config().draft_knobs() == DraftKnobs()


def test_the_calibration_comes_from_the_knob_else_beside_the_drafter_else_none(tmp_path):
    assert drafter_calibration(None, tmp_path) == ((), ())
    (tmp_path / "calibration.json").write_text(json.dumps({"temperatures": [1.5, 2.0]}))  # no biases: 0
    assert drafter_calibration(None, tmp_path) == ((1.5, 2.0), (0.0, 0.0))
    knob = tmp_path / "other.json"
    knob.write_text(json.dumps({"temperatures": [3.0], "biases": [-0.25]}))
    assert drafter_calibration(str(knob), tmp_path) == ((3.0,), (-0.25,))
