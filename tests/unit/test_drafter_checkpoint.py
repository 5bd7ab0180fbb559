"""Checkpoint I/O: save -> load gives identical outputs; DeepSpec-style names load; misfits are refused by name."""

import json

import pytest
import torch
from safetensors.torch import load_file, save_file

from sgl_dspark.drafter import (DraftKnobs, Proposer, ProposeInput, TargetSpec, load_drafter, pad_contexts,
                                save_drafter)
from sgl_dspark.drafter.checkpoint import compress_weights
from fixture_drafters import tiny_hf_config
from sgl_dspark.drafter.fresh import random_drafter
from sgl_dspark.sampling import SamplingParams


def propose_once(drafter, seed=0):
    f = torch.randn(6, 64, generator=torch.Generator().manual_seed(3))
    ctx = pad_contexts([drafter.context_kv(f, torch.arange(6))])
    inp = ProposeInput(ctx, torch.tensor([7]), torch.tensor([6]), (SamplingParams(temperature=0.8),),
                       torch.Generator().manual_seed(seed))
    return Proposer(drafter, DraftKnobs(tree_width=2, branch_threshold=0.6)).propose(inp).trees[0]


def test_a_compressed_checkpoint_loads_the_same_weights(tmp_path):
    drafter, spec = random_drafter(tiny_hf_config())
    save_drafter(drafter, tmp_path)
    plain = load_drafter(tmp_path, spec, drafter.target).state_dict()
    packed = compress_weights(tmp_path)
    assert packed.name == "model.safetensors.xz" and not (tmp_path / "model.safetensors").exists()
    loaded = load_drafter(tmp_path, spec, drafter.target).state_dict()
    assert loaded.keys() == plain.keys() and all(torch.equal(loaded[k], plain[k]) for k in plain)


@pytest.mark.parametrize("overrides", [{}, {"markov_head_type": "gated"}, {"markov_head_type": "rnn"},
                                       {"draft_vocab_size": 20}, {"enable_confidence_head": False}])
def test_round_trip_gives_identical_outputs(tmp_path, overrides):
    drafter, spec = random_drafter(tiny_hf_config(**overrides))
    save_drafter(drafter, tmp_path)
    loaded = load_drafter(tmp_path, spec, drafter.target)
    assert loaded.config == drafter.config
    a, b = propose_once(drafter), propose_once(loaded)
    assert torch.equal(a.tokens, b.tokens) and torch.equal(a.parents, b.parents)
    torch.testing.assert_close(a.confidence, b.confidence, rtol=0, atol=0)
    torch.testing.assert_close(a.draft_probs, b.draft_probs, rtol=0, atol=0)


def write(path, cfg, tensors):
    path.mkdir(exist_ok=True)
    (path / "config.json").write_text(json.dumps(cfg))
    save_file(tensors, str(path / "model.safetensors"))


@pytest.fixture()
def saved(tmp_path):
    drafter, spec = random_drafter(tiny_hf_config())
    save_drafter(drafter, tmp_path / "src")
    cfg = json.loads((tmp_path / "src" / "config.json").read_text())
    return drafter, spec, cfg, load_file(str(tmp_path / "src" / "model.safetensors")), tmp_path / "dst"


def test_deepspec_layout_loads_unchanged(saved):
    """Nested dflash_config, a `model.` prefix, bf16 weights, and the target's own embed/lm_head rows present."""
    drafter, spec, cfg, tensors, dst = saved
    nested = {k: cfg.pop(k) for k in ("block_size", "target_layer_ids", "mask_token_id")}
    cfg["dflash_config"] = nested
    tensors = {("model." + k if k.startswith("layers.") else k): v.bfloat16() for k, v in tensors.items()}
    tensors["embed_tokens.weight"] = torch.zeros(50, 32)
    tensors["lm_head.weight"] = torch.zeros(50, 32)
    write(dst, cfg, tensors)
    loaded = load_drafter(dst, spec, drafter.target)
    torch.testing.assert_close(loaded.fc.weight, drafter.fc.weight.bfloat16().float())


@pytest.mark.parametrize("spec, field", [
    (TargetSpec(64, 50, 6), "hidden_size"),
    (TargetSpec(32, 51, 6), "vocab_size"),
    (TargetSpec(32, 50, 2), "target_layer_ids"),
])
def test_refuses_a_target_it_does_not_fit(saved, spec, field):
    _, _, cfg, tensors, dst = saved
    write(dst, cfg, tensors)
    with pytest.raises(ValueError, match=field) as err:
        load_drafter(dst, spec)
    assert "\n" not in str(err.value)


def edit(cfg=None, drop=(), add=None, reshape=None):
    def apply(c, t):
        c = {**c, **(cfg or {})}
        t = {k: v for k, v in t.items() if k not in drop}
        t.update(add or {})
        if reshape:
            t[reshape] = t[reshape][:, :-1].contiguous()
        return c, t
    return apply


@pytest.mark.parametrize("change, field", [
    (edit(cfg={"mask_token_id": 50}), "mask_token_id 50 out of range"),
    (edit(cfg={"markov_head_type": "transformer"}), "markov_head_type 'transformer' is unknown"),
    (edit(drop=("confidence_head.proj.weight", "confidence_head.proj.bias")), "confidence_head: .*lacks"),
    (edit(drop=("layers.1.mlp.up_proj.weight",)), "missing weights: layers.1.mlp.up_proj.weight"),
    (edit(add={"layers.0.self_attn.sinks": torch.zeros(4)}), "unexpected weights: layers.0.self_attn.sinks"),
    (edit(reshape="fc.weight"), r"weight fc.weight: checkpoint shape \(32, 63\), expected \(32, 64\)"),
    (edit(cfg={"draft_vocab_size": 20}), "missing weights: d2t"),
    (edit(cfg={"draft_vocab_size": 3}, add={"d2t": torch.tensor([0, 0, 48]),
                                            "markov_head.markov_w2.weight": torch.zeros(3, 8)}),
     "d2t maps draft ids outside"),
])
def test_refusals_name_the_field(saved, change, field):
    _, spec, cfg, tensors, dst = saved
    write(dst, *change(cfg, tensors))
    with pytest.raises(ValueError, match=field) as err:
        load_drafter(dst, spec)
    assert "\n" not in str(err.value)


def test_disabled_confidence_head_ignores_its_weights(saved):
    _, spec, cfg, tensors, dst = saved
    write(dst, {**cfg, "enable_confidence_head": False}, tensors)
    assert load_drafter(dst, spec).confidence_head is None
