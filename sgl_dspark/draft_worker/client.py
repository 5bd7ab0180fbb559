"""The draft-client protocol the SGLang worker talks to, and the records that cross it.

Context rows are keyed by the target's KV slot ids, so a radix-cache prefix hit reuses draft context too.
Must not know about SGLang batches; everything here is plain tensors and small records.
"""

from dataclasses import dataclass
from typing import Protocol

import torch

from sgl_dspark.sampling import SamplingParams
from sgl_dspark.tree import DraftTree


class DraftWorkerUnavailable(RuntimeError):
    """The drafter could not answer in time (process dead or stalled); the caller decodes without drafts."""


@dataclass(frozen=True)
class ContextUpdate:
    """New context tokens: their target features, stored at their KV slots."""

    slots: torch.Tensor  # [T] int64 target KV slot ids
    positions: torch.Tensor  # [T] int64 absolute positions
    features: torch.Tensor  # [T, n_target_layers * hidden] float


@dataclass(frozen=True)
class DraftBatch:
    """One drafting step: per request, the slots of its context and its anchor."""

    context_slots: tuple[torch.Tensor, ...]  # per request [L_i] int64, slot ids of tokens before the anchor
    anchors: torch.Tensor  # [B] int64
    anchor_positions: torch.Tensor  # [B] int64
    sampling: tuple[SamplingParams, ...]  # one per request (or empty: all greedy)

    def select(self, rows: list[int]) -> "DraftBatch":
        index = torch.tensor(rows, dtype=torch.long)
        sampling = tuple(self.sampling[i] for i in rows) if self.sampling else ()
        return DraftBatch(tuple(self.context_slots[i] for i in rows), self.anchors[index.to(self.anchors.device)],
                          self.anchor_positions[index.to(self.anchor_positions.device)], sampling)

    def key(self, i: int) -> tuple:
        """What request i's draft depends on: anchor, its position, context slots, sampling."""
        return (int(self.anchors[i]), int(self.anchor_positions[i]), self.context_slots[i].cpu().numpy().tobytes(),
                self.sampling[i] if self.sampling else None)


class DraftClient(Protocol):
    ahead_hits: int  # trees `propose` returned that were drafted ahead (cumulative)

    def write_context(self, update: ContextUpdate) -> None: ...

    def propose(self, batch: DraftBatch) -> list[DraftTree]: ...

    def draft_ahead(self, batch: DraftBatch) -> None:
        """Start drafting `batch` (the next step's, as far as the caller knows) while the caller goes on; the next
        `propose` reuses each request's draft whose key (DraftBatch.key) is unchanged."""

    def close(self) -> None: ...
