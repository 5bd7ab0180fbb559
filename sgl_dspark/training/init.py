"""A new drafter shaped for a target, initialised from it: draft layers copied from the target's top layers.

Owns the shape presets, the draft vocabulary (most frequent tokens of the training data) and the copy-init:
draft layer i = target layer N-L+i; `fc` selects the feature of layer N-L-1 (the input of the first copied layer)
and `hidden_norm` = that layer's input norm, so the first draft layer's context keys/values start as what the
target computes (up to the draft q/k norms, set to the measured mean head RMS). Gemma-style layers (norms scaling
by 1 + weight, q/k norms, post-attention/-MLP norms, GeGLU) are mapped onto the draft layer as closely as it allows
(`copy_gemma_layer`). Must not train.
"""

from dataclasses import dataclass

import torch

from sgl_dspark.drafter.config import parse_drafter_config
from sgl_dspark.drafter.fresh import hf_config_for_target
from sgl_dspark.drafter.model import DSparkDrafter, TargetWeights
from sgl_dspark.training.target import FrozenTarget


@dataclass(frozen=True)
class Shape:
    num_layers: int
    gamma: int
    markov_rank: int
    draft_vocab_size: int | None
    markov_head_type: str = "vanilla"


PRESETS = {
    "small": Shape(num_layers=2, gamma=7, markov_rank=128, draft_vocab_size=8192),
    "tiny": Shape(num_layers=1, gamma=7, markov_rank=64, draft_vocab_size=4096),
    # "small" with one draft layer: the depth comparison of benchmarks.learning (drafting time against tau)
    "small-1layer": Shape(num_layers=1, gamma=7, markov_rank=128, draft_vocab_size=8192),
    # for large target vocabularies: the Markov W1 is a [V, r] table (262k x 16 = 8 MB in bf16 for Gemma-3)
    "compact": Shape(num_layers=2, gamma=7, markov_rank=16, draft_vocab_size=8192),
}


def feature_layers(num_target_layers: int, num_draft_layers: int) -> tuple[int, ...]:
    """Spread low/middle layers plus the input of the first copied layer (last entry)."""
    n, top = num_target_layers, num_target_layers - num_draft_layers - 1
    return tuple(sorted({1, n // 4, n // 2, 3 * n // 4, top}))


def frequent_tokens(sequences: list[list[int]], size: int, vocab_size: int) -> torch.Tensor:
    """[size] the most frequent target ids over `sequences`, sorted by id (ties: lower id first)."""
    counts = torch.zeros(vocab_size, dtype=torch.long)
    for ids in sequences:
        counts += torch.bincount(torch.tensor(ids, dtype=torch.long), minlength=vocab_size)
    order = torch.argsort(-counts, stable=True)[:size]
    return order.sort().values


def new_drafter(target_config: dict, shape: Shape, weights: TargetWeights,
                vocab: torch.Tensor | None) -> DSparkDrafter:
    n = int(target_config["num_hidden_layers"])
    hf = hf_config_for_target(target_config, num_layers=shape.num_layers, gamma=shape.gamma,
                              layer_ids=feature_layers(n, shape.num_layers), markov_rank=shape.markov_rank,
                              draft_vocab_size=shape.draft_vocab_size)
    hf["markov_head_type"] = shape.markov_head_type
    drafter = DSparkDrafter(parse_drafter_config(hf))
    if vocab is not None:
        drafter.set_draft_vocab(vocab)
    drafter.attach_target(weights)
    with torch.no_grad():
        drafter.markov_head.markov_w2.weight.zero_()  # the Markov bias starts at 0 (paper)
        drafter.markov_head.markov_w1.weight.normal_(0.0, 0.02)
        if drafter.confidence_head is not None:
            drafter.confidence_head.proj.weight.zero_()
            drafter.confidence_head.proj.bias.fill_(-1.0)
    return drafter


def head_rms(proj: torch.nn.Linear, x: torch.Tensor, head_dim: int) -> float:
    """Mean per-head RMS of proj(x) (x [T, H])."""
    y = proj(x).view(x.shape[0], -1, head_dim).float()
    return float(y.pow(2).mean(-1).sqrt().mean())


@torch.no_grad()
def copy_top_layers(drafter: DSparkDrafter, target: FrozenTarget, sample_ids: list[int]) -> None:
    """Copy-init from the target (see module doc); `sample_ids` is a token sequence to measure q/k scales on."""
    n, layers = target.num_layers, len(drafter.layers)
    run = target.run(sample_ids, drafter.config.target_layer_ids)
    dtype = drafter.fc.weight.dtype
    for i, draft in enumerate(drafter.layers):
        src = target.layer(n - layers + i)
        if hasattr(src, "pre_feedforward_layernorm"):
            copy_gemma_layer(draft, src, sample_ids, target)
            continue
        for name in ("input_layernorm", "post_attention_layernorm", "mlp.gate_proj", "mlp.up_proj", "mlp.down_proj",
                     "self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "self_attn.o_proj"):
            draft.get_submodule(name).load_state_dict(
                {k: v.to(dtype) for k, v in src.get_submodule(name).state_dict().items()})
        x = src.input_layernorm(run.hidden[n - layers + i])
        d = drafter.config.head_dim
        draft.self_attn.q_norm.weight.fill_(head_rms(src.self_attn.q_proj, x, d))
        draft.self_attn.k_norm.weight.fill_(head_rms(src.self_attn.k_proj, x, d))
    drafter.norm.weight.copy_(norm_scale(target.final_norm).to(dtype))
    h = drafter.config.hidden_size
    drafter.fc.weight.zero_()
    last = len(drafter.config.target_layer_ids) - 1  # the feature entering the first copied layer
    drafter.fc.weight[:, last * h:(last + 1) * h] = torch.eye(h, dtype=dtype)
    drafter.hidden_norm.weight.copy_(norm_scale(target.layer(n - layers).input_layernorm).to(dtype))


def norm_scale(norm: torch.nn.Module) -> torch.Tensor:
    """What an RMSNorm multiplies the normalised input by: weight, or 1 + weight for Gemma's norms."""
    return norm.weight + 1.0 if type(norm).__name__.startswith("Gemma") else norm.weight


# GELU-tanh(x) ~ x * sigmoid(1.702 x) = silu(1.702 x) / 1.702: the draft SwiGLU approximates Gemma's GeGLU.
GELU_SILU = 1.702


@torch.no_grad()
def copy_gemma_layer(draft: torch.nn.Module, src: torch.nn.Module, sample_ids: list[int], target: FrozenTarget) -> None:
    """A Gemma decoder layer -> a pre-norm draft layer: norms as their 1 + weight scales, q/k norms exactly, GeGLU
    as a scaled SwiGLU, and the post-attention/-MLP norms folded into o_proj/down_proj as per-channel scales over
    the output RMS measured on `sample_ids` (a norm of the output is a scale when that RMS is steady)."""
    rms = output_rms(target, src, sample_ids)
    dtype = draft.mlp.down_proj.weight.dtype
    for name in ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "mlp.up_proj"):
        draft.get_submodule(name).weight.copy_(src.get_submodule(name).weight.to(dtype))
    draft.mlp.gate_proj.weight.copy_((src.mlp.gate_proj.weight * GELU_SILU).to(dtype))
    post_attn = norm_scale(src.post_attention_layernorm) / rms["attn"]
    post_mlp = norm_scale(src.post_feedforward_layernorm) / (rms["mlp"] * GELU_SILU)
    draft.self_attn.o_proj.weight.copy_((src.self_attn.o_proj.weight * post_attn[:, None]).to(dtype))
    draft.mlp.down_proj.weight.copy_((src.mlp.down_proj.weight * post_mlp[:, None]).to(dtype))
    draft.input_layernorm.weight.copy_(norm_scale(src.input_layernorm).to(dtype))
    draft.post_attention_layernorm.weight.copy_(norm_scale(src.pre_feedforward_layernorm).to(dtype))
    draft.self_attn.q_norm.weight.copy_(norm_scale(src.self_attn.q_norm).to(dtype))
    draft.self_attn.k_norm.weight.copy_(norm_scale(src.self_attn.k_norm).to(dtype))


def output_rms(target: FrozenTarget, layer: torch.nn.Module, sample_ids: list[int]) -> dict[str, float]:
    """Mean RMS of the layer's attention output (o_proj) and MLP output (down_proj) over one target pass."""
    seen: dict[str, float] = {}

    def hook(key):
        return lambda module, args, out: seen.__setitem__(key, float(out.float().pow(2).mean(-1).sqrt().mean()))

    handles = [layer.self_attn.o_proj.register_forward_hook(hook("attn")),
               layer.mlp.down_proj.register_forward_hook(hook("mlp"))]
    try:
        target.run(sample_ids, (0,))
    finally:
        for handle in handles:
            handle.remove()
    return seen


def bigram_pmi(sequences: list[list[int]], draft_ids: torch.Tensor, smoothing: float = 1.0
               ) -> tuple[torch.Tensor, torch.Tensor]:
    """Token sequences -> (prev ids [P], PMI [P, D]): for each token seen before another, log P(b | a) / P(b) over
    the draft vocabulary `draft_ids` [D] (target ids), P(b | a) = c(a, b) / (c(a) + smoothing); pairs never seen
    (and pairs whose next token is outside the draft vocabulary) get 0, so the bias stays neutral there.

    Example: [[5, 7, 5, 7, 5, 8]], draft_ids [7, 8] -> prev [5] (7 -> 5 leaves the draft vocabulary), PMI
    [[log((2/4) / (2/3)), log((1/4) / (1/3))]]."""
    index = {int(t): i for i, t in enumerate(draft_ids.tolist())}
    pairs = [(a, index[b]) for ids in sequences for a, b in zip(ids, ids[1:]) if b in index]
    if not pairs:
        return torch.empty(0, dtype=torch.long), torch.empty(0, draft_ids.shape[0])
    prev = torch.tensor([a for a, _ in pairs])
    nxt = torch.tensor([b for _, b in pairs])
    rows, row_of = torch.unique(prev, return_inverse=True)
    counts = torch.zeros(rows.shape[0], draft_ids.shape[0])
    counts.index_put_((row_of, nxt), torch.ones(nxt.shape[0]), accumulate=True)
    unigram = counts.sum(0) / counts.sum()
    cond = counts / (counts.sum(1, keepdim=True) + smoothing)
    pmi = torch.where(counts > 0, torch.log(cond / unigram.clamp_min(1e-12)), torch.zeros(()))
    return rows, pmi


@torch.no_grad()
def bigram_markov(drafter: DSparkDrafter, sequences: list[list[int]], scale: float = 0.5) -> float:
    """Warm start of the Markov head: W2(W1[a]) ~ scale * PMI(a, .) (bigram_pmi of the training data), as a rank-r
    factorisation (randomised SVD) split evenly between W1 rows and W2; tokens never seen as a predecessor keep W1
    at 0. `scale` < 1: the backbone already predicts the unigram part, the head adds what the last token says.
    Returns the share of the PMI's energy the rank-r factorisation keeps."""
    draft_ids = drafter.draft_to_target
    if draft_ids is None:
        draft_ids = torch.arange(drafter.config.vocab_size)
    rows, pmi = bigram_pmi(sequences, draft_ids)
    head = drafter.markov_head
    head.markov_w1.weight.zero_()
    head.markov_w2.weight.zero_()
    if rows.numel() == 0:
        return 0.0
    rank = min(head.rank, *pmi.shape)
    u, s, v = torch.svd_lowrank(pmi * scale, q=rank, niter=4)
    root = s.sqrt()
    w1, w2 = head.markov_w1.weight, head.markov_w2.weight
    w1[rows, :rank] = (u * root).to(w1.dtype)
    w2[:, :rank] = (v * root).to(w2.dtype)
    total = float((pmi * scale).pow(2).sum())
    return float(s.pow(2).sum()) / total if total > 0 else 0.0
