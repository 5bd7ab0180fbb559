"""Draft-token choice for one sequential step: sample each row from its request's distribution, pick tree alternatives.

Pure functions of logits and SamplingParams (the draft distribution q is `sampling.target_probs` of the step
logits, so draft and target apply the same temperature / top-k / top-p). Must not know about models or trees.
"""

from dataclasses import dataclass

import torch

from sgl_dspark.sampling import SamplingParams, target_probs


@dataclass(frozen=True)
class SampledRows:
    tokens: torch.Tensor  # [F] int64, ids in the logits' vocabulary
    probs: torch.Tensor  # [F, D] float32, the distribution each token was drawn from (one-hot when greedy)


def sample_rows(logits: torch.Tensor, params: list[SamplingParams],
                generator: torch.Generator | None = None) -> SampledRows:
    """logits [F, D], one SamplingParams per row -> tokens and their q. Rows sharing params are sampled together,
    groups in order of first appearance, so a seeded generator gives the same draws every time."""
    tokens = torch.empty(logits.shape[0], dtype=torch.long, device=logits.device)
    probs = torch.empty(logits.shape, dtype=torch.float32, device=logits.device)
    for p, rows in _groups(params).items():
        index = torch.tensor(rows, device=logits.device)
        q = target_probs(logits[index], p)
        probs[index] = q
        tokens[index] = q.argmax(-1) if p.is_greedy else torch.multinomial(q, 1, generator=generator)[:, 0]
    return SampledRows(tokens, probs)


def _groups(params: list[SamplingParams]) -> dict[SamplingParams, list[int]]:
    out: dict[SamplingParams, list[int]] = {}
    for i, p in enumerate(params):
        out.setdefault(p, []).append(i)
    return out


def alternatives(logits: torch.Tensor, taken: int, count: int,
                 params: SamplingParams) -> tuple[torch.Tensor, torch.Tensor]:
    """The `count` most likely ids other than `taken` under one row's logits [D], and each one's share of the mass
    left once `taken` is excluded (softmax at the request temperature; 1 when greedy).

    Example: logits log([.5, .3, .2]), taken 0, count 2 -> ids [1, 2], shares [.6, .4].
    """
    temperature = 1.0 if params.is_greedy else params.temperature
    rest = logits.float().clone()
    rest[taken] = float("-inf")  # a softmax over the others: no 1 - p[taken], which rounds to 0 when p[taken] ~ 1
    p = torch.softmax(rest / temperature, dim=-1)
    top = torch.topk(logits, min(count + 1, logits.shape[-1])).indices
    ids = top[top != taken][:count]
    return ids, p[ids]
