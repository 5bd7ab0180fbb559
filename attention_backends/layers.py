"""What one FlashInfer verify plan serves: the model's attention layers, read once at start-up, and the refusals.

A plan is made once per verify batch and shared by every layer of the forward, so it bakes in what the layers
must agree on (KV heads, head sizes, softmax scale, soft cap); query heads are planned at the largest count, as
SGLang's FlashInfer backend does (fewer is safe, more would be silently wrong). Whatever the verify path cannot
compute exactly is refused here with one line (`VerifyRefusal`). Pure: no SGLang, no flashinfer.
"""

from collections.abc import Sequence
from dataclasses import dataclass

BACKEND = "dspark_flashinfer"


class VerifyRefusal(ValueError):
    """A one-line reason why the FlashInfer tree-verify backend cannot serve this model or server."""


@dataclass(frozen=True)
class LayerSpec:
    """What a verify run reads off one attention layer (SGLang's RadixAttention)."""

    q_heads: int
    kv_heads: int
    head_dim_qk: int
    head_dim_vo: int
    scaling: float
    logit_cap: float = 0.0  # > 0: logits = cap * tanh(logits / cap) (Gemma-2 style)
    sliding_window: int = -1  # > -1: a sliding-window layer
    self_attention: bool = True  # False: cross-attention or encoder-only
    capping_method: str = "tanh"


@dataclass(frozen=True)
class PlanDims:
    """What one plan bakes in for every layer of a verify forward."""

    num_qo_heads: int  # the most query heads any layer runs
    num_kv_heads: int
    head_dim_qk: int
    head_dim_vo: int
    sm_scale: float
    logits_soft_cap: float  # 0.0: none


@dataclass(frozen=True)
class RunnerFacts:
    """The server-side facts the verify path depends on (read off SGLang's model runner by the shell)."""

    reads_untranslated: bool  # KV reads need a translation the index table does not apply (decode context parallel)
    dequant_workspace: bool  # FP4 KV cache served through a dequantized workspace
    verify_graphs: bool  # CUDA graphs capture TARGET_VERIFY (replayed through SGLang's own FlashInfer verify plan)


def plan_dims(layers: Sequence[LayerSpec]) -> PlanDims:
    """The layers of a model -> the one plan they share, or VerifyRefusal naming the first disagreement.
    Example: two layers of 8 and 4 query heads, 2 KV heads, dim 128 -> PlanDims(8, 2, 128, 128, scale, 0.0)."""
    if not layers:
        raise VerifyRefusal(f"{BACKEND}: the model has no RadixAttention layers to plan the verify pass for")
    for spec in layers:
        _check_layer(spec)
    first = layers[0]
    for name in ("kv_heads", "head_dim_qk", "head_dim_vo", "scaling", "logit_cap"):
        values = sorted({getattr(spec, name) for spec in layers})
        if len(values) > 1:
            raise VerifyRefusal(f"{BACKEND}: one verify plan serves every layer, but the layers differ in {name} "
                                f"({', '.join(map(str, values))})")
    return PlanDims(max(spec.q_heads for spec in layers), first.kv_heads, first.head_dim_qk, first.head_dim_vo,
                    first.scaling, first.logit_cap)


def check_runner(facts: RunnerFacts, dims: PlanDims) -> None:
    """VerifyRefusal when the server around the backend needs what the verify path does not do."""
    if facts.reads_untranslated:
        raise VerifyRefusal(f"{BACKEND}: decode context parallelism (--dcp-size > 1) is not supported: its KV "
                            f"read ids need a translation the verify gather does not apply")
    if facts.dequant_workspace:
        raise VerifyRefusal(f"{BACKEND}: FP4 KV caches (served through a dequantized workspace) are not supported; "
                            f"use a bf16/fp16 or FP8 KV cache (--kv-cache-dtype)")
    if facts.verify_graphs and (dims.logits_soft_cap > 0 or dims.head_dim_vo != dims.head_dim_qk):
        raise VerifyRefusal(f"{BACKEND}: CUDA graphs replay SGLang's own FlashInfer verify plan, which plans no "
                            f"logits soft cap and no separate value head size; pass --disable-cuda-graph")


def _check_layer(spec: LayerSpec) -> None:
    if not spec.self_attention:
        raise VerifyRefusal(f"{BACKEND}: tree verification is causal self-attention; cross-attention and "
                            f"encoder-only layers are not supported")
    if spec.sliding_window > -1:
        raise VerifyRefusal(f"{BACKEND}: sliding-window layers (window {spec.sliding_window}) are not supported")
    if spec.logit_cap > 0 and spec.capping_method != "tanh":
        raise VerifyRefusal(f"{BACKEND}: logit capping method {spec.capping_method!r} is not supported "
                            f"(FlashInfer caps with tanh)")
    if spec.q_heads % spec.kv_heads:
        raise VerifyRefusal(f"{BACKEND}: {spec.q_heads} query heads are not a multiple of {spec.kv_heads} KV heads")
