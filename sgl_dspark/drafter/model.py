"""The DSpark drafter module: parallel backbone (KV injection) plus the sequential Markov and confidence heads.

Owns the draft parameters (saved in checkpoints) and the two forward halves: target features -> cacheable context
K/V rows, and one block pass (anchor + mask tokens) -> hidden states h_1..h_gamma. The target's embedding and LM head
are borrowed (TargetWeights), never owned or saved. Must not sample, schedule, or import SGLang.
"""

from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import nn

from sgl_dspark.drafter.config import DrafterConfig
from sgl_dspark.drafter.context import ContextKV, PaddedContext, RequestContexts
from sgl_dspark.drafter.heads import ConfidenceHead, MarkovHead, build_markov_head
from sgl_dspark.drafter.layers import BufferedKV, DecoderLayer, PaddedKV, RMSNorm, Rotary


@dataclass(frozen=True)
class TargetWeights:
    """The target's frozen token embedding and LM head (may be the same tensor when tied): [V, H] tensors, or tables
    that look rows up as one does (`table[ids]`, `.shape`, `.dtype`, `.device`: sgl_dspark.packed_gemm.PackedRows)."""

    embed: torch.Tensor  # [V, H]
    lm_head: torch.Tensor  # [V, H]


def check_draft_vocab(target_ids: torch.Tensor, vocab_size: int) -> None:
    """Refuse a draft-to-target map with ids outside [0, vocab_size) or repeated ids."""
    if target_ids.numel() and not 0 <= int(target_ids.min()) <= int(target_ids.max()) < vocab_size:
        raise ValueError(f"d2t maps draft ids outside the target vocabulary [0, {vocab_size})")
    if torch.unique(target_ids).numel() != target_ids.numel():
        raise ValueError("d2t maps two draft ids to the same target id")


class DSparkDrafter(nn.Module):
    def __init__(self, config: DrafterConfig, target: TargetWeights | None = None) -> None:
        super().__init__()
        self.config = config
        h = config.hidden_size
        self.layers = nn.ModuleList(DecoderLayer(config) for _ in range(config.num_hidden_layers))
        self.norm = RMSNorm(h, config.rms_norm_eps)
        self.fc = nn.Linear(config.num_features * h, h, bias=False)
        self.hidden_norm = RMSNorm(h, config.rms_norm_eps)
        self.rotary = Rotary(config)
        self.markov_head: MarkovHead = build_markov_head(config)
        self.confidence_head = ConfidenceHead(config) if config.enable_confidence_head else None
        if config.reduced_vocab:  # EAGLE-3 convention: target id = draft id + d2t[draft id]
            self.register_buffer("d2t", torch.zeros(config.draft_vocab_size, dtype=torch.long))
        self._target: TargetWeights | None = None
        self._lm_rows: torch.Tensor | None = None  # [D, H] LM-head rows of the draft vocabulary
        self._lm_project: Callable[[torch.Tensor], torch.Tensor] | None = None  # hidden [N, H] -> [N, D]
        if target is not None:
            self.attach_target(target)

    # ---- target sharing and the draft vocabulary -------------------------------------------------------------

    def attach_target(self, target: TargetWeights) -> None:
        """Borrow the target's embedding and LM head; call again after loading a new `d2t`."""
        want = (self.config.vocab_size, self.config.hidden_size)
        for name, w in (("embed", target.embed), ("lm_head", target.lm_head)):
            if tuple(w.shape) != want:
                raise ValueError(f"target {name} has shape {tuple(w.shape)}, drafter expects {want}")
        self._target = target
        ids, lm_head = self.draft_to_target, target.lm_head
        if ids is None and not isinstance(lm_head, torch.Tensor):  # a row table: every row, looked up
            ids = torch.arange(lm_head.shape[0])
        rows = lm_head.detach() if ids is None else lm_head[ids.to(lm_head.device)]
        self._lm_rows = rows.to(self.dtype)  # no copy when the dtypes agree; else only the draft vocabulary's rows
        self._lm_project = None

    def set_lm_projection(self, project: Callable[[torch.Tensor], torch.Tensor]) -> None:
        """Compute U = hidden @ lm_rows^T with `project` (e.g. on packed weights); reset by attach_target."""
        self._lm_project = project

    @property
    def lm_rows(self) -> torch.Tensor:
        """[D, H] the LM-head rows of the draft vocabulary."""
        if self._lm_rows is None:
            raise RuntimeError("DSparkDrafter: attach_target() was not called")
        return self._lm_rows

    @property
    def dtype(self) -> torch.dtype:
        return self.norm.weight.dtype

    @property
    def target(self) -> TargetWeights:
        if self._target is None:
            raise RuntimeError("DSparkDrafter: attach_target() was not called")
        return self._target

    @property
    def draft_to_target(self) -> torch.Tensor | None:
        """[D] int64 target id of each draft-vocabulary id, or None for the full vocabulary."""
        if not self.config.reduced_vocab:
            return None
        return torch.arange(self.d2t.shape[0], device=self.d2t.device) + self.d2t

    def set_draft_vocab(self, target_ids: torch.Tensor) -> None:
        """target_ids [D] unique target ids -> store as `d2t` offsets and refresh the restricted LM head."""
        check_draft_vocab(target_ids, self.config.vocab_size)
        self.d2t.copy_(target_ids.long() - torch.arange(target_ids.shape[0]))
        if self._target is not None:
            self.attach_target(self._target)

    # ---- parallel backbone -----------------------------------------------------------------------------------

    def context_kv(self, features: torch.Tensor, positions: torch.Tensor) -> ContextKV:
        """features [T, n_target_layers * H] (target layer outputs, in target_layer_ids order), positions [T]
        -> per-draft-layer context K/V rows. Rows of different tokens are independent (cache them freely)."""
        ctx = self.hidden_norm(self.fc(features.to(self.dtype)))  # [T, H]
        pairs = [layer.self_attn.keys_values(ctx, positions, self.rotary) for layer in self.layers]
        return ContextKV(torch.stack([k for k, _ in pairs]), torch.stack([v for _, v in pairs]))

    def block_ids(self, anchors: torch.Tensor) -> torch.Tensor:
        """anchors [B] -> block input ids [B, query_len]: the anchor, then mask tokens."""
        ids = anchors.new_full((anchors.shape[0], self.config.query_len), self.config.mask_token_id)
        ids[:, 0] = anchors
        return ids

    def block_hidden(self, context: PaddedContext | RequestContexts, anchors: torch.Tensor,
                     anchor_positions: torch.Tensor) -> torch.Tensor:
        """One parallel pass. context: per-request K/V (padded, or each request's own buffer); anchors [B];
        anchor_positions [B] (the anchor's own position, one past the last context token) -> final-normed hidden
        h_1..h_gamma [B, gamma, H]."""
        ids = self.block_ids(anchors.long())
        x = self.target.embed[ids].to(self.dtype)  # [B, q, H]
        positions = anchor_positions.long()[:, None] + torch.arange(ids.shape[1], device=ids.device)
        if isinstance(context, PaddedContext):
            valid = context.valid()
            kvs = [PaddedKV(context.keys[i], context.values[i], valid) for i in range(len(self.layers))]
        else:
            kvs = [BufferedKV(context.buffers, i) for i in range(len(self.layers))]
        for layer, kv in zip(self.layers, kvs):
            x = layer(x, positions, self.rotary, kv)
        x = self.norm(x)
        return x if self.config.sample_from_anchor else x[:, 1:]

    # ---- per-step projections --------------------------------------------------------------------------------

    def base_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """hidden [N, H] -> U [N, D] over the draft vocabulary (the full vocabulary unless reduced)."""
        rows = self.lm_rows
        if self._lm_project is not None:
            return self._lm_project(hidden.to(rows.dtype))
        return hidden.to(rows.dtype) @ rows.T

    def confidence_logit(self, hidden: torch.Tensor, prev_tokens: torch.Tensor) -> torch.Tensor | None:
        """hidden [N, H], prev_tokens [N] (x_{k-1}) -> raw confidence logit [N], or None without a head."""
        if self.confidence_head is None:
            return None
        return self.confidence_head(hidden, self.markov_head.prev_embed(prev_tokens))
