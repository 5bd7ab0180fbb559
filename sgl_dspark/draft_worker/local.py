"""The in-process draft client: a slot-indexed store of context K/V rows plus the Proposer, on the drafter's device
(the target's, in SGLang's process: features, context rows and draft-probability rows never cross to the host).

Also the engine the draft-worker process runs, so both paths draft identically. In SGLang's own process it runs
behind `GuardedDraftClient`, which turns any drafter exception into the same DraftWorkerUnavailable the worker
process's faults raise. Must not touch SGLang.
"""

from collections.abc import Callable
from typing import TypeVar

import torch

from sgl_dspark.draft_worker.client import ContextUpdate, DraftBatch, DraftWorkerUnavailable
from sgl_dspark.drafter import ContextKV, DraftKnobs, DSparkDrafter, Proposer, ProposeInput
from sgl_dspark.drafter.context import ContextBuffer, PaddedContext, RequestContexts, gather_padded
from sgl_dspark.gate import PROBE_EVERY
from sgl_dspark.tree import DraftTree


RETAIN_CALLS = PROBE_EVERY + 1  # a request's context buffer is dropped once this many drafting calls went by without
# it (the gate makes every request draft at least every PROBE_EVERY steps)


class SlotContextStore:
    """Context K/V rows of every draft layer, one row per target KV slot (written once, where prefill and the commit
    put them; a radix-cache prefix hit reuses them); drafting reads each request's rows from a buffer of its own,
    extended by the rows written since its last draft (`context`). A request's context only grows between its
    prefills, which name it (ContextUpdate.restart), so a buffer is extended by its length alone: no slot id is read
    back from the device to check it."""

    def __init__(self, drafter: DSparkDrafter, num_slots: int) -> None:
        cfg = drafter.config
        shape = (cfg.num_hidden_layers, num_slots, cfg.num_key_value_heads, cfg.head_dim)
        weight = next(drafter.parameters())
        self.pool = ContextKV(torch.zeros(shape, dtype=weight.dtype, device=weight.device),
                              torch.zeros(shape, dtype=weight.dtype, device=weight.device))
        self.drafter = drafter
        self.buffers: dict[str, ContextBuffer] = {}  # request id -> its context rows
        self.last_call: dict[str, int] = {}  # request id -> the drafting call that last used its buffer
        self.calls = 0
        self.rows_copied = 0  # context rows copied out of the pool for drafting, cumulative (what tests count)

    @property
    def device(self) -> torch.device:
        return self.pool.keys.device

    @torch.inference_mode()
    def write(self, update: ContextUpdate) -> None:
        """Rows from features wherever they are (the target's device: no copy when the drafter is there too)."""
        for rid in update.restart:
            self.forget(rid)
        features = update.features.to(self.device, self.pool.keys.dtype)
        rows = self.drafter.context_kv(features, update.positions.to(self.device))
        slots = update.slots.to(self.device)
        self.pool.keys[:, slots] = rows.keys
        self.pool.values[:, slots] = rows.values

    def context(self, batch: DraftBatch) -> PaddedContext | RequestContexts:
        """The batch's context rows: with request ids, each request's buffer extended by its new rows only (a new
        request's, or a restarted one's, built once from all of its rows); without, one padded copy of every
        request's rows."""
        if not batch.rids:
            self.rows_copied += sum(s.numel() for s in batch.context_slots)
            return gather_padded(self.pool, batch.context_slots)
        self.calls += 1
        buffers = tuple(self.extended(rid, slots) for rid, slots in zip(batch.rids, batch.context_slots))
        self.last_call.update((rid, self.calls) for rid in batch.rids)
        for rid in [r for r, call in self.last_call.items() if self.calls - call > RETAIN_CALLS]:
            self.forget(rid)
        return RequestContexts(buffers)

    def forget(self, rid: str) -> None:
        """Drop a request's buffer (restarted, or idle too long); its next draft builds it again."""
        self.buffers.pop(rid, None)
        self.last_call.pop(rid, None)

    def extended(self, rid: str, slots: torch.Tensor) -> ContextBuffer:
        buffer, n = self.buffers.get(rid), slots.shape[0]
        if buffer is not None and n >= buffer.length:
            if n > buffer.length:
                buffer.append(self.rows(slots[buffer.length:]))
        else:  # a new request, a restarted one, or a context shorter than its buffer. A request id reused without
            # a prefill naming it would draft from the old rows: worse drafts, never a different output
            buffer = self.buffers[rid] = ContextBuffer(self.rows(slots), self.drafter.config.query_len)
        return buffer

    def rows(self, slots: torch.Tensor) -> ContextKV:
        self.rows_copied += slots.numel()
        return self.pool.select(slots.long().to(self.device))


class LocalDraftClient:
    def __init__(self, drafter: DSparkDrafter, knobs: DraftKnobs, num_slots: int, seed: int = 0) -> None:
        """seed: the drafter's stream seed (sgl_dspark.streams.stream_seed(--random-seed, DRAFT, start))."""
        self.store = SlotContextStore(drafter, num_slots)
        self.proposer = Proposer(drafter, knobs)
        self.generator = torch.Generator(self.store.device).manual_seed(seed)  # on the drafter's device
        self.ahead_hits = 0
        self.generation = 0  # in-process: never restarted
        self.worker_drafted = 0  # draft nodes produced (anchors excluded); the worker process reports this one
        self.arena_bytes = 0  # in-process: no shared memory

    @property
    def rows_copied(self) -> int:
        """Context rows copied out of the slot pool for drafting since start (the worker process reports it)."""
        return self.store.rows_copied

    def write_context(self, update: ContextUpdate) -> None:
        self.store.write(update)

    def propose(self, batch: DraftBatch) -> list[DraftTree]:
        device = self.store.device
        inp = ProposeInput(self.store.context(batch), batch.anchors.to(device),
                           batch.anchor_positions.to(device), batch.sampling, self.generator)
        out = self.proposer.propose(inp)
        self.worker_drafted += sum(out.draft_lengths)
        return list(out.trees)

    def draft_ahead(self, batch: DraftBatch) -> None:
        """In-process there is no second core to draft on while the caller works: nothing to do."""

    def close(self) -> None:
        pass


T = TypeVar("T")


class GuardedDraftClient:
    """An engine running in SGLang's own process, as the SGLang worker uses it: any exception the drafter raises
    becomes DraftWorkerUnavailable (cause "error"), so the step decodes without drafts, counted and logged, and the
    server stays up. A failed context write leaves stale rows for those slots: later drafts from them may be
    rejected more often, never accepted unverified."""

    def __init__(self, engine: LocalDraftClient) -> None:
        self.engine = engine
        self.generation = 0  # never restarted
        self.arena_bytes = 0  # no shared memory

    @property
    def ahead_hits(self) -> int:
        return self.engine.ahead_hits

    @property
    def worker_drafted(self) -> int:
        return self.engine.worker_drafted

    def write_context(self, update: ContextUpdate) -> None:
        guarded(self.engine.write_context, update)

    def propose(self, batch: DraftBatch) -> list[DraftTree]:
        return guarded(self.engine.propose, batch)

    def draft_ahead(self, batch: DraftBatch) -> None:
        guarded(self.engine.draft_ahead, batch)

    def close(self) -> None:
        self.engine.close()


def guarded(call: Callable[..., T], *args) -> T:
    try:
        return call(*args)
    except DraftWorkerUnavailable:
        raise
    except Exception as exc:  # the drafter's fault, whatever it is, must not reach SGLang's scheduler loop
        raise DraftWorkerUnavailable(f"in-process drafter: {type(exc).__name__}: {exc}", "error") from exc
