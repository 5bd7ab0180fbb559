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
    sampling: tuple[SamplingParams, ...]  # one per request


class DraftClient(Protocol):
    def write_context(self, update: ContextUpdate) -> None: ...

    def propose(self, batch: DraftBatch) -> list[DraftTree]: ...

    def close(self) -> None: ...
