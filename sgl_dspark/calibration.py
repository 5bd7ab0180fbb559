"""Confidence calibration: Sequential Temperature Scaling (STS) of the confidence head.

Owns the per-position temperatures, how they are applied, fitted and stored.
Pure torch; must not import SGLang.
"""

import torch


def calibrate_confidence(conf: torch.Tensor, temperatures: torch.Tensor) -> torch.Tensor:
    """conf [..., k] raw confidences of draft positions 1..k; temperatures [>= k] -> calibrated [..., k].

    c' = sigmoid(logit(c) / T_j) at position j; T = 1 leaves c unchanged.
    """
    k = conf.shape[-1]
    logit = torch.logit(conf.float().clamp(1e-6, 1 - 1e-6))
    return torch.sigmoid(logit / temperatures[:k].to(logit))
