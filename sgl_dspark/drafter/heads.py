"""Sequential heads: the Markov transition bias (vanilla / gated / RNN) and the confidence head.

Owns one sequential step's bias B(x_{k-1}, .) over the draft vocabulary and c_k's logit w.[h_k ; W1[x_{k-1}]] + b.
Weight names follow the DeepSpec checkpoints (`markov_w1`, `markov_w2`, `gate_proj`, `joint_proj`, `proj`).
Must not sample, stop, or know about blocks and trees.
"""

import torch
from torch import nn

from sgl_dspark.drafter.config import DrafterConfig


class MarkovHead(nn.Module):
    """Vanilla low-rank Markov head: bias = W2(W1[x_{k-1}]); W1 is a [V, r] lookup, W2 an [r -> D] projection."""

    def __init__(self, config: DrafterConfig) -> None:
        super().__init__()
        self.rank = config.markov_rank
        self.markov_w1 = nn.Embedding(config.vocab_size, config.markov_rank)
        self.markov_w2 = nn.Linear(config.markov_rank, config.lm_vocab_size, bias=False)

    def prev_embed(self, prev_tokens: torch.Tensor) -> torch.Tensor:
        """prev_tokens [F] (target ids) -> W1 rows [F, r]."""
        return self.markov_w1(prev_tokens.long())

    def init_state(self, rows: int, like: torch.Tensor) -> torch.Tensor | None:
        """The recurrent state at the first sequential step ([rows, r]), or None for stateless heads."""
        return None

    def step(self, prev_tokens: torch.Tensor, hidden: torch.Tensor,
             state: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor | None]:
        """prev_tokens [F], hidden [F, H], state [F, r] or None -> (bias [F, D], next state)."""
        return self.markov_w2(self.prev_embed(prev_tokens)), state


class GatedMarkovHead(MarkovHead):
    """bias = W2(sigmoid(gate_proj([h_k ; W1[x_{k-1}]])) * W1[x_{k-1}])."""

    def __init__(self, config: DrafterConfig) -> None:
        super().__init__(config)
        self.gate_proj = nn.Linear(config.hidden_size + config.markov_rank, config.markov_rank)

    def step(self, prev_tokens: torch.Tensor, hidden: torch.Tensor,
             state: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor | None]:
        emb = self.prev_embed(prev_tokens)
        gate = torch.sigmoid(self.gate_proj(torch.cat([hidden.to(emb.dtype), emb], dim=-1)))
        return self.markov_w2(gate * emb), state


class RNNHead(MarkovHead):
    """(g, c, o) = joint_proj([s_{k-1} ; W1[x_{k-1}] ; h_k]); s_k = g*s_{k-1} + (1-g)*tanh(c); bias = W2(tanh(o))."""

    def __init__(self, config: DrafterConfig) -> None:
        super().__init__(config)
        self.joint_proj = nn.Linear(2 * config.markov_rank + config.hidden_size, 3 * config.markov_rank)

    def init_state(self, rows: int, like: torch.Tensor) -> torch.Tensor | None:
        return like.new_zeros(rows, self.rank)

    def step(self, prev_tokens: torch.Tensor, hidden: torch.Tensor,
             state: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor | None]:
        emb = self.prev_embed(prev_tokens)
        z = torch.cat([state.to(emb.dtype), emb, hidden.to(emb.dtype)], dim=-1)
        gate_raw, cand_raw, out_raw = self.joint_proj(z).chunk(3, dim=-1)
        gate = torch.sigmoid(gate_raw)
        new_state = gate * state + (1.0 - gate) * torch.tanh(cand_raw)
        return self.markov_w2(torch.tanh(out_raw)), new_state


MARKOV_HEADS: dict[str, type[MarkovHead]] = {"vanilla": MarkovHead, "gated": GatedMarkovHead, "rnn": RNNHead}


def build_markov_head(config: DrafterConfig) -> MarkovHead:
    return MARKOV_HEADS[config.markov_head_type](config)


class ConfidenceHead(nn.Module):
    """Logit of c_k from [h_k ; W1[x_{k-1}]] (or h_k alone when `with_markov` is off)."""

    def __init__(self, config: DrafterConfig) -> None:
        super().__init__()
        self.with_markov = config.confidence_head_with_markov
        extra = config.markov_rank if self.with_markov else 0
        self.proj = nn.Linear(config.hidden_size + extra, 1)

    def forward(self, hidden: torch.Tensor, prev_embed: torch.Tensor) -> torch.Tensor:
        """hidden [F, H], prev_embed [F, r] -> raw logit [F] (float32)."""
        feats = torch.cat([hidden, prev_embed.to(hidden.dtype)], dim=-1) if self.with_markov else hidden
        return self.proj(feats.to(self.proj.weight.dtype)).squeeze(-1).float()
