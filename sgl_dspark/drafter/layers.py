"""Draft transformer layers (Qwen3-style): RMSNorm, RoPE, attention with injected context K/V, SwiGLU MLP.

Owns the per-layer math of the parallel backbone, including how a layer turns projected target features into its
context keys/values (its own k_proj/v_proj, k_norm, RoPE at the context positions; values un-normed) and how block rows
attend over them: a padded batch (`PaddedKV`), or each request's own buffer in place (`BufferedKV`).
Must not know about checkpoints, sampling or the sequential heads.
"""

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Protocol

import torch
import torch.nn.functional as F
from torch import nn

from sgl_dspark.drafter.config import DrafterConfig
from sgl_dspark.drafter.context import ContextBuffer


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x32 = x.float()
        x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * x32.to(self.weight.dtype)


class Rotary(nn.Module):
    """Neox-style (rotate-half) RoPE over the first `rotary_dim` channels of each head."""

    def __init__(self, config: DrafterConfig) -> None:
        super().__init__()
        dim = config.rotary_dim
        inv_freq = 1.0 / (config.rope_theta ** (torch.arange(0, dim, 2, dtype=torch.float64) / dim))
        self.register_buffer("inv_freq", (inv_freq / config.rope_linear_factor).float(), persistent=False)

    def forward(self, x: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """x [..., T, heads, head_dim], positions [..., T] -> x rotated at those positions."""
        freqs = positions.float().unsqueeze(-1) * self.inv_freq  # [..., T, dim/2]
        emb = torch.cat([freqs, freqs], dim=-1).unsqueeze(-2)  # [..., T, 1, dim]
        dim = emb.shape[-1]
        rot, rest = x[..., :dim].float(), x[..., dim:]
        half = dim // 2
        rotated = torch.cat([-rot[..., half:], rot[..., :half]], dim=-1)
        out = rot * emb.cos() + rotated * emb.sin()
        return torch.cat([out.to(x.dtype), rest], dim=-1)


class LayerContext(Protocol):
    def attend(self, queries: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, gqa: bool) -> torch.Tensor:
        """queries [B, q, heads, d], the block's own keys/values [B, q, kv_heads, d] -> [B, q, heads, d]."""


class DraftAttention(nn.Module):
    def __init__(self, config: DrafterConfig) -> None:
        super().__init__()
        h, d, bias = config.hidden_size, config.head_dim, config.attention_bias
        self.num_heads, self.num_kv_heads, self.head_dim = config.num_attention_heads, config.num_key_value_heads, d
        self.q_proj = nn.Linear(h, self.num_heads * d, bias=bias)
        self.k_proj = nn.Linear(h, self.num_kv_heads * d, bias=bias)
        self.v_proj = nn.Linear(h, self.num_kv_heads * d, bias=bias)
        self.o_proj = nn.Linear(self.num_heads * d, h, bias=bias)
        self.q_norm = RMSNorm(d, config.rms_norm_eps)
        self.k_norm = RMSNorm(d, config.rms_norm_eps)

    def keys_values(self, x: torch.Tensor, positions: torch.Tensor,
                    rotary: Rotary) -> tuple[torch.Tensor, torch.Tensor]:
        """x [..., T, H], positions [..., T] -> keys, values [..., T, kv_heads, head_dim] (keys normed + rotated)."""
        shape = (*x.shape[:-1], self.num_kv_heads, self.head_dim)
        keys = rotary(self.k_norm(self.k_proj(x).view(shape)), positions)
        return keys, self.v_proj(x).view(shape)

    def forward(self, x: torch.Tensor, positions: torch.Tensor, rotary: Rotary, context: LayerContext) -> torch.Tensor:
        """Block rows attend to the request's context rows and to every block row (bidirectional).

        x [B, q, H], positions [B, q], context: this layer's context K/V (`PaddedKV` or `BufferedKV`) -> [B, q, H].
        """
        b, q, _ = x.shape
        queries = rotary(self.q_norm(self.q_proj(x).view(b, q, self.num_heads, self.head_dim)), positions)
        keys, values = self.keys_values(x, positions, rotary)
        out = context.attend(queries, keys, values, self.num_heads != self.num_kv_heads)  # [B, q, heads, d]
        return self.o_proj(out.reshape(b, q, self.num_heads * self.head_dim))


@dataclass(frozen=True)
class PaddedKV:
    """One layer's context rows as a padded batch [B, S, kv_heads, d]: block rows see the valid ones (`valid` [B, S]
    bool) and every block row, or, when `mask` [B, 1, q, S + q] bool is given, what it allows (training packs many
    blocks into one row)."""

    keys: torch.Tensor
    values: torch.Tensor
    valid: torch.Tensor | None = None
    mask: torch.Tensor | None = None

    def attend(self, queries: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, gqa: bool) -> torch.Tensor:
        b, q = queries.shape[:2]
        keys = torch.cat([self.keys.to(keys.dtype), keys], dim=1).transpose(1, 2)  # [B, kv_heads, S+q, d]
        values = torch.cat([self.values.to(values.dtype), values], dim=1).transpose(1, 2)
        mask = self.mask
        if mask is None:
            valid = torch.cat([self.valid, self.valid.new_ones(b, q)], dim=1)  # [B, S+q]
            mask = valid[:, None, None, :].expand(b, 1, q, valid.shape[1])
        out = F.scaled_dot_product_attention(queries.transpose(1, 2), keys, values, attn_mask=mask, enable_gqa=gqa)
        return out.transpose(1, 2)


@dataclass(frozen=True)
class BufferedKV:
    """One layer's context as each request's own buffer (`ContextBuffer`): the block's keys/values go into the free
    rows after the request's context and attention reads the buffer's first length + q rows where they are (no
    padded copy of the context)."""

    buffers: Sequence[ContextBuffer]
    layer: int

    def attend(self, queries: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, gqa: bool) -> torch.Tensor:
        out = []
        for i, buffer in enumerate(self.buffers):
            k, v = buffer.with_block(self.layer, keys[i], values[i])  # [n + q, kv_heads, d] views
            one = F.scaled_dot_product_attention(queries[i].transpose(0, 1)[None], k.transpose(0, 1)[None],
                                                 v.transpose(0, 1)[None], enable_gqa=gqa)  # [1, heads, q, d]
            out.append(one[0].transpose(0, 1))
        return torch.stack(out)


class MLP(nn.Module):
    def __init__(self, config: DrafterConfig) -> None:
        super().__init__()
        h, i = config.hidden_size, config.intermediate_size
        self.gate_proj = nn.Linear(h, i, bias=False)
        self.up_proj = nn.Linear(h, i, bias=False)
        self.down_proj = nn.Linear(i, h, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class DecoderLayer(nn.Module):
    """Pre-norm block; the context enters only as extra keys/values of the attention."""

    def __init__(self, config: DrafterConfig) -> None:
        super().__init__()
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.self_attn = DraftAttention(config)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.mlp = MLP(config)

    def forward(self, x: torch.Tensor, positions: torch.Tensor, rotary: Rotary, context: LayerContext) -> torch.Tensor:
        x = x + self.self_attn(self.input_layernorm(x), positions, rotary, context)
        return x + self.mlp(self.post_attention_layernorm(x))
