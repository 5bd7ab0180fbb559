"""Draft trees: the block a request proposes, as a token tree rooted at the anchor.

Owns the tree record and the pure functions derived from it (depths, position ids, the verification
attention mask, prefix-closed sub-trees). A chain is the tree whose parents are [-1, 0, 1, 2, ...].
Must not know about drafting, scheduling or SGLang.
"""

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class DraftTree:
    """One request's block. Node 0 is the anchor (root); nodes are in topological order (parent < self).

    Fields:
      tokens      [n] int64: node tokens; tokens[0] is the anchor.
      parents     [n] int64: parent node index; parents[0] == -1.
      confidence  [n] float32: c of each node given its parent; confidence[0] == 1.
      draft_probs [n, V] float32 or None: the distribution each node's token was drawn from (a one-hot row
                  for a deterministic candidate); row 0 unused. None for greedy-only blocks.
    """

    tokens: torch.Tensor
    parents: torch.Tensor
    confidence: torch.Tensor
    draft_probs: torch.Tensor | None = None

    def __post_init__(self) -> None:
        n = self.tokens.shape[0]
        if n < 1 or self.parents.shape != (n,) or self.confidence.shape != (n,):
            raise ValueError(f"DraftTree: tokens/parents/confidence must all be [n>=1], got "
                             f"{tuple(self.tokens.shape)}/{tuple(self.parents.shape)}/{tuple(self.confidence.shape)}")
        if int(self.parents[0]) != -1 or bool((self.parents[1:] >= torch.arange(1, n)).any()):
            raise ValueError("DraftTree: parents must be -1 for the root and < own index otherwise")

    @property
    def size(self) -> int:
        return self.tokens.shape[0]

    @property
    def is_chain(self) -> bool:
        return bool((self.parents[1:] == torch.arange(self.size - 1)).all())

    @staticmethod
    def chain(tokens: torch.Tensor, confidence: torch.Tensor, draft_probs: torch.Tensor | None = None) -> "DraftTree":
        """tokens [n] (anchor first), confidence [n] -> the chain tree."""
        parents = torch.arange(-1, tokens.shape[0] - 1)
        return DraftTree(tokens, parents, confidence, draft_probs)


def depths(parents: torch.Tensor) -> torch.Tensor:
    """parents [n] -> depth [n] (root 0). Example: [-1, 0, 0, 1] -> [0, 1, 1, 2]."""
    out = torch.zeros_like(parents)
    for i in range(1, parents.shape[0]):
        out[i] = out[parents[i]] + 1
    return out


def random_parents(n: int, gen: torch.Generator) -> list[int]:
    """A random tree of n nodes in topological order (root -1): each node hangs off a uniformly drawn earlier one
    (probe steps and tests)."""
    return [-1] + [int(torch.randint(0, i, (1,), generator=gen)) for i in range(1, n)]


def position_ids(parents: torch.Tensor, prefix_len: int) -> torch.Tensor:
    """parents [n] -> positions [n]: the root sits at prefix_len, each node one past its parent."""
    return depths(parents) + prefix_len


def ancestor_mask(parents: torch.Tensor) -> torch.Tensor:
    """parents [n] -> bool [n, n]: row i is True at i and every ancestor of i (never siblings).

    Example: [-1, 0, 0, 1] ->
      [[1,0,0,0],
       [1,1,0,0],
       [1,0,1,0],
       [1,1,0,1]]
    """
    n = parents.shape[0]
    mask = torch.eye(n, dtype=torch.bool)
    for i in range(1, n):
        mask[i] |= mask[parents[i]]
    return mask


def verify_mask(parents: torch.Tensor, prefix_len: int) -> torch.Tensor:
    """bool [n, prefix_len + n]: each node sees the whole cached prefix plus its own ancestors."""
    prefix = torch.ones(parents.shape[0], prefix_len, dtype=torch.bool)
    return torch.cat([prefix, ancestor_mask(parents)], dim=1)


def subtree(tree: DraftTree, keep: torch.Tensor) -> DraftTree:
    """Restrict to the sorted node indices `keep` [m] (must contain 0 and be prefix-closed)."""
    keep = keep.sort().values
    remap = torch.full((tree.size,), -1, dtype=torch.long)
    remap[keep] = torch.arange(keep.shape[0])
    parents = tree.parents[keep]
    if int(keep[0]) != 0 or bool((remap[parents[1:]] < 0).any()):
        raise ValueError("subtree: the kept nodes must include the root and every kept node's parent")
    new_parents = torch.cat([torch.tensor([-1]), remap[parents[1:]]])
    probs = None if tree.draft_probs is None else tree.draft_probs[keep]
    return DraftTree(tree.tokens[keep], new_parents, tree.confidence[keep], probs)


def survival(tree: DraftTree) -> torch.Tensor:
    """[n]: product of confidences along the path from the root to each node (root 1)."""
    out = tree.confidence.clone().float()
    out[0] = 1.0
    for i in range(1, tree.size):
        out[i] = out[i] * out[tree.parents[i]]
    return out
