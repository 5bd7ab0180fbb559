"""The drafter protocol: `Proposer(drafter, knobs).propose(ProposeInput) -> ProposeOutput`.

One parallel pass over every request's block, then the sequential stage grows a chain (or a tree) per request.
Inputs and outputs are single records so adding a field never changes the signature. Must not cache context K/V
(the caller owns that) or touch SGLang.
"""

from dataclasses import dataclass

import torch

from sgl_dspark.drafter.context import PaddedContext, RequestContexts
from sgl_dspark.drafter.knobs import DraftKnobs
from sgl_dspark.drafter.model import DSparkDrafter
from sgl_dspark.drafter.sequential import grow_trees
from sgl_dspark.sampling import SamplingParams
from sgl_dspark.tree import DraftTree

DEFAULT_DRAFT_KNOBS = DraftKnobs()

GREEDY = SamplingParams(temperature=0.0)


@dataclass(frozen=True)
class ProposeInput:
    context: PaddedContext | RequestContexts  # per-request context K/V rows (tokens before each anchor)
    anchors: torch.Tensor  # [B] int64, the last token the target produced
    anchor_positions: torch.Tensor  # [B] int64, the anchor's position (= context length when uncached rows exist)
    sampling: tuple[SamplingParams, ...] = ()  # one per request; empty: greedy for all
    generator: torch.Generator | None = None  # seeded for reproducible sampled drafts

    def sampling_for(self, batch_size: int) -> list[SamplingParams]:
        if not self.sampling:
            return [GREEDY] * batch_size
        if len(self.sampling) != batch_size:
            raise ValueError(f"sampling has {len(self.sampling)} entries for a batch of {batch_size}")
        return list(self.sampling)


@dataclass(frozen=True)
class ProposeOutput:
    trees: tuple[DraftTree, ...]  # one per request; a chain when tree_width == 1
    lm_head_rows: int  # LM-head rows projected in this call (one per request per drafted depth)

    @property
    def draft_lengths(self) -> list[int]:
        return [t.size - 1 for t in self.trees]


class Proposer:
    """Binds a drafter to its knobs once; `propose` is then a pure function of the input record."""

    def __init__(self, drafter: DSparkDrafter, knobs: DraftKnobs = DEFAULT_DRAFT_KNOBS) -> None:
        self.drafter = drafter
        self.knobs = knobs.resolve(drafter.config.gamma)

    @torch.inference_mode()
    def propose(self, inp: ProposeInput) -> ProposeOutput:
        hidden = self.drafter.block_hidden(inp.context, inp.anchors, inp.anchor_positions)  # [B, gamma, H]
        sampling = inp.sampling_for(hidden.shape[0])
        trees, rows = grow_trees(self.drafter, hidden, inp.anchors, sampling, self.knobs, inp.generator)
        return ProposeOutput(tuple(trees), rows)
