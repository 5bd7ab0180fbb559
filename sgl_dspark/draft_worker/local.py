"""The in-process draft client: a slot-indexed store of context K/V rows plus the Proposer.

Also the engine the draft-worker process runs, so both paths draft identically. Must not touch SGLang.
"""

import torch

from sgl_dspark.draft_worker.client import ContextUpdate, DraftBatch
from sgl_dspark.drafter import ContextKV, DraftKnobs, DSparkDrafter, Proposer, ProposeInput
from sgl_dspark.drafter.context import gather_padded
from sgl_dspark.tree import DraftTree


class SlotContextStore:
    """Context K/V rows of every draft layer, one row per target KV slot."""

    def __init__(self, drafter: DSparkDrafter, num_slots: int) -> None:
        cfg = drafter.config
        shape = (cfg.num_hidden_layers, num_slots, cfg.num_key_value_heads, cfg.head_dim)
        dtype = next(drafter.parameters()).dtype
        self.pool = ContextKV(torch.zeros(shape, dtype=dtype), torch.zeros(shape, dtype=dtype))
        self.drafter = drafter

    @torch.inference_mode()
    def write(self, update: ContextUpdate) -> None:
        rows = self.drafter.context_kv(update.features.to(self.pool.keys.dtype), update.positions)
        self.pool.keys[:, update.slots] = rows.keys
        self.pool.values[:, update.slots] = rows.values

    def gather(self, slots: tuple[torch.Tensor, ...]):
        return gather_padded(self.pool, slots)


class LocalDraftClient:
    def __init__(self, drafter: DSparkDrafter, knobs: DraftKnobs, num_slots: int, seed: int = 0) -> None:
        self.store = SlotContextStore(drafter, num_slots)
        self.proposer = Proposer(drafter, knobs)
        self.generator = torch.Generator().manual_seed(seed)
        self.ahead_hits = 0
        self.generation = 0  # in-process: never restarted
        self.worker_drafted = 0  # draft nodes produced (anchors excluded); the worker process reports this one
        self.arena_bytes = 0  # in-process: no shared memory

    def write_context(self, update: ContextUpdate) -> None:
        self.store.write(update)

    def propose(self, batch: DraftBatch) -> list[DraftTree]:
        inp = ProposeInput(self.store.gather(batch.context_slots), batch.anchors, batch.anchor_positions,
                           batch.sampling, self.generator)
        out = self.proposer.propose(inp)
        self.worker_drafted += sum(out.draft_lengths)
        return list(out.trees)

    def draft_ahead(self, batch: DraftBatch) -> None:
        """In-process there is no second core to draft on while the caller works: nothing to do."""

    def close(self) -> None:
        pass
