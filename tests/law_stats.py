"""The chi-square test the exact-law tests share (tests/unit on the CPU, tests/gpu on CUDA)."""

import torch
from scipy.stats import chisquare


def chi_square_pvalue(samples: torch.Tensor, probs: torch.Tensor) -> float:
    """samples [trials] of cell ids, probs [cells]. 0 if a zero-probability cell is hit; small cells pooled."""
    counts = torch.bincount(samples, minlength=probs.shape[0]).double()
    expected = probs.double() * samples.shape[0]
    if counts[expected == 0].sum() > 0:
        return 0.0
    small = (expected > 0) & (expected < 5)
    big = expected >= 5
    obs = torch.cat([counts[big], counts[small].sum().reshape(1)])
    exp = torch.cat([expected[big], expected[small].sum().reshape(1)])
    keep = exp > 0
    exp = exp[keep] * obs[keep].sum() / exp[keep].sum()  # cancel float rounding in the totals
    return float(chisquare(obs[keep].numpy(), exp.numpy()).pvalue)
