"""Graft: lookup candidate chains joined to the drafter's tree as extra branches, and what verification of
such a tree teaches the lookup statistics.

Owns the grafted-tree record (which nodes the drafter made, which the lookup proposed), the graft itself,
the post-plan fold that merges duplicate siblings, and the per-step feedback helpers. Pure torch on CPU; must
not propose candidates (sgl_dspark.lookup does), schedule or verify.

Exactness. Lookup nodes are deterministic: one-hot draft_probs rows, appended after every drafter node, so
at any parent the drafter's (sampled) children are tried first by the multi-candidate recursion. A sampled
node's row is only right if whether it is verified never depends on its own token (budget.py), so for a
sampled tree (draft_probs given) the lookup branches hang off the root untouched by the drafter's tokens until
the verify budget has chosen; `Grafted.select` then folds each lookup node into a verified earlier sibling with
the same token (tests/unit/test_lookup.py shows merging first biases the output). For the same reason the
lookup's node budget is a constant, never what the drafter's tree left over. A greedy tree (draft_probs None)
is verified by argmax, so there chains merge into drafter nodes before planning and the verify budget sees the
shared prefix.
"""

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from sgl_dspark.lookup import Candidate, LookupOutcome, LookupStats
from sgl_dspark.tree import DraftTree, depths, subtree
from sgl_dspark.verify import VerifyResult


@dataclass(frozen=True)
class Grafted:
    """A request's block with the provenance of each node."""

    tree: DraftTree
    neural: torch.Tensor  # [n] bool: the drafter made the node (the root counts as one)
    group: torch.Tensor  # [n] int64: lookup statistics group of the chain that proposed it; -1: none did

    @staticmethod
    def plain(tree: DraftTree) -> "Grafted":
        """A drafter tree with nothing grafted."""
        return Grafted(tree, torch.ones(tree.size, dtype=torch.bool), torch.full((tree.size,), -1))

    @property
    def lookup_only(self) -> torch.Tensor:
        """[n] bool: nodes only the lookup proposed."""
        return ~self.neural & (self.group >= 0)

    def select(self, keep: torch.Tensor) -> "Grafted":
        """The verify budget's selection `keep` [m] (sorted, prefix-closed), duplicate siblings folded."""
        keep = keep.sort().values
        return fold(Grafted(subtree(self.tree, keep), self.neural[keep], self.group[keep]))


@dataclass
class _Builder:
    """The grafted tree as lists while chains are inserted."""

    tokens: list[int]
    parents: list[int]
    neural: list[bool]
    group: list[int]
    child: dict[tuple[int, int], int]  # (parent, token) -> node a chain may walk into


def graft(tree: DraftTree, candidates: Sequence[Candidate], stats: LookupStats, max_nodes: int) -> Grafted:
    """Insert each candidate chain below the root, walking down nodes with the chain's tokens and appending
    the rest as a new branch; at most `max_nodes` new nodes. New nodes get confidence stats.conf(group, depth)
    and one-hot rows; a greedy tree's drafter node on a chain keeps the larger of its two confidences.

    Example (greedy): chain tree tokens [9, 1, 2, 3], candidate (1, 2, 4, 5) ->
      tokens [9, 1, 2, 3, 4, 5], parents [-1, 0, 1, 2, 2, 4]."""
    b = _start(tree)
    added = 0
    for cand in candidates:
        group, node = stats.knobs.group(cand.rank, cand.match, cand.shared), 0
        for token in cand.tokens:
            nxt = b.child.get((node, token))
            if nxt is None:
                if added == max_nodes:
                    break
                nxt, added = _append(b, node, token), added + 1
            if b.group[nxt] < 0:
                b.group[nxt] = group
            node = nxt
    return _finish(tree, b, stats)


def fold(g: Grafted) -> Grafted:
    """Merge every lookup-only node into an earlier sibling with the same token (its children move along,
    after that sibling's own children). Example: tokens [9, 1, 2, 1, 4], parents [-1, 0, 1, 0, 3], nodes 3, 4
    lookup-only -> tokens [9, 1, 2, 4], parents [-1, 0, 1, 1]."""
    tokens, parents = g.tree.tokens.tolist(), g.tree.parents.tolist()
    only, group = g.lookup_only.tolist(), g.group.tolist()
    canon, first, kept = list(range(g.tree.size)), {}, [0]
    for v in range(1, g.tree.size):
        key = (canon[parents[v]], tokens[v])
        if only[v] and key in first:
            canon[v] = first[key]
            if group[canon[v]] < 0:  # the sibling now carries the lookup's proposal too
                group[canon[v]] = group[v]
            continue
        first.setdefault(key, v)
        kept.append(v)
    if len(kept) == g.tree.size:
        return g
    keep, remap = torch.tensor(kept), {v: i for i, v in enumerate(kept)}
    new_parents = torch.tensor([-1] + [remap[canon[parents[v]]] for v in kept[1:]])
    probs = None if g.tree.draft_probs is None else g.tree.draft_probs[keep]
    tree = DraftTree(g.tree.tokens[keep], new_parents, g.tree.confidence[keep], probs)
    return Grafted(tree, g.neural[keep], torch.tensor(group)[keep])


def outcome(g: Grafted, result: VerifyResult) -> LookupOutcome:
    """What one verify step says about the lookup: every lookup-proposed node of the verified tree whose
    parent was accepted (the root counts as accepted) is a trial, accepted iff it is on the accepted path."""
    on_path = torch.zeros(g.tree.size, dtype=torch.bool)
    on_path[0] = True
    on_path[result.accepted_nodes] = True
    parents = g.tree.parents.clamp_min(0)
    trial = (g.group >= 0) & on_path[parents]
    trial[0] = False
    return LookupOutcome(g.group[trial], depths(g.tree.parents)[trial], on_path[trial])


def lookup_accepted(g: Grafted, result: VerifyResult) -> int:
    """Accepted tokens that only the lookup proposed (for the benchmark's attribution)."""
    return int(g.lookup_only[result.accepted_nodes].sum())


def _start(tree: DraftTree) -> _Builder:
    tokens, parents = tree.tokens.tolist(), tree.parents.tolist()
    b = _Builder(tokens, parents, [True] * tree.size, [-1] * tree.size, {})
    if tree.draft_probs is None:  # greedy: chains may walk into drafter nodes (first of equal siblings)
        for v in range(tree.size - 1, 0, -1):
            b.child[(parents[v], tokens[v])] = v
    return b


def _append(b: _Builder, parent: int, token: int) -> int:
    b.tokens.append(token)
    b.parents.append(parent)
    b.neural.append(False)
    b.group.append(-1)
    b.child[(parent, token)] = len(b.tokens) - 1
    return len(b.tokens) - 1


def _finish(tree: DraftTree, b: _Builder, stats: LookupStats) -> Grafted:
    """Lists -> Grafted: lookup confidences, one-hot rows for the new nodes."""
    n, new = tree.size, len(b.tokens) - tree.size
    parents, group = torch.tensor(b.parents), torch.tensor(b.group)
    proposed = group >= 0
    conf = torch.cat([tree.confidence.float(), torch.zeros(new)])
    conf[proposed] = torch.maximum(conf[proposed], stats.conf(group[proposed], depths(parents)[proposed]))
    probs = tree.draft_probs
    if probs is not None and new:
        extra = torch.zeros(new, probs.shape[1], dtype=probs.dtype, device=probs.device)
        extra[torch.arange(new), torch.tensor(b.tokens[n:])] = 1.0
        probs = torch.cat([probs, extra])
    grafted = DraftTree(torch.tensor(b.tokens, dtype=tree.tokens.dtype), parents, conf, probs)
    return Grafted(grafted, torch.tensor(b.neural), group)
