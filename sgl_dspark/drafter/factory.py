"""Randomly initialised drafters and target weights, for tests and CPU benchmarks (no checkpoint needed).

Owns the tiny reference config dict and seeded initialisation. Must not be used to serve real traffic.
"""

from typing import Any

import torch

from sgl_dspark.drafter.config import TargetSpec, parse_drafter_config
from sgl_dspark.drafter.model import DSparkDrafter, TargetWeights


def tiny_hf_config(**overrides: Any) -> dict[str, Any]:
    """A DeepSpec-style config.json dict: hidden 32, 2 draft layers, vocab 50, gamma 4, a 6-layer target."""
    cfg = {"architectures": ["Qwen3DSparkModel"], "model_type": "qwen3", "hidden_act": "silu",
           "hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 2, "num_attention_heads": 4,
           "num_key_value_heads": 2, "head_dim": 8, "vocab_size": 50, "rms_norm_eps": 1e-6,
           "rope_theta": 10000.0, "block_size": 4, "target_layer_ids": [1, 3], "num_target_layers": 6,
           "mask_token_id": 49, "markov_rank": 8, "markov_head_type": "vanilla", "sample_from_anchor": True,
           "enable_confidence_head": True, "confidence_head_with_markov": True}
    cfg.update(overrides)
    return cfg


def random_target(spec: TargetSpec, seed: int = 0, dtype: torch.dtype = torch.float32) -> TargetWeights:
    g = torch.Generator().manual_seed(seed)
    embed = torch.randn(spec.vocab_size, spec.hidden_size, generator=g, dtype=dtype)
    lm_head = torch.randn(spec.vocab_size, spec.hidden_size, generator=g, dtype=dtype) / spec.hidden_size ** 0.5
    return TargetWeights(embed, lm_head)


def random_drafter(hf_config: dict[str, Any], seed: int = 0,
                   dtype: torch.dtype = torch.float32) -> tuple[DSparkDrafter, TargetSpec]:
    """A seeded drafter with its target attached; norms get non-trivial weights so every parameter matters."""
    config = parse_drafter_config(hf_config)
    spec = TargetSpec(config.hidden_size, config.vocab_size, config.num_target_layers or max(config.target_layer_ids) + 1)
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
