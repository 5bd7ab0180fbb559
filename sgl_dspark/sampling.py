"""Target sampling distribution: turns logits into the exact probabilities SGLang's sampler draws from.

Owns the per-request sampling knobs (temperature, top-k, top-p, min-p), the batch-wide choices SGLang's sampler
makes once per batch (SamplerBatch), and their application with the torch ops SGLang 0.5.23's pytorch sampling
path runs (`Sampler.forward`, `top_k_top_p_min_p_sampling_from_probs_torch`): a float32 division by the row's
temperature, softmax, then a descending `sort` (or `topk` of the batch's largest top-k when every request has
one), the top-k / top-p / min-p masks, renormalised. Tied logits are therefore ordered as SGLang's unstable sort
orders them, and a greedy request in a batch with a sampled one takes the first index of that order, as plain
decoding of the same batch does (SGLang argmaxes only when the whole batch is greedy). Pure torch; must not import
SGLang.
"""

from collections.abc import Sequence
from dataclasses import dataclass

import torch

GREEDY_TEMPERATURE = 1e-6  # SGLang (sampling_params._SAMPLING_EPS) turns temperature below this into top_k=1
TOP_K_ALL = 1 << 30  # SGLang's top_k of a request without top-k (sampling_params.TOP_K_ALL)


@dataclass(frozen=True)
class SamplingParams:
    temperature: float = 1.0
    top_k: int = -1  # -1 (or TOP_K_ALL): whole vocabulary
    top_p: float = 1.0
    min_p: float = 0.0

    @property
    def is_greedy(self) -> bool:
        return self.temperature < GREEDY_TEMPERATURE or self.top_k == 1

    @property
    def filters(self) -> bool:
        """Top-k, top-p or min-p is set (SGLang's need_*_sampling for this request)."""
        return 0 < self.top_k < TOP_K_ALL or self.top_p < 1.0 or self.min_p > 0.0


@dataclass(frozen=True)
class SamplerBatch:
    """What SGLang's sampler decides once for a whole batch (its SamplingBatchInfo), which decides how ties break."""

    all_greedy: bool  # every request greedy: argmax of the logits, first index among ties
    filtered: bool  # some request has top-k/top-p/min-p (or is greedy in a sampled batch): every row sorts
    max_top_k: int | None  # every request has a top-k: the rows take topk(max_top_k) instead of a full sort

    @classmethod
    def of(cls, params: Sequence[SamplingParams]) -> "SamplerBatch":
        """The batch SGLang builds from these requests (SamplingBatchInfo.from_schedule_batch)."""
        ks = [_sglang_top_k(p) for p in params]
        greedy = all(p.is_greedy for p in params)
        return cls(greedy, any(p.filters or p.is_greedy for p in params),
                   max(ks) if ks and all(1 <= k < TOP_K_ALL for k in ks) else None)


def target_probs(logits: torch.Tensor, params: SamplingParams, batch: SamplerBatch | None = None) -> torch.Tensor:
    """logits [n, V] -> probabilities [n, V] (float32) that SGLang's sampler draws from with `params` in `batch`
    (None: a batch of this request alone). Greedy is a one-hot: of the argmax in an all-greedy batch, else of the
    first index of SGLang's sort."""
    logits = logits.float()
    batch = SamplerBatch.of([params]) if batch is None else batch
    if params.is_greedy and batch.all_greedy:
        return torch.nn.functional.one_hot(logits.argmax(-1), logits.shape[-1]).float()
    if params.is_greedy:  # SGLang serves it as temperature 1, top_k 1
        params = SamplingParams(temperature=1.0, top_k=1)
    probs = torch.softmax(logits / _f32(params.temperature), dim=-1)
    return filter_probs(probs, params, batch) if batch.filtered else probs


def filter_probs(probs: torch.Tensor, params: SamplingParams, batch: SamplerBatch | None = None) -> torch.Tensor:
    """Apply top-k, top-p and min-p to probs [n, V] as SGLang's torch sampler does, in `batch` (None: this request
    alone); renormalise. The order of tied probabilities is the order of SGLang's sort (or topk) of the same row."""
    batch = SamplerBatch.of([params]) if batch is None else batch
    vocab = probs.shape[-1]
    if batch.max_top_k is not None and batch.max_top_k < vocab:
        sorted_p, idx = torch.topk(probs, k=batch.max_top_k, dim=-1, sorted=True)
    else:
        sorted_p, idx = probs.sort(dim=-1, descending=True)
    before = torch.cumsum(sorted_p, dim=-1) - sorted_p  # mass strictly before each rank
    ranks = torch.arange(sorted_p.shape[-1], device=probs.device)
    sorted_p = sorted_p.masked_fill(ranks >= _sglang_top_k(params), 0.0)
    sorted_p = sorted_p.masked_fill(before > _f32(params.top_p), 0.0)  # SGLang's knobs are float32 tensors
    if params.min_p > 0.0:
        sorted_p = sorted_p.masked_fill(sorted_p < sorted_p[..., :1] * _f32(params.min_p), 0.0)
    filtered = torch.zeros_like(probs).scatter(-1, idx, sorted_p)
    return filtered / filtered.sum(dim=-1, keepdim=True)


def greedy_choices(logits: torch.Tensor, batch: SamplerBatch | None = None) -> torch.Tensor:
    """logits [n, V] -> [n] the token a greedy request gets after each row in `batch` (None: all greedy)."""
    if batch is None or batch.all_greedy:
        return logits.argmax(-1)
    return target_probs(logits, SamplingParams(temperature=1.0, top_k=1), batch).argmax(-1)


def _f32(value: float) -> torch.Tensor:
    return torch.tensor(value, dtype=torch.float32)


def _sglang_top_k(params: SamplingParams) -> int:
    """SGLang's top_k of a request: 1 when greedy, TOP_K_ALL when unset."""
    if params.is_greedy:
        return 1
    return TOP_K_ALL if params.top_k <= 0 else params.top_k
