"""The draft-client protocol the SGLang worker talks to, and the records that cross it.

Context rows are keyed by the target's KV slot ids, so a radix-cache prefix hit reuses draft context too.
Must not know about SGLang batches; everything here is plain tensors and small records.
"""

from dataclasses import dataclass
from typing import Protocol

import torch

from sgl_dspark.sampling import SamplingParams
from sgl_dspark.tree import DraftTree


CAUSES = ("dead", "stalled", "invalid_reply", "shm_full", "restarting", "error", "closed")


class DraftWorkerUnavailable(RuntimeError):
    """The drafter gave no usable answer this call; the caller decodes without drafts. `cause` (one of CAUSES)
    says why in a word, for counting: dead or stalled worker, a reply that failed validation, a full /dev/shm, a
    restart under way, a worker-side or client-side error, a closed client."""

    def __init__(self, message: str, cause: str = "error") -> None:
        super().__init__(message)
        self.cause = cause


class DraftReplyInvalid(DraftWorkerUnavailable):
    """The worker's Proposed reply failed validation. `garbled`: its framing was wrong (tree count, sizes, tensor
    references, shapes, tree structure): the worker does not speak the protocol and is restarted. Otherwise only its
    numbers were (token ids, confidences, probabilities), which a restart would not change: the step decodes
    without drafts and the worker keeps serving."""

    def __init__(self, message: str, garbled: bool) -> None:
        super().__init__(message, "invalid_reply")
        self.garbled = garbled


class ShmFull(DraftWorkerUnavailable):
    """An arena could not be created, grown or written: the shared-memory directory is full or unusable."""

    def __init__(self, message: str) -> None:
        super().__init__(message, "shm_full")


@dataclass(frozen=True)
class ContextUpdate:
    """New context tokens: their target features, stored at their KV slots. The tensors may live on any device
    (the target's): each client moves them where its drafter runs."""

    slots: torch.Tensor  # [T] int64 target KV slot ids
    positions: torch.Tensor  # [T] int64 absolute positions
    features: torch.Tensor  # [T, n_target_layers * hidden] float
    restart: tuple[str, ...] = ()  # request ids whose context starts over (a prefill: new, or retracted and back):
    # the drafter drops what it keeps for them, and otherwise takes a request's context as only ever growing


@dataclass(frozen=True)
class DraftBatch:
    """One drafting step: per request, the slots of its context and its anchor."""

    context_slots: tuple[torch.Tensor, ...]  # per request [L_i] int64, slot ids of tokens before the anchor
    anchors: torch.Tensor  # [B] int64
    anchor_positions: torch.Tensor  # [B] int64
    sampling: tuple[SamplingParams, ...]  # one per request (or empty: all greedy)
    rids: tuple[str, ...] = ()  # request ids (or empty): the drafter (in process or in the worker) then keeps each
    # request's context in a buffer of its own, extended by new rows only (draft_worker.local.SlotContextStore)

    def select(self, rows: list[int]) -> "DraftBatch":
        index = torch.tensor(rows, dtype=torch.long)
        sampling = tuple(self.sampling[i] for i in rows) if self.sampling else ()
        return DraftBatch(tuple(self.context_slots[i] for i in rows), self.anchors[index.to(self.anchors.device)],
                          self.anchor_positions[index.to(self.anchor_positions.device)], sampling,
                          tuple(self.rids[i] for i in rows) if self.rids else ())

    def key(self, i: int) -> tuple:
        """What request i's draft depends on: anchor, its position, context slots, sampling."""
        return (int(self.anchors[i]), int(self.anchor_positions[i]), self.context_slots[i].cpu().numpy().tobytes(),
                self.sampling[i] if self.sampling else None)


class DraftClient(Protocol):
    ahead_hits: int  # trees `propose` returned that were drafted ahead (cumulative)
    generation: int  # drafting engine restarts so far (0: the first engine)
    worker_drafted: int  # draft nodes (anchors excluded) the current engine produced since it started
    arena_bytes: int  # shared-memory bytes held for talking to the engine (0 in-process)

    def write_context(self, update: ContextUpdate) -> None: ...

    def propose(self, batch: DraftBatch) -> list[DraftTree]: ...

    def draft_ahead(self, batch: DraftBatch) -> None:
        """Start drafting `batch` (the next step's, as far as the caller knows) while the caller goes on; the next
        `propose` reuses each request's draft whose key (DraftBatch.key) is unchanged."""

    def close(self) -> None: ...
