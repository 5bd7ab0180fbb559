"""DSparkKnobs: presets load, overrides merge, every bad knob fails with one line naming it."""

import dataclasses
import json
import re

import pytest

from sgl_dspark.config import (KNOBS, PRESET_DIR, RECOMMENDED_FILE, DSparkKnobs, cli_flag, cli_overrides,
                               config_from_flags, load_config)


def test_default_preset_sets_every_knob():
    assert set(json.loads((PRESET_DIR / "default.json").read_text())) - {"description"} == set(KNOBS)
    cfg = load_config()
    assert (cfg.max_window, cfg.min_window, cfg.tree_width, cfg.budget) == (None, 1, 1, "prefix")
    assert cfg.is_chain and cfg.latency_target_s is None and cfg.lookup is False


@pytest.mark.parametrize("preset, knob, value", [
    ("chain", "max_window", 7),
    ("tree", "tree_width", 3),
    ("tree", "max_tree_nodes", 16),
    ("no-budget", "budget", "off"),
    ("lagged", "budget", "lagged"),
])
def test_presets_merge_over_the_default(preset, knob, value):
    cfg = load_config(preset)
    assert getattr(cfg, knob) == value
    assert cfg.cost_refit_alpha == load_config().cost_refit_alpha  # untouched knobs keep the default


def test_every_preset_file_loads():
    for path in PRESET_DIR.glob("*.json"):
        assert isinstance(load_config(path.stem), DSparkKnobs)


def test_overrides_win_and_none_means_not_given():
    cfg = load_config("tree", {"max_window": 5, "latency_target_ms": 40, "min_verify": None})
    assert (cfg.max_window, cfg.tree_width, cfg.min_verify) == (5, 3, 0)
    assert cfg.latency_target_ms == 40.0 and isinstance(cfg.latency_target_ms, float)
    assert cfg.latency_target_s == pytest.approx(0.04)
    assert not cfg.is_chain


def test_config_is_frozen():
    with pytest.raises(dataclasses.FrozenInstanceError):
        load_config().max_window = 3


def test_preset_from_a_path(tmp_path):
    path = tmp_path / "mine.json"
    path.write_text('{"budget": "off", "description": "mine"}')
    assert load_config(str(path)).budget == "off"


def test_invalid_knob_message_is_one_exact_line():
    with pytest.raises(ValueError) as err:
        load_config(overrides={"max_window": 0})
    assert str(err.value) == "DSpark config: max_window=0 is invalid; allowed: null or an integer >= 1"


@pytest.mark.parametrize("knob, value, allowed", [
    ("max_window", 2.5, "null or an integer >= 1"),
    ("min_window", -1, "an integer >= 0"),
    ("survival_threshold", 1.5, "a number in [0, 1]"),
    ("branch_threshold", float("nan"), "a number in [0, 1]"),
    ("tree_width", 0, "an integer >= 1 (1 = chain)"),
    ("tree_width", True, "an integer >= 1 (1 = chain)"),
    ("max_tree_nodes", 0, "null or an integer >= 1"),
    ("budget", "greedy", "prefix | lagged | off"),
    ("min_verify", -1, "an integer >= 0"),
    ("max_verify", -1, "null or an integer >= 0 (0: verify no drafts)"),
    ("latency_target_ms", 0, "null or a number > 0"),
    ("cost_refit_alpha", 2, "a number in [0, 1]"),
    ("cost_table", "", "null or a non-empty path"),
    ("calibration", 3, "null or a non-empty path"),
    ("draft_vocab", " ", "null or a non-empty path"),
    ("lookup", "yes", "true | false"),
])
def test_each_invalid_knob_names_itself_and_what_is_allowed(knob, value, allowed):
    with pytest.raises(ValueError) as err:
        load_config(overrides={knob: value})
    message = str(err.value)
    assert message.startswith(f"DSpark config: {knob}=") and message.endswith(f"allowed: {allowed}")
    assert "\n" not in message


@pytest.mark.parametrize("overrides, knob, allowed", [
    ({"max_window": 4, "min_window": 5}, "min_window", "an integer in [0, max_window=4]"),
    ({"max_window": 8, "max_tree_nodes": 4}, "max_tree_nodes", "null or an integer >= max_window=8"),
    ({"max_verify": 2, "min_verify": 3}, "min_verify", "an integer in [0, max_verify=2]"),
])
def test_knobs_checked_against_each_other(overrides, knob, allowed):
    with pytest.raises(ValueError) as err:
        load_config(overrides=overrides)
    assert re.fullmatch(rf"DSpark config: {knob}=\d+ is invalid; allowed: {re.escape(allowed)}", str(err.value))


def test_unknown_knobs_are_refused_by_name(tmp_path):
    with pytest.raises(ValueError, match="unknown knob 'max_windw' in overrides"):
        load_config(overrides={"max_windw": 3})
    path = tmp_path / "typo.json"
    path.write_text('{"treewidth": 2}')
    with pytest.raises(ValueError, match="unknown knob 'treewidth' in preset"):
        load_config(str(path))


def test_bad_preset_files(tmp_path):
    with pytest.raises(ValueError, match="preset 'nope' not found.*'default'"):
        load_config("nope")
    path = tmp_path / "broken.json"
    path.write_text("{")
    with pytest.raises(ValueError, match="not valid JSON"):
        load_config(str(path))
    path.write_text("[1]")
    with pytest.raises(ValueError, match="JSON object"):
        load_config(str(path))


def test_cli_flags_map_to_knobs():
    assert cli_flag("max_window") == "--speculative-dspark-max-window"
    flags = {"--speculative-dspark-max-window": 5, "speculative_dspark_min_verify": None, "tp_size": 2,
             "speculative_dspark_budget": "lagged"}
    assert cli_overrides(flags) == {"max_window": 5, "budget": "lagged"}
    cfg = config_from_flags({**flags, "speculative_dspark_preset": "tree"})
    assert (cfg.max_window, cfg.budget, cfg.tree_width) == (5, "lagged", 3)
    assert config_from_flags({"speculative_dspark_preset": None}) == load_config()


def test_draft_knobs_carry_the_drafting_share():
    pytest.importorskip("sgl_dspark.drafter.knobs")
    knobs = load_config("tree", {"max_window": 5, "survival_threshold": 0.1}).draft_knobs((1.5, 2.0), (-0.5,))
    assert (knobs.max_window, knobs.tree_width, knobs.max_nodes) == (5, 3, 16)
    assert (knobs.survival_threshold, knobs.branch_threshold) == (0.1, 0.6)
    assert knobs.calibration(1) == (1.5, -0.5) and knobs.calibration(2) == (2.0, 0.0)


def test_the_verify_width_counts_lookup_nodes_and_the_cap():
    """One place for the KV SGLang reserves per request: the drafter's nodes plus the lookup's, capped."""
    from sgl_dspark.lookup import LookupKnobs

    assert load_config("default").verify_nodes(7) == 7
    assert load_config("tree").verify_nodes(7) == 16
    assert load_config("tree", {"lookup": True}).verify_nodes(7) == 16 + LookupKnobs().max_nodes
    assert load_config("no-budget", {"lookup": True, "max_verify": 5}).verify_nodes(7) == 5
    reference = load_config("default", {"max_verify": 0})
    assert reference.verify_nodes(7) == 0 and not reference.drafts


def test_a_drafters_recommended_knobs_sit_between_the_defaults_and_the_preset(tmp_path):
    (tmp_path / RECOMMENDED_FILE).write_text('{"description": "measured", "lookup": true, "tree_width": 2}')
    assert config_from_flags({}, tmp_path).lookup is True
    assert config_from_flags({}, tmp_path).tree_width == 2
    assert config_from_flags({"speculative_dspark_preset": "tree"}, tmp_path).tree_width == 3  # the preset wins
    assert config_from_flags({"speculative_dspark_lookup": False}, tmp_path).lookup is False  # a flag wins
    assert config_from_flags({}, tmp_path / "elsewhere") == load_config()  # no file: the defaults


def test_a_recommended_file_with_an_unknown_knob_is_refused_by_name(tmp_path):
    (tmp_path / RECOMMENDED_FILE).write_text('{"lookups": true}')
    with pytest.raises(ValueError, match="unknown knob 'lookups'"):
        config_from_flags({}, tmp_path)


def test_the_shipped_drafters_recommended_knobs_load():
    from sgl_dspark.tools.models import SHIPPED_DRAFTER

    assert config_from_flags({}, SHIPPED_DRAFTER).lookup is True


def test_lookup_knobs_come_from_the_config_and_default_to_the_lookup_defaults():
    from sgl_dspark.lookup import LookupKnobs

    assert load_config().lookup_knobs() == LookupKnobs()
    knobs = load_config("default", {"lookup": True, "lookup_max_nodes": 4, "lookup_width": 1, "lookup_max_len": 3})
    assert knobs.lookup_knobs() == LookupKnobs(width=1, max_len=3, max_nodes=4)
    assert knobs.verify_nodes(7) == 7 + 4  # the KV SGLang reserves follows the lookup's node budget
    with pytest.raises(ValueError, match="lookup_max_nodes=0 is invalid"):
        load_config("default", {"lookup_max_nodes": 0})
