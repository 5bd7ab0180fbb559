"""Seeded sampling (`sampling_seed`): the token SGLang's deterministic sampler draws at a row, without SGLang.

SGLang 0.5.23 with --enable-deterministic-inference samples a row by Gumbel-max: argmax over columns of
log p + g, with g = -log(-log(u)) and u = murmur3_32(seed, position, column) / (2^32 - 1) (sglang/srt/layers/
sampler.py `multinomial_with_seed`, sglang/kernels/ops/sampling/murmur_hash.py); columns are token ids when the
request has no top-k/top-p, else ranks of the descending sort. This module computes the same in pure torch
(SGLang's CPU path needs a compiled `murmur_hash32_cpu` op this CPU build lacks). The choice never looks at the
drafts, so DSPARK matches drafts against it exactly like greedy decoding: one seed gives one output, whatever
was drafted or verified, and it is a sample of the target distribution.
"""

import torch

from sgl_dspark.sampling import SamplingParams

MASK32 = 0xFFFFFFFF


def _rotl32(x: torch.Tensor, r: int) -> torch.Tensor:
    return ((x << r) | (x >> (32 - r))) & MASK32


def _mix(h: torch.Tensor, k: torch.Tensor) -> torch.Tensor:
    k = (k * 0xCC9E2D51) & MASK32
    k = (_rotl32(k, 15) * 0x1B873593) & MASK32
    h = _rotl32(h ^ k, 13)
    return (h * 5 + 0xE6546B64) & MASK32


def _fmix(h: torch.Tensor) -> torch.Tensor:
    h = h ^ (h >> 16)
    h = (h * 0x85EBCA6B) & MASK32
    h = h ^ (h >> 13)
    h = (h * 0xC2B2AE35) & MASK32
    return h ^ (h >> 16)


def murmur3(seed: torch.Tensor, positions: torch.Tensor, columns: torch.Tensor) -> torch.Tensor:
    """seed [n], positions [n], columns [m] -> [n, m] int64 in [0, 2^32): MurmurHash3 x86_32 (hash seed 0) of the
    16 bytes (seed low, seed high, position, column), each a little-endian uint32, as SGLang's kernel hashes."""
    seed = seed.long()
    lo, hi = (seed & MASK32)[:, None], ((seed >> 32) & MASK32)[:, None]
    h = _mix(_mix(torch.zeros_like(lo), lo), hi)
    h = _mix(h, (positions.long() & MASK32)[:, None])
    h = _mix(h.expand(-1, columns.shape[0]), (columns.long() & MASK32)[None, :])
    return _fmix(h ^ 16)


def gumbel_argmax(logprobs: torch.Tensor, seed: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
    """logprobs [n, m] -> [n] column of argmax(logprobs + Gumbel noise of (seed, position, column)), float64."""
    u = murmur3(seed, positions, torch.arange(logprobs.shape[1], device=logprobs.device)).double() / MASK32
    g = -(-(u.log().clamp(min=torch.finfo(torch.float64).min, max=-(2.0 ** -32)))).log()
    return (g + logprobs.double()).argmax(dim=1)


def seeded_choices(logits: torch.Tensor, params: SamplingParams, seed: int, positions: torch.Tensor,
                   sorted_columns: bool | None = None) -> torch.Tensor:
    """logits [n, V] of one request's rows at positions [n] -> [n] the token SGLang's seeded sampler draws at each
    (temperature, then top-k/top-p on the descending sort, in its column layout). min_p is refused with a seed
    (SGLang's seeded sampler has no min-p path either)."""
    probs = torch.softmax(logits.float() / torch.tensor(params.temperature, dtype=torch.float32), dim=-1)
    return seeded_from_probs(probs, params, seed, positions, sorted_columns)


def seeded_from_probs(probs: torch.Tensor, params: SamplingParams, seed: int, positions: torch.Tensor,
                      sorted_columns: bool | None = None) -> torch.Tensor:
    """As seeded_choices, from the temperature-scaled probabilities [n, V] (what SGLang's sampler leaves in a
    prefill's logits tensor, in place). sorted_columns: the batch takes SGLang's sorting path (some request in it
    has top-k/top-p/min-p or is greedy: SamplerBatch.filtered), so columns are ranks; None: this request alone."""
    n, vocab = probs.shape
    probs = probs.float()
    seeds = torch.full((n,), seed, dtype=torch.long, device=probs.device)
    positions = positions.to(probs.device)
    if sorted_columns is None:
        sorted_columns = not ((params.top_k <= 0 or params.top_k >= vocab) and params.top_p >= 1.0)
    if not sorted_columns:
        return gumbel_argmax(probs.log(), seeds, positions)
    sorted_p, index = probs.sort(dim=-1, descending=True)
    before = torch.cumsum(sorted_p, dim=-1) - sorted_p
    sorted_p.masked_fill_((torch.arange(vocab, device=probs.device) >= params.top_k).expand(n, -1)
                          & (params.top_k > 0), 0.0)
    sorted_p.masked_fill_(before > params.top_p, 0.0)
    return index.gather(1, gumbel_argmax(sorted_p.double().log(), seeds, positions)[:, None]).view(-1)
