"""The DSpark training objective (paper 3.3): random anchors, teacher-forced blocks, CE + TV + confidence BCE.

Owns anchor sampling, the block forward of a drafter over one sequence's features, and the loss with position
weights w_k = exp(-(k-1)/decay). Pure torch; must not load models, data files or SGLang.
"""

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from sgl_dspark.drafter.layers import PaddedKV
from sgl_dspark.drafter.model import DSparkDrafter


@dataclass(frozen=True)
class Blocks:
    """B anchors of one sequence; k = 1..gamma are draft positions."""

    anchors: torch.Tensor  # [B] anchor position a (block input x_a; context rows 0..a-1)
    prev: torch.Tensor  # [B, g] x_{a+k-1}: the Markov head's previous token (teacher-forced)
    rows: torch.Tensor  # [B, g] target logit row predicting position a+k (= a+k-1), clamped in range
    valid: torch.Tensor  # [B, g] bool: the row exists in the sequence


@dataclass(frozen=True)
class LossWeights:
    ce: float = 0.1
    tv: float = 0.9
    bce: float = 1.0
    decay: float = 7.0  # position weight exp(-(k-1)/decay); the paper uses gamma


@dataclass(frozen=True)
class LossParts:
    total: torch.Tensor  # [] differentiable
    ce: float
    tv: float
    bce: float
    accepted: torch.Tensor  # [B, g] bool: draft argmax == target argmax (greedy acceptance)
    confidence: torch.Tensor  # [B, g] float sigmoid of the confidence logit (detached)
    valid: torch.Tensor  # [B, g] bool


def block_rows(anchors: torch.Tensor, length: int, gamma: int) -> Blocks:
    """anchors [B] in [1, length) -> the teacher-forced block layout for a sequence of `length` tokens."""
    k = torch.arange(gamma, device=anchors.device)
    rows = anchors[:, None] + k  # row a+k-1 for k = 1..g
    valid = rows < length
    rows = rows.clamp(max=length - 1)
    return Blocks(anchors, rows, rows, valid)


def sample_anchors(length: int, first: int, count: int, generator: torch.Generator) -> torch.Tensor:
    """Up to `count` distinct anchor positions in [max(first, 1), length - 1], sorted."""
    lo = max(first, 1)
    span = length - lo
    if span <= 0:
        return torch.empty(0, dtype=torch.long)
    pick = torch.randperm(span, generator=generator)[:count] + lo
    return pick.sort().values


def with_tokens(blocks: Blocks, ids: torch.Tensor) -> Blocks:
    """Fill `prev` with the sequence's tokens at the block rows (ids [T])."""
    return Blocks(blocks.anchors, ids[blocks.rows], blocks.rows, blocks.valid)


def packed_block_hidden(drafter: DSparkDrafter, features: torch.Tensor, ids: torch.Tensor,
                        anchors: torch.Tensor) -> torch.Tensor:
    """All B blocks of one sequence as one packed row over the shared context (no per-block copies of its K/V):
    block b's rows see context rows < a_b and their own block -> hidden [B, gamma, H] (= DSparkDrafter.block_hidden
    with each block given its own context)."""
    t, b, q = features.shape[0], anchors.shape[0], drafter.config.query_len
    ctx = drafter.context_kv(features, torch.arange(t, device=features.device))
    block = torch.arange(b, device=ids.device).repeat_interleave(q)  # [B*q] block of each packed row
    mask = torch.cat([torch.arange(t, device=ids.device)[None] < anchors[block][:, None],
                      block[:, None] == block[None]], dim=1)[None, None]  # [1, 1, B*q, T + B*q]
    x = F.embedding(drafter.block_ids(ids[anchors]), drafter.target.embed).to(drafter.fc.weight.dtype)
    x = x.reshape(1, b * q, -1)
    positions = (anchors[:, None] + torch.arange(q, device=ids.device)).reshape(1, b * q)
    for i, layer in enumerate(drafter.layers):
        x = layer(x, positions, drafter.rotary, PaddedKV(ctx.keys[i][None], ctx.values[i][None], mask=mask))
    x = drafter.norm(x).view(b, q, -1)
    return x if drafter.config.sample_from_anchor else x[:, 1:]


def block_outputs(drafter: DSparkDrafter, features: torch.Tensor, ids: torch.Tensor,
                  blocks: Blocks) -> tuple[torch.Tensor, torch.Tensor | None]:
    """features [T, n*H], ids [T] -> (draft logits [B, g, D] float32, confidence logits [B, g] or None).

    Every anchor sees the context rows before it (one shared K/V computation, masked per anchor) and its block
    bidirectionally, exactly as serving drafts; the Markov head reads the teacher-forced previous tokens."""
    hidden = packed_block_hidden(drafter, features, ids, blocks.anchors)
    b, g = blocks.prev.shape
    flat_h = hidden.reshape(b * g, -1)
    base = drafter.base_logits(flat_h).float().view(b, g, -1)
    state = drafter.markov_head.init_state(b, hidden)
    biases = []
    for k in range(g):  # sequential: the RNN head carries state; stateless heads just loop
        bias, state = drafter.markov_head.step(blocks.prev[:, k], hidden[:, k], state)
        biases.append(bias.float())
    conf = drafter.confidence_logit(flat_h, blocks.prev.reshape(-1))
    return base + torch.stack(biases, dim=1), None if conf is None else conf.view(b, g)


def position_weights(gamma: int, decay: float, device: torch.device | None = None) -> torch.Tensor:
    return torch.exp(-torch.arange(gamma, dtype=torch.float32, device=device) / decay)


@dataclass(frozen=True)
class SparseTarget:
    """The target's next-token distribution kept as its top-k entries (cacheable: small per position)."""

    ids: torch.Tensor  # [..., k] target ids, most probable first
    probs: torch.Tensor  # [..., k] their probabilities (the tail's mass is treated as unreachable)

    def take(self, rows: torch.Tensor) -> "SparseTarget":
        return SparseTarget(self.ids[rows], self.probs[rows])


def sparse_target(logits: torch.Tensor, k: int) -> SparseTarget:
    """logits [T, V] -> the top-k of softmax(logits) per row."""
    probs, ids = torch.softmax(logits.float(), dim=-1).topk(k, dim=-1)
    return SparseTarget(ids, probs)


def draft_index(draft_to_target: torch.Tensor | None, vocab_size: int) -> torch.Tensor:
    """[V] draft id of every target id, -1 outside the draft vocabulary (identity without one)."""
    if draft_to_target is None:
        return torch.arange(vocab_size)
    out = torch.full((vocab_size,), -1, dtype=torch.long, device=draft_to_target.device)
    out[draft_to_target] = torch.arange(draft_to_target.shape[0], device=draft_to_target.device)
    return out


def dspark_loss(logits: torch.Tensor, conf_logit: torch.Tensor | None, target: SparseTarget,
                valid: torch.Tensor, to_draft: torch.Tensor, weights: LossWeights,
                scale: torch.Tensor | None = None) -> LossParts:
    """logits [B, g, D]; conf_logit [B, g] or None; target [B, g, k]; valid [B, g]; to_draft [V] (draft_index)
    -> the weighted loss and its parts. scale [B, g] (optional) multiplies the CE and TV weights only (complementary
    training, sgl_dspark.training.coverage); the confidence head learns every position as it is.

    TV counts target mass the drafter cannot place (outside the draft vocabulary or the kept top-k) fully.
    CE's label is the target's argmax (distillation), ignored where it is outside the draft vocabulary."""
    d_ids = to_draft[target.ids]  # [B, g, k]
    p_t = torch.zeros_like(logits).scatter_add_(-1, d_ids.clamp(min=0), target.probs.float() * (d_ids >= 0))
    label = d_ids[..., 0]
    log_p = torch.log_softmax(logits, dim=-1)
    tv = 0.5 * ((log_p.exp() - p_t).abs().sum(-1) + (1.0 - p_t.sum(-1)).clamp(min=0))
    ce = F.nll_loss(log_p.flatten(0, 1), label.clamp(min=0).flatten(), reduction="none").view_as(tv)
    accepted = (logits.argmax(-1) == label) & (label >= 0)
    w = position_weights(logits.shape[1], weights.decay, logits.device)[None] * valid.float()
    norm = w.sum().clamp(min=1e-6)
    w_fit = w if scale is None else w * scale
    ce_mean = (ce * w_fit * (label >= 0)).sum() / norm
    tv_mean = (tv * w_fit).sum() / norm
    if conf_logit is None:
        bce_mean, conf = torch.zeros((), device=logits.device), torch.ones_like(tv)
    else:
        bce = F.binary_cross_entropy_with_logits(conf_logit.float(), accepted.float(), reduction="none")
        bce_mean, conf = (bce * w).sum() / norm, torch.sigmoid(conf_logit.detach().float())
    total = weights.ce * ce_mean + weights.tv * tv_mean + weights.bce * bce_mean
    return LossParts(total, float(ce_mean), float(tv_mean), float(bce_mean), accepted, conf, valid)


def accepted_length(accepted: torch.Tensor, valid: torch.Tensor) -> torch.Tensor:
    """accepted, valid [N, g] -> tau per row [N] (1 + leading accepted positions), over complete rows only."""
    full = valid.all(-1)
    return 1.0 + torch.cumprod(accepted[full].long(), dim=-1).sum(-1).float()
