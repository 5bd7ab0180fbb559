"""Target sampling distribution: turns logits into the exact probabilities SGLang's sampler draws from.

Owns the per-request sampling knobs (temperature, top-k, top-p, min-p) and their application, mirroring
SGLang's pytorch sampling path (temperature -> softmax -> top-k -> top-p -> min-p, renormalised).
Pure torch; must not import SGLang.
"""

from dataclasses import dataclass

import torch

GREEDY_TEMPERATURE = 1e-6  # SGLang (sampling_params._SAMPLING_EPS) turns temperature below this into top_k=1


@dataclass(frozen=True)
class SamplingParams:
    temperature: float = 1.0
    top_k: int = -1  # -1: whole vocabulary
    top_p: float = 1.0
    min_p: float = 0.0

    @property
    def is_greedy(self) -> bool:
        return self.temperature < GREEDY_TEMPERATURE or self.top_k == 1


def target_probs(logits: torch.Tensor, params: SamplingParams) -> torch.Tensor:
    """logits [..., V] -> probabilities [..., V] (float32) that sampling with `params` draws from.

    Greedy is the one-hot of the argmax. Ties in top-k/top-p are broken by a stable descending sort,
    as SGLang's sort does on CPU.
    """
    logits = logits.float()
    if params.is_greedy:
        return torch.nn.functional.one_hot(logits.argmax(-1), logits.shape[-1]).float()
    probs = torch.softmax(logits / params.temperature, dim=-1)
    return filter_probs(probs, params)


def filter_probs(probs: torch.Tensor, params: SamplingParams) -> torch.Tensor:
    """Apply top-k, top-p and min-p to probs [..., V]; renormalise. Identity when all are off."""
    if params.top_k <= 0 and params.top_p >= 1.0 and params.min_p <= 0.0:
        return probs
    sorted_p, idx = probs.sort(dim=-1, descending=True, stable=True)
    ranks = torch.arange(sorted_p.shape[-1], device=probs.device)
    if params.top_k > 0:
        sorted_p = sorted_p.masked_fill(ranks >= params.top_k, 0.0)
    if params.top_p < 1.0:
        before = torch.cumsum(sorted_p, dim=-1) - sorted_p  # mass strictly before each rank
        sorted_p = sorted_p.masked_fill(before > params.top_p, 0.0)
    if params.min_p > 0.0:
        sorted_p = sorted_p.masked_fill(sorted_p < sorted_p[..., :1] * params.min_p, 0.0)
    filtered = torch.zeros_like(probs).scatter(-1, idx, sorted_p)
    return filtered / filtered.sum(dim=-1, keepdim=True)
