"""Reading a Proposed reply back into DraftTrees, trusting nothing in it.

The framing (tree count, sizes, draft_probs presence, tensor references, shapes, dtypes, tree structure) and the
numbers (token ids, confidences, probabilities) are checked before any tree reaches the caller; the first fault
raises DraftReplyInvalid naming it in one line. Must not talk to the worker or decide what a fault leads to
(the client does: remote.py).
"""

from dataclasses import dataclass

import torch

from sgl_dspark.draft_worker.client import DraftReplyInvalid
from sgl_dspark.draft_worker.messages import Proposed, TensorRef
from sgl_dspark.draft_worker.shm import GrowingArena
from sgl_dspark.tree import DraftTree


@dataclass(frozen=True)
class ReplyLimits:
    """What a valid reply to one Propose looks like."""

    sampled: tuple[bool, ...]  # [B] requests that must carry draft_probs (non-greedy sampling)
    max_tree_size: int  # nodes per tree, anchor included (Ready.max_tree_size)
    vocab: int  # token ids lie in [0, vocab); a draft_probs row has vocab columns (Ready.probs_width)


def garbled(what: str) -> DraftReplyInvalid:
    return DraftReplyInvalid(f"draft worker reply garbled: {what}", garbled=True)


def check_frame(reply: Proposed, limits: ReplyLimits) -> None:
    """Counts and sizes. Example: 2 requests, max_tree_size 4 -> sizes (1, 4) pass, sizes (5, 1) or (1,) do not."""
    batch = len(limits.sampled)
    if len(reply.sizes) != batch or len(reply.has_probs) != batch:
        raise garbled(f"{len(reply.sizes)} trees ({len(reply.has_probs)} probs flags) for {batch} requests")
    for i, n in enumerate(reply.sizes):
        if not 1 <= n <= limits.max_tree_size:
            raise garbled(f"tree {i} has {n} nodes (allowed 1..{limits.max_tree_size})")
    missing = [i for i, (want, has) in enumerate(zip(limits.sampled, reply.has_probs)) if want and not has]
    if missing:
        raise garbled(f"sampled requests {missing} came without draft_probs")
    if (reply.draft_probs is None) == any(reply.has_probs):
        raise garbled("draft_probs presence contradicts has_probs")


def read(arena: GrowingArena, ref: TensorRef, shape: tuple[int, ...], dtype: str, name: str) -> torch.Tensor:
    """A copy of the tensor `ref` names (the arena is overwritten by the next step), once it has the expected
    shape and dtype and lies inside the reply arena."""
    if tuple(ref.shape) != shape or ref.dtype != dtype:
        raise garbled(f"{name} is {list(ref.shape)} {ref.dtype}, expected {list(shape)} {dtype}")
    try:
        return arena.view(ref).clone()
    except ValueError as exc:
        raise garbled(f"{name}: {exc}") from exc


def within(x: torch.Tensor, low: float, high: float) -> bool:
    """Every element in [low, high]; NaN never is. One pass (aminmax)."""
    if x.numel() == 0:
        return True
    smallest, largest = x.aminmax()
    return bool(smallest >= low) and bool(largest <= high)


def check_values(tokens: torch.Tensor, confidence: torch.Tensor, roots: torch.Tensor, probs: torch.Tensor | None,
                 vocab: int) -> None:
    """tokens [N], confidence [N], roots [B] (each tree's first node), probs [M, V] or None."""
    if not within(tokens, 0, vocab - 1):
        raise DraftReplyInvalid(f"draft worker reply: token ids outside [0, {vocab})", garbled=False)
    if not within(confidence, 0.0, 1.0) or not bool((confidence[roots] == 1).all()):
        raise DraftReplyInvalid("draft worker reply: confidences not finite in [0, 1] with roots 1", garbled=False)
    if probs is not None and not within(probs, 0.0, 1.0):
        raise DraftReplyInvalid("draft worker reply: draft_probs not finite in [0, 1]", garbled=False)


def unpack(reply: Proposed, arena: GrowingArena, limits: ReplyLimits) -> list[DraftTree]:
    """The reply's trees, copied out of the reply arena; DraftReplyInvalid on the first fault."""
    check_frame(reply, limits)
    sizes = list(reply.sizes)
    n = sum(sizes)
    tokens = read(arena, reply.tokens, (n,), "int64", "tokens")
    parents = read(arena, reply.parents, (n,), "int64", "parents")
    confidence = read(arena, reply.confidence, (n,), "float32", "confidence")
    probs_sizes = [s for s, has in zip(sizes, reply.has_probs) if has]
    probs = None if reply.draft_probs is None else read(arena, reply.draft_probs, (sum(probs_sizes), limits.vocab),
                                                         "float32", "draft_probs")
    roots = torch.tensor([0, *sizes[:-1]]).cumsum(0)  # [B] each tree's first node
    nodes = torch.ones(n, dtype=torch.bool)
    nodes[roots] = False
    if bool((parents[nodes] < 0).any()):  # DraftTree checks parents < own index, not >= 0
        raise garbled("a non-root node has a negative parent")
    check_values(tokens, confidence, roots, probs, limits.vocab)
    rows = iter(() if probs is None else probs.split(probs_sizes))
    trees = []
    for i, (t, p, c, has) in enumerate(zip(tokens.split(sizes), parents.split(sizes), confidence.split(sizes),
                                           reply.has_probs)):
        try:
            trees.append(DraftTree(t, p, c, next(rows) if has else None))
        except ValueError as exc:
            raise garbled(f"tree {i}: {exc}") from exc
    return trees
