"""Which target KV slots hold context the current draft-worker generation has been given.

A restarted worker has an empty context store; the ledger is cleared with it, and a request is drafted only from
the slots written since. Must not talk to the worker.
"""

from dataclasses import replace

import torch

from sgl_dspark.draft_worker.client import DraftBatch


class SlotLedger:
    """Which KV slots hold context written to the current worker generation (cleared when the worker is lost)."""

    def __init__(self, num_slots: int) -> None:
        self.written = torch.zeros(num_slots, dtype=torch.bool)  # [num_slots]

    def mark(self, slots: torch.Tensor) -> None:
        self.written[slots.cpu()] = True

    def clear(self) -> None:
        self.written.zero_()

    def written_masks(self, contexts: tuple[torch.Tensor, ...]) -> list[torch.Tensor]:
        """Per request [L_i] bool: which of its context slots were written in this generation."""
        if not contexts:
            return []
        flat = torch.cat([c.cpu().long() for c in contexts])
        return list(self.written[flat].split([c.numel() for c in contexts]))

    def stale(self, contexts: tuple[torch.Tensor, ...]) -> list[int]:
        """Indices of the requests whose context has a slot not written in this generation."""
        return [i for i, m in enumerate(self.written_masks(contexts)) if not bool(m.all())]

    def drafted_part(self, batch: DraftBatch) -> tuple[DraftBatch, list[int]]:
        """What to draft: `batch` with each request's context cut to its slots written in this generation (the
        drafter attends to context rows by slot, each carrying its own position, so a part is a valid context),
        restricted to the requests it leaves something of (or whose context is empty); and their indices.
        Example: written {3, 4}; contexts ([3, 4, 5], [7], []) -> contexts ([3, 4], []), rows [0, 2]."""
        masks = self.written_masks(batch.context_slots)
        if all(bool(m.all()) for m in masks):
            return batch, list(range(batch.anchors.shape[0]))
        kept = tuple(c.cpu()[m] for c, m in zip(batch.context_slots, masks))
        rows = [i for i, (c, k) in enumerate(zip(batch.context_slots, kept)) if k.numel() or not c.numel()]
        return replace(batch, context_slots=kept).select(rows), rows
