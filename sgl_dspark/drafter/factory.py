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
    return tiny_hf_config(
        hidden_size=target["hidden_size"], intermediate_size=target["intermediate_size"],
        num_hidden_layers=num_layers, num_attention_heads=heads, num_key_value_heads=target["num_key_value_heads"],
        head_dim=target.get("head_dim") or target["hidden_size"] // heads, vocab_size=target["vocab_size"],
        rms_norm_eps=target.get("rms_norm_eps", 1e-6), rope_theta=target_rope_theta(target), block_size=gamma, target_layer_ids=ids, num_target_layers=n,
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


def save_markov_drafter_for(target_dir: str, out_dir: str, logits: dict[int, dict[int, float]],
                            confidence: dict[int, float], default_confidence: float, seed: int = 0,
                            draft_vocab_size: int = 4096) -> str:
    """A test drafter that ignores the target's features: after token a its draft logits are logits[a][t] for the
    listed t and 0 for every other id of its draft vocabulary (the seeded random drafter, one layer, with the
    backbone's output zeroed and a Markov head holding the table), and its confidence is confidence[a], else
    default_confidence. The draft vocabulary holds every listed t. Returns out_dir.

    Example: logits {5: {7: 9.0}} -> after token 5, token 7 has probability e^9 / (e^9 + draft_vocab_size - 1)."""
    import json
    from pathlib import Path

    from sgl_dspark.drafter.checkpoint import save_drafter

    listed = sorted({t for row in logits.values() for t in row})
    slot = {t: j + 1 for j, t in enumerate(listed)}  # slot 0 carries the confidence logit
    target = json.loads((Path(target_dir) / "config.json").read_text())
    config = hf_config_for_target(target, num_layers=1, markov_rank=1 + len(slot), draft_vocab_size=draft_vocab_size)
    drafter, _ = random_drafter(config, seed)
    others = [t for t in drafter.draft_to_target.tolist() if t not in slot]
    drafter.set_draft_vocab(torch.tensor(sorted(listed + others[:draft_vocab_size - len(listed)])))
    draft_id = {t: d for d, t in enumerate(drafter.draft_to_target.tolist())}
    w1, w2 = drafter.markov_head.markov_w1.weight, drafter.markov_head.markov_w2.weight  # [V, r], [D, r]
    conf = drafter.confidence_head.proj  # logit = w . [h ; W1[a]] + b, and h = 0
    base = torch.logit(torch.tensor(default_confidence)).item()
    with torch.no_grad():
        drafter.norm.weight.zero_()  # the backbone's hidden -> 0: the draft logits are the Markov bias alone
        w1.zero_()
        w2.zero_()
        conf.weight.zero_()
        conf.bias.fill_(base)
        conf.weight[0, config["hidden_size"]] = 1.0
        for t, j in slot.items():
            w2[draft_id[t], j] = 1.0
        for a, row in logits.items():
            for t, value in row.items():
                w1[a, slot[t]] = value
        for a, c in confidence.items():
            w1[a, 0] = torch.logit(torch.tensor(c)).item() - base
    save_drafter(drafter, out_dir)
    return out_dir
