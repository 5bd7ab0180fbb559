"""Drafter configuration: the frozen record parsed from a DeepSpec / dspark_* `config.json`, and the target it must fit.

Owns field lookup (top level, `text_config`, or nested `dflash_config` / `dspark_config`, nested winning), defaults,
and the one-line refusals for a drafter that does not fit its target. Pure Python; must not touch weights or SGLang.
"""

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

MARKOV_HEAD_TYPES = ("vanilla", "gated", "rnn")
_NESTED = ("dspark_config", "dflash_config")  # lookup order: first wins, then text_config, then top level
_UNSUPPORTED_ARCH_PREFIXES = ("Gemma4",)


@dataclass(frozen=True)
class TargetSpec:
    """What a drafter must agree with in its target model."""

    hidden_size: int
    vocab_size: int
    num_hidden_layers: int

    @staticmethod
    def from_hf_config(cfg: Mapping[str, Any]) -> "TargetSpec":
        text = cfg.get("text_config") or cfg
        return TargetSpec(int(text["hidden_size"]), int(text["vocab_size"]), int(text["num_hidden_layers"]))


@dataclass(frozen=True)
class DrafterConfig:
    """Shapes and DSpark knobs of one drafter checkpoint (Qwen3-style draft layers)."""

    hidden_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    intermediate_size: int
    vocab_size: int
    block_size: int  # gamma: draft tokens per parallel pass
    target_layer_ids: tuple[int, ...]  # target layer outputs concatenated per token (-1: embedding output)
    mask_token_id: int
    markov_rank: int
    markov_head_type: str = "vanilla"
    sample_from_anchor: bool = True
    enable_confidence_head: bool = True
    confidence_head_with_markov: bool = True
    num_target_layers: int | None = None
    draft_vocab_size: int | None = None  # None: the full target vocabulary; else rows of the `d2t` map
    rms_norm_eps: float = 1e-6
    rope_theta: float = 10000.0
    rope_linear_factor: float = 1.0
    partial_rotary_factor: float = 1.0
    attention_bias: bool = False
    architectures: tuple[str, ...] = ("Qwen3DSparkModel",)

    def __post_init__(self) -> None:
        if self.markov_head_type not in MARKOV_HEAD_TYPES:
            raise ValueError(f"markov_head_type {self.markov_head_type!r} is unknown (supported: "
                             f"{', '.join(MARKOV_HEAD_TYPES)})")
        if self.markov_rank <= 0:
            raise ValueError(f"markov_rank must be > 0 (the Markov head is required), got {self.markov_rank}")
        if self.block_size < 1:
            raise ValueError(f"block_size must be >= 1, got {self.block_size}")
        if not self.target_layer_ids:
            raise ValueError("target_layer_ids must be a non-empty list")
        if self.num_attention_heads % self.num_key_value_heads:
            raise ValueError(f"num_attention_heads {self.num_attention_heads} is not a multiple of "
                             f"num_key_value_heads {self.num_key_value_heads}")
        if self.draft_vocab_size is not None and not 0 < self.draft_vocab_size <= self.vocab_size:
            raise ValueError(f"draft_vocab_size {self.draft_vocab_size} must be in [1, vocab_size {self.vocab_size}]")
        bad = [a for a in self.architectures if a.startswith(_UNSUPPORTED_ARCH_PREFIXES)]
        if bad:
            raise ValueError(f"architectures {bad} are not supported (Qwen3-style DSpark drafters only)")

    @property
    def gamma(self) -> int:
        return self.block_size

    @property
    def query_len(self) -> int:
        """Rows in the parallel pass: anchor + gamma-1 masks, or anchor + gamma masks without sample_from_anchor."""
        return self.block_size if self.sample_from_anchor else self.block_size + 1

    @property
    def num_features(self) -> int:
        return len(self.target_layer_ids)

    @property
    def rotary_dim(self) -> int:
        return int(self.head_dim * self.partial_rotary_factor)

    @property
    def reduced_vocab(self) -> bool:
        return self.draft_vocab_size is not None and self.draft_vocab_size < self.vocab_size

    @property
    def lm_vocab_size(self) -> int:
        """Columns of the draft logits: the draft vocabulary when reduced, else the target's."""
        return self.draft_vocab_size if self.reduced_vocab else self.vocab_size

    def to_hf_dict(self) -> dict[str, Any]:
        """A flat config.json dict that `parse_drafter_config` reads back to an equal record."""
        out = {"architectures": list(self.architectures), "model_type": "qwen3", "hidden_act": "silu",
               "hidden_size": self.hidden_size, "num_hidden_layers": self.num_hidden_layers,
               "num_attention_heads": self.num_attention_heads, "num_key_value_heads": self.num_key_value_heads,
               "head_dim": self.head_dim, "intermediate_size": self.intermediate_size,
               "vocab_size": self.vocab_size, "rms_norm_eps": self.rms_norm_eps, "rope_theta": self.rope_theta,
               "partial_rotary_factor": self.partial_rotary_factor, "attention_bias": self.attention_bias,
               "block_size": self.block_size, "target_layer_ids": list(self.target_layer_ids),
               "mask_token_id": self.mask_token_id, "markov_rank": self.markov_rank,
               "markov_head_type": self.markov_head_type, "sample_from_anchor": self.sample_from_anchor,
               "enable_confidence_head": self.enable_confidence_head,
               "confidence_head_with_markov": self.confidence_head_with_markov}
        if self.rope_linear_factor != 1.0:
            out["rope_scaling"] = {"rope_type": "linear", "factor": self.rope_linear_factor}
        if self.num_target_layers is not None:
            out["num_target_layers"] = self.num_target_layers
        if self.draft_vocab_size is not None:
            out["draft_vocab_size"] = self.draft_vocab_size
        return out


def _lookup(cfg: Mapping[str, Any], key: str, default: Any = None) -> Any:
    for nested in _NESTED:
        sub = cfg.get(nested) or {}
        if key in sub and sub[key] is not None:
            return sub[key]
    text = cfg.get("text_config") or {}
    if key in text and text[key] is not None:
        return text[key]
    value = cfg.get(key)
    return default if value is None else value


def _require(cfg: Mapping[str, Any], key: str) -> Any:
    value = _lookup(cfg, key)
    if value is None:
        raise ValueError(f"drafter config: required field {key!r} is missing")
    return value


def _rope(cfg: Mapping[str, Any]) -> tuple[float, float]:
    """-> (rope_theta, linear factor). Accepts transformers v4 (`rope_scaling`) and v5 (`rope_parameters`)."""
    params = _lookup(cfg, "rope_parameters") or {}
    scaling = _lookup(cfg, "rope_scaling") or params
    theta = float(params.get("rope_theta", _lookup(cfg, "rope_theta", 10000.0)))
    kind = scaling.get("rope_type", scaling.get("type", "default"))
    if kind == "default":
        return theta, 1.0
    if kind == "linear":
        return theta, float(scaling["factor"])
    raise ValueError(f"rope_scaling type {kind!r} is not supported (default and linear only)")


def _check_layer_types(cfg: Mapping[str, Any]) -> None:
    layer_types = _lookup(cfg, "layer_types")
    if layer_types and any(t != "full_attention" for t in layer_types):
        raise ValueError(f"layer_types {sorted(set(layer_types))} not supported (full_attention only)")
    act = _lookup(cfg, "hidden_act", "silu")
    if act != "silu":
        raise ValueError(f"hidden_act {act!r} is not supported (silu only)")


def parse_drafter_config(cfg: Mapping[str, Any]) -> DrafterConfig:
    """HF-style config dict (as in config.json) -> DrafterConfig. Raises ValueError naming the bad field."""
    _check_layer_types(cfg)
    hidden = int(_require(cfg, "hidden_size"))
    heads = int(_require(cfg, "num_attention_heads"))
    markov_rank = int(_lookup(cfg, "markov_rank", 0))
    theta, factor = _rope(cfg)
    num_target = _lookup(cfg, "num_target_layers")
    draft_vocab = _lookup(cfg, "draft_vocab_size")
    return DrafterConfig(
        hidden_size=hidden,
        num_hidden_layers=int(_require(cfg, "num_hidden_layers")),
        num_attention_heads=heads,
        num_key_value_heads=int(_lookup(cfg, "num_key_value_heads", heads)),
        head_dim=int(_lookup(cfg, "head_dim", hidden // heads)),
        intermediate_size=int(_require(cfg, "intermediate_size")),
        vocab_size=int(_require(cfg, "vocab_size")),
        block_size=int(_require(cfg, "block_size")),
        target_layer_ids=tuple(int(x) for x in _require(cfg, "target_layer_ids")),
        mask_token_id=int(_require(cfg, "mask_token_id")),
        markov_rank=markov_rank,
        markov_head_type=str(_lookup(cfg, "markov_head_type", "vanilla")).lower(),
        sample_from_anchor=bool(_lookup(cfg, "sample_from_anchor", True)),
        enable_confidence_head=bool(_lookup(cfg, "enable_confidence_head", True)),
        confidence_head_with_markov=bool(_lookup(cfg, "confidence_head_with_markov", markov_rank > 0)),
        num_target_layers=None if num_target is None else int(num_target),
        draft_vocab_size=None if draft_vocab is None else int(draft_vocab),
        rms_norm_eps=float(_lookup(cfg, "rms_norm_eps", 1e-6)),
        rope_theta=theta,
        rope_linear_factor=factor,
        partial_rotary_factor=float(_lookup(cfg, "partial_rotary_factor", 1.0)),
        attention_bias=bool(_lookup(cfg, "attention_bias", False)),
        architectures=tuple(_lookup(cfg, "architectures", ("Qwen3DSparkModel",))),
    )


def check_fits_target(config: DrafterConfig, target: TargetSpec) -> None:
    """Raise a one-line ValueError naming the first field where the drafter does not fit the target."""
    if config.hidden_size != target.hidden_size:
        raise ValueError(f"hidden_size: drafter has {config.hidden_size}, target has {target.hidden_size}")
    if config.vocab_size != target.vocab_size:
        raise ValueError(f"vocab_size: drafter vocabulary has {config.vocab_size} tokens, target has "
                         f"{target.vocab_size}")
    bad = [i for i in config.target_layer_ids if not -1 <= i < target.num_hidden_layers]
    if bad:
        raise ValueError(f"target_layer_ids {bad} out of range for a target with {target.num_hidden_layers} layers "
                         f"(valid: -1..{target.num_hidden_layers - 1})")
    if not 0 <= config.mask_token_id < target.vocab_size:
        raise ValueError(f"mask_token_id {config.mask_token_id} out of range for target vocab_size "
                         f"{target.vocab_size}")
