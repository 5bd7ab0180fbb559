"""Helpers shared by the stand-in ops: flat in-place views and ragged segments."""

from __future__ import annotations

import torch


def flat(t: torch.Tensor, name: str) -> torch.Tensor:
    """1-D view of ``t`` that aliases its storage (writes land in ``t``).

    The compiled kernels address their tensors as raw row-major buffers, so
    they require contiguous inputs; so does this stand-in.
    """
    if not t.is_contiguous():
        raise ValueError(f"sgl_kernel CPU stand-in: {name} must be contiguous")
    return t.view(-1)


def ragged(
    start: torch.Tensor, end: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Enumerate the ragged ranges ``[start[i], end[i])`` back to back.

    Returns ``(seg, col, out)``, one entry per element of the concatenation:
    ``seg`` the range it belongs to, ``col`` its value in ``[start, end)`` and
    ``out`` its offset in the packed output, where range ``i`` starts at
    ``sum_{j<i} (end[j] - start[j])`` (the exclusive prefix sum the Triton
    kernels compute, so an empty or negative range occupies no slots).
    """
    start = start.reshape(-1).to(torch.int64)
    end = end.reshape(-1).to(torch.int64)
    lens = end - start
    counts = lens.clamp_min(0)
    out_base = torch.cumsum(lens, 0) - lens
    seg = torch.repeat_interleave(torch.arange(lens.numel(), device=lens.device), counts)
    within = torch.arange(seg.numel(), device=lens.device) - (
        torch.cumsum(counts, 0) - counts
    )[seg]
    return seg, start[seg] + within, out_base[seg] + within
