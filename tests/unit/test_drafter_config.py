"""DrafterConfig parsing: top-level and nested (dflash_config / dspark_config) fields, defaults, target checks."""

import pytest

from sgl_dspark.drafter.config import DrafterConfig, TargetSpec, check_fits_target, parse_drafter_config
from fixture_drafters import tiny_hf_config

DSPARK_KEYS = ("block_size", "target_layer_ids", "mask_token_id", "markov_rank", "markov_head_type",
               "sample_from_anchor", "enable_confidence_head", "confidence_head_with_markov", "num_target_layers")
TARGET = TargetSpec(hidden_size=32, vocab_size=50, num_hidden_layers=6)


def nested(key: str) -> dict:
    flat = tiny_hf_config()
    inner = {k: flat.pop(k) for k in DSPARK_KEYS}
    return {**flat, key: inner}


def test_top_level_fields():
    c = parse_drafter_config(tiny_hf_config())
    shapes = (c.hidden_size, c.num_hidden_layers, c.num_attention_heads, c.num_key_value_heads, c.head_dim)
    assert shapes == (32, 2, 4, 2, 8)
    assert (c.block_size, c.target_layer_ids, c.mask_token_id, c.markov_rank) == (4, (1, 3), 49, 8)
    assert (c.markov_head_type, c.sample_from_anchor, c.enable_confidence_head) == ("vanilla", True, True)
    assert (c.gamma, c.query_len, c.num_features, c.lm_vocab_size, c.reduced_vocab) == (4, 4, 2, 50, False)


@pytest.mark.parametrize("key", ["dflash_config", "dspark_config"])
def test_nested_fields_equal_top_level(key):
    assert parse_drafter_config(nested(key)) == parse_drafter_config(tiny_hf_config())


def test_nested_wins_over_top_level_and_dspark_over_dflash():
    cfg = tiny_hf_config(block_size=16, dflash_config={"block_size": 8, "mask_token_id": 7},
                         dspark_config={"block_size": 5})
    c = parse_drafter_config(cfg)
    assert (c.block_size, c.mask_token_id) == (5, 7)


def test_defaults():
    cfg = tiny_hf_config()
    for k in ("num_key_value_heads", "head_dim", "markov_head_type", "sample_from_anchor",
              "enable_confidence_head", "confidence_head_with_markov", "rope_theta"):
        del cfg[k]
    c = parse_drafter_config(cfg)
    assert (c.num_key_value_heads, c.head_dim, c.markov_head_type) == (4, 8, "vanilla")
    assert (c.sample_from_anchor, c.enable_confidence_head, c.confidence_head_with_markov) == (True, True, True)
    assert c.rope_theta == 10000.0


def test_sample_from_anchor_off_adds_a_query_row():
    c = parse_drafter_config(tiny_hf_config(sample_from_anchor=False))
    assert (c.gamma, c.query_len) == (4, 5)


def test_rope_parameters_v5_and_linear_scaling():
    c = parse_drafter_config(tiny_hf_config(rope_parameters={"rope_type": "default", "rope_theta": 1e6}))
    assert (c.rope_theta, c.rope_linear_factor) == (1e6, 1.0)
    c = parse_drafter_config(tiny_hf_config(rope_scaling={"type": "linear", "factor": 2.0}))
    assert c.rope_linear_factor == 2.0
    with pytest.raises(ValueError, match="rope_scaling type 'yarn'"):
        parse_drafter_config(tiny_hf_config(rope_scaling={"rope_type": "yarn", "factor": 4.0}))


def test_to_hf_dict_round_trips():
    c = parse_drafter_config(tiny_hf_config(markov_head_type="rnn", draft_vocab_size=20,
                                            rope_scaling={"rope_type": "linear", "factor": 2.0}))
    assert parse_drafter_config(c.to_hf_dict()) == c


@pytest.mark.parametrize("overrides, field", [
    ({"markov_head_type": "lstm"}, "markov_head_type 'lstm' is unknown"),
    ({"markov_rank": 0}, "markov_rank"),
    ({"mask_token_id": None}, "'mask_token_id' is missing"),
    ({"layer_types": ["full_attention", "sliding_attention"]}, "layer_types"),
    ({"hidden_act": "gelu"}, "hidden_act"),
    ({"architectures": ["Gemma4DSparkModel"]}, "architectures"),
])
def test_parse_refusals_name_the_field(overrides, field):
    with pytest.raises(ValueError, match=field):
        parse_drafter_config(tiny_hf_config(**overrides))


@pytest.mark.parametrize("target, field", [
    (TargetSpec(64, 50, 6), "hidden_size: drafter has 32, target has 64"),
    (TargetSpec(32, 60, 6), "vocab_size"),
    (TargetSpec(32, 50, 3), r"target_layer_ids \[3\] out of range"),
])
def test_target_refusals_name_the_field(target, field):
    with pytest.raises(ValueError, match=field):
        check_fits_target(parse_drafter_config(tiny_hf_config()), target)


def test_mask_token_out_of_range():
    with pytest.raises(ValueError, match="mask_token_id 50 out of range"):
        check_fits_target(parse_drafter_config(tiny_hf_config(mask_token_id=50)), TARGET)


def test_embedding_output_layer_id_is_accepted():
    check_fits_target(parse_drafter_config(tiny_hf_config(target_layer_ids=[-1, 5])), TARGET)


def test_record_is_frozen():
    c = parse_drafter_config(tiny_hf_config())
    with pytest.raises(AttributeError):
        c.block_size = 3  # type: ignore[misc]
    assert isinstance(c, DrafterConfig)
