"""Fresh (untrained) drafters shaped for a target: the config a new drafter of a target gets (training starts
from it) and seeded random weights (the lossless, rarely accepted fallback `sgl_dspark.tools.models.default_drafter`
serves for a model without a trained drafter; tests and CPU benchmarks).

Owns the drafter config keys that do not follow from the target (`DRAFTER_BASE`) and seeded initialisation; the
tiny test configs and hand-built test drafters live in tests/fixture_drafters.py.
"""

from typing import Any

import torch

from sgl_dspark.drafter.config import TargetSpec, parse_drafter_config
from sgl_dspark.drafter.model import DSparkDrafter, TargetWeights


# Every drafter config.json key that does not follow from the target's shape (hf_config_for_target sets the rest).
DRAFTER_BASE: dict[str, Any] = {"architectures": ["Qwen3DSparkModel"], "model_type": "qwen3", "hidden_act": "silu",
                                "markov_head_type": "vanilla", "sample_from_anchor": True,
                                "enable_confidence_head": True, "confidence_head_with_markov": True}


def random_target(spec: TargetSpec, seed: int = 0, dtype: torch.dtype = torch.float32) -> TargetWeights:
    g = torch.Generator().manual_seed(seed)
    embed = torch.randn(spec.vocab_size, spec.hidden_size, generator=g, dtype=dtype)
    lm_head = torch.randn(spec.vocab_size, spec.hidden_size, generator=g, dtype=dtype) / spec.hidden_size ** 0.5
    return TargetWeights(embed, lm_head)


def random_drafter(hf_config: dict[str, Any], seed: int = 0,
                   dtype: torch.dtype = torch.float32) -> tuple[DSparkDrafter, TargetSpec]:
    """A seeded drafter with its target attached; norms get non-trivial weights so every parameter matters."""
    config = parse_drafter_config(hf_config)
    layers = config.num_target_layers or max(config.target_layer_ids) + 1
    spec = TargetSpec(config.hidden_size, config.vocab_size, layers)
    torch.manual_seed(seed)
    drafter = DSparkDrafter(config).to(dtype)
    with torch.no_grad():
        for name, p in drafter.named_parameters():
            if name.endswith("norm.weight"):
                p.uniform_(0.5, 1.5)
    if config.reduced_vocab:
        g = torch.Generator().manual_seed(seed)
        ids = torch.randperm(config.vocab_size, generator=g)[:config.draft_vocab_size].sort().values
        drafter.set_draft_vocab(ids)
    drafter.attach_target(random_target(spec, seed, dtype))
    return drafter.eval().requires_grad_(False), spec


def target_rope_theta(target: dict[str, Any]) -> float:
    """The target's RoPE base from a transformers v4 (`rope_theta`) or v5 (`rope_parameters`) config dict."""
    return float((target.get("rope_parameters") or {}).get("rope_theta", target.get("rope_theta", 10000.0)))


def hf_config_for_target(target: dict[str, Any], num_layers: int = 2, gamma: int = 7,
                         layer_ids: tuple[int, ...] | None = None, markov_rank: int = 64,
                         draft_vocab_size: int | None = None) -> dict[str, Any]:
    """A drafter config.json dict shaped for a Llama/Qwen-style target's config dict (same width and heads)."""
    n = int(target["num_hidden_layers"])
    ids = list(layer_ids or sorted({1, n // 4, n // 2, 3 * n // 4, n - 2}))
    heads = int(target["num_attention_heads"])
    return dict(
        DRAFTER_BASE, hidden_size=target["hidden_size"], intermediate_size=target["intermediate_size"],
        num_hidden_layers=num_layers, num_attention_heads=heads, num_key_value_heads=target["num_key_value_heads"],
        head_dim=target.get("head_dim") or target["hidden_size"] // heads, vocab_size=target["vocab_size"],
        rms_norm_eps=target.get("rms_norm_eps", 1e-6), rope_theta=target_rope_theta(target), block_size=gamma,
        target_layer_ids=ids, num_target_layers=n,
        mask_token_id=int(target["vocab_size"]) - 1, markov_rank=markov_rank,
        **({} if draft_vocab_size is None else {"draft_vocab_size": draft_vocab_size}))


def save_random_drafter_for(target_dir: str, out_dir: str, seed: int = 0, **shape: Any) -> str:
    """Write a seeded random drafter checkpoint that fits the HF model folder `target_dir`; returns out_dir."""
    import json
    from pathlib import Path

    from sgl_dspark.drafter.checkpoint import save_drafter

    target = json.loads((Path(target_dir) / "config.json").read_text())
    drafter, _ = random_drafter(hf_config_for_target(target, **shape), seed)
    save_drafter(drafter, out_dir)
    return out_dir
