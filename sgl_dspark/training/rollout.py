"""Held-out rollouts of a drafter against the frozen target: teacher-forced blocks at many anchors.

Owns training examples (records clipped to a length), the per-example target cache (features + sparse target
distribution) and the rollout summary (tau per source, per-position conditional acceptance). Shared by training
(progress curve) and calibration (the confidences and outcomes STS fits on). Must not update weights.
"""

from dataclasses import dataclass

import torch

from sgl_dspark.training.data import Record
from sgl_dspark.drafter.model import DSparkDrafter
from sgl_dspark.training.coverage import lookup_depths
from sgl_dspark.training.objective import (LossWeights, SparseTarget, accepted_length, block_outputs, block_rows,
                                           dspark_loss, sparse_target, with_tokens)
from sgl_dspark.training.target import FrozenTarget

TOP_K = 32  # target distribution entries kept per position (cached with the features)


@dataclass(frozen=True)
class Example:
    ids: torch.Tensor  # [T] int64
    first_anchor: int  # anchors at positions >= this (the answer start for target-answered records)
    source: str


MAX_LEN = 512  # tokens of a record kept for training and calibration (the last ones)


def clip_record(r: Record, max_len: int) -> Example:
    """Keep the last `max_len` tokens (prompt head dropped first); the answer start moves with it."""
    cut = max(0, len(r.ids) - max_len)
    return Example(torch.tensor(r.ids[cut:], dtype=torch.long), max(1, r.loss_from - cut), r.source)


class TargetCache:
    """Features and sparse target distributions per example, computed once when caching is on."""

    def __init__(self, target: FrozenTarget, layer_ids: tuple[int, ...], keep: bool, top_k: int = TOP_K) -> None:
        self.target, self.layer_ids, self.keep, self.top_k = target, layer_ids, keep, top_k
        self.store: dict[int, tuple[torch.Tensor, SparseTarget]] = {}

    def get(self, index: int, ex: Example) -> tuple[torch.Tensor, SparseTarget]:
        if index in self.store:
            return self.store[index]
        run = self.target.run(ex.ids.tolist(), self.layer_ids)
        item = (run.features, sparse_target(run.logits, self.top_k))
        if self.keep:
            self.store[index] = item
        return item


def rollouts(drafter: DSparkDrafter, cache: TargetCache, examples: list[Example], to_draft: torch.Tensor,
             stride: int = 4) -> dict[str, torch.Tensor]:
    """Teacher-forced blocks at every `stride`-th anchor of each example -> accepted/conf/valid [N, g], lookup [N]
    (how many of the block's tokens the lookup branch proposes right in a row, sgl_dspark.training.coverage),
    source [N]."""
    parts: dict[str, list] = {"accepted": [], "confidence": [], "valid": [], "lookup": [], "source": []}
    g = drafter.config.gamma
    with torch.no_grad():
        for i, ex in enumerate(examples):
            features, target = cache.get(-1 - i, ex)
            ids = ex.ids.to(features.device)
            anchors = torch.arange(max(ex.first_anchor, 1), ids.shape[0], stride, device=ids.device)
            if anchors.numel() == 0:
                continue
            blocks = with_tokens(block_rows(anchors, ids.shape[0], g), ids)
            logits, conf = block_outputs(drafter, features, ids, blocks)
            res = dspark_loss(logits, conf, target.take(blocks.rows), blocks.valid, to_draft, LossWeights())
            parts["accepted"].append(res.accepted)
            parts["confidence"].append(res.confidence)
            parts["valid"].append(res.valid)
            parts["lookup"].append(lookup_depths(ex.ids.tolist(), g)[anchors.cpu()])
            parts["source"] += [ex.source] * anchors.numel()
    out = {k: torch.cat(v).cpu() for k, v in parts.items() if k != "source"}
    out["source"] = parts["source"]
    return out


def hybrid_length(accepted: torch.Tensor, valid: torch.Tensor, lookup: torch.Tensor) -> torch.Tensor:
    """tau per complete row [N] when the lookup's chain is verified beside the drafter's: 1 + the longer of the two
    leading runs (a chain tree of either; the hybrid tree can do better where they share a prefix and part ways).
    Example: accepted [[1, 0, 0]], lookup [2] -> [3.0]."""
    return torch.maximum(accepted_length(accepted, valid), 1.0 + lookup[valid.all(-1)].float())


def summarize(roll: dict) -> dict:
    """tau overall (drafter alone, and with the lookup chain: tau_hybrid) and per source, plus per-position
    conditional acceptance."""
    acc, valid = roll["accepted"], roll["valid"]
    out = {"tau": float(accepted_length(acc, valid).mean())}
    if "lookup" in roll:
        out["tau_hybrid"] = float(hybrid_length(acc, valid, roll["lookup"]).mean())
    for src in sorted(set(roll["source"])):
        rows = torch.tensor([s == src for s in roll["source"]])
        out[f"tau_{src}"] = float(accepted_length(acc[rows], valid[rows]).mean())
    prefix = torch.cumprod(torch.cat([torch.ones_like(acc[:, :1]), acc[:, :-1]], 1).long(), 1).bool() & valid
    out["cond_accept"] = [round(float(acc[prefix[:, k], k].float().mean()), 4) for k in range(acc.shape[1])]
    return out


def stepped_lengths(accepted: torch.Tensor, valid: torch.Tensor) -> list[int]:
    """Tokens per verify step of one example's stride-1 rows (row i: the block drafted at anchor i), stepping the
    way a server that verifies every drafted token does: a step at anchor i commits 1 + its leading accepted run,
    and the next step starts there: the per-step tau a server reports. The per-anchor mean weighs every position
    alike, so where easy positions cluster (a long accepted run) it counts them many times against once here.
    Example: accepted [[1, 1], [0, 0], [0, 0], [1, 0]] -> steps at anchors 0 and 3 -> [3, 2]."""
    out, pos = [], 0
    while pos < accepted.shape[0]:
        run = accepted[pos] & valid[pos]
        lead = int(torch.cumprod(run.long(), 0).sum())
        out.append(1 + lead)
        pos += 1 + lead
    return out


def eval_subset(held: list[Example], per_source: int) -> list[Example]:
    out = []
    for src in sorted({e.source for e in held}):
        out += [e for e in held if e.source == src][:per_source]
    return out
