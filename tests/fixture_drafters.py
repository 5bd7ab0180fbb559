"""Test drafters: the tiny reference config and a hand-built Markov drafter with a known law (test fixtures, not
runtime code; seeded random drafters shaped for a real target are sgl_dspark.drafter.fresh)."""

from typing import Any

import torch

from sgl_dspark.drafter.fresh import DRAFTER_BASE, hf_config_for_target, random_drafter


def tiny_hf_config(**overrides: Any) -> dict[str, Any]:
    """A DeepSpec-style config.json dict: hidden 32, 2 draft layers, vocab 50, gamma 4, a 6-layer target."""
    cfg = {**DRAFTER_BASE, "hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 2,
           "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 8, "vocab_size": 50, "rms_norm_eps": 1e-6,
           "rope_theta": 10000.0, "block_size": 4, "target_layer_ids": [1, 3], "num_target_layers": 6,
           "mask_token_id": 49, "markov_rank": 8}
    cfg.update(overrides)
    return cfg


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
