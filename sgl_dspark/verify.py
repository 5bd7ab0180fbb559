"""Lossless verification: which draft tokens of a block the target accepts, and the bonus token it adds.

Owns the acceptance rule (greedy match; chain and multi-candidate tree speculative sampling; match against
pre-drawn choices for seeded requests), the VerifyResult record, and which tree nodes' KV to keep. Pure torch
on the target's logits for the block; must not run the target, touch the KV cache or import SGLang.

Why sampled output is distributed exactly as the target's. At an accepted node with target distribution p,
the children c_1, c_2, ... are tried in index order: c_i is accepted with probability min(1, p_i(x_i) / q_i(x_i))
and otherwise p_{i+1} = normalize(max(0, p_i - q_i)); after the last child the bonus is drawn from the final
residual. By induction from the last child, the token emitted at that node is distributed as p_1 = p,
provided that (a) q_i is the distribution x_i was drawn from given everything that decided whether c_i is
verified and what was drawn before it, and (b) whether c_i is verified never depends on x_i itself or on
anything drawn from x_i (its descendants, younger siblings derived from it). A deterministic candidate has
a one-hot q_i. The pieces that keep (a) and (b):
- the drafter (sgl_dspark.drafter.sequential): node k's token is drawn from q_k, and its confidence depends only
  on its parent's token, never on its own; a sampled request's siblings are further i.i.d. draws from the same
  q_k, their number and confidences fixed from the parent's confidence before any is drawn (so x_i is drawn
  from q_i whatever its elder siblings drew, and nothing about c_i depends on x_i); tree alternatives derived
  from the sampled token and scored by it are drafted for greedy requests only;
- the lookup branch (sgl_dspark.graft) hangs deterministic chains (one-hot rows) off the root whose tokens
  and confidences come from the request's context and past statistics, not from this step's draws; folding a
  lookup node into an equal elder sibling after scheduling only drops a candidate whose presence depends on
  that elder sibling's token, which (b) allows;
- the verify budget (sgl_dspark.budget) admits nodes in order of survival, ties to the shallower node, so a
  node's admission depends only on nodes ranked before it: other requests' blocks (independent draws), its
  ancestors, and lookup nodes; never its own token or its descendants (the lagged mode's budget comes from
  earlier steps).
Greedy and seeded requests are verified by exact match with a token the target fixes without looking at the
drafts (the argmax, or SGLang's seeded Gumbel-max choice), so any selection of nodes is exact for them.
`tests/unit/test_exact_law.py` enumerates the whole pipeline on small vocabularies and checks the law.
"""

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Protocol

import torch

from sgl_dspark.sampling import SamplerBatch, SamplingParams, greedy_choices, target_probs
from sgl_dspark.tree import DraftTree

@dataclass(frozen=True)
class VerifyResult:
    """One request's verify outcome. The accepted path runs root -> last_node; the bonus follows it."""

    accepted_nodes: torch.Tensor  # [tau - 1] int64: node indices along the accepted path, root excluded
    accepted_tokens: torch.Tensor  # [tau - 1] int64: their tokens
    bonus_token: int  # sampled by the target after last_node
    last_node: int  # last accepted node (0, the root, when no draft token was accepted)

    @property
    def tau(self) -> int:
        """Accepted length, counting the bonus token (>= 1)."""
        return self.accepted_tokens.shape[0] + 1

    @property
    def emitted_tokens(self) -> torch.Tensor:
        """[tau] int64: the tokens this step commits, accepted drafts then the bonus."""
        return torch.cat([self.accepted_tokens, torch.tensor([self.bonus_token])])


@dataclass(frozen=True)
class VerifyInput:
    """One request's per-step input to `verify_requests`."""

    tree: DraftTree
    target_logits: torch.Tensor  # [n, V]: row i is the target's next-token logits after node i
    params: SamplingParams
    choices: torch.Tensor | None = None  # [n] the target's token after each node, fixed beforehand (seeded)
    batch: SamplerBatch | None = None  # the step's batch as SGLang's sampler sees it (tie order); None: alone


@dataclass(frozen=True)
class KvSplit:
    """Which block nodes' KV (and hidden states) survive the step."""

    keep: torch.Tensor  # [tau] int64: root then accepted nodes, in path (= ascending) order
    free: torch.Tensor  # [n - tau] int64: every other node, ascending


# A step at one node: (node, its children) -> (accepted child, None) or (None, bonus token).
Step = Callable[[int, list[int]], tuple[int | None, int | None]]


class Draws(Protocol):
    """The randomness of sampled verification (a torch generator in serving; an enumerator in exact-law tests)."""

    def accept(self, p_x: torch.Tensor, q_x: torch.Tensor) -> bool:
        """True with probability min(1, p_x / q_x); never when p_x == 0."""

    def sample(self, p: torch.Tensor) -> int:
        """One token from p [V]."""


@dataclass(frozen=True)
class TorchDraws:
    generator: torch.Generator | None = None

    def accept(self, p_x: torch.Tensor, q_x: torch.Tensor) -> bool:
        return _accepts(p_x, q_x, self.generator)

    def sample(self, p: torch.Tensor) -> int:
        return _sample(p, self.generator)


def as_draws(source: "Draws | torch.Generator | None") -> Draws:
    return source if hasattr(source, "accept") else TorchDraws(source)


def verify(tree: DraftTree, target_logits: torch.Tensor, params: SamplingParams,
           generator: "Draws | torch.Generator | None" = None, choices: torch.Tensor | None = None,
           batch: SamplerBatch | None = None) -> VerifyResult:
    """tree with n nodes, target_logits [n, V] -> VerifyResult. Greedy params take the path of the token plain
    decoding picks in `batch` (sgl_dspark.sampling); `choices` [n] (the target's token after each node, drawn
    without looking at the drafts) are matched the same way. Sampled params draw from SGLang's distribution."""
    _check_logits(tree, target_logits)
    if choices is not None:
        return verify_choices(tree, choices)
    if params.is_greedy:
        return verify_greedy(tree, target_logits, batch)
    return verify_sampling(tree, target_probs(target_logits, params, batch), generator)


def verify_requests(inputs: Sequence[VerifyInput],
                 generator: "Draws | torch.Generator | None" = None) -> list[VerifyResult]:
    """Verify every request of a step, in order, drawing from one generator."""
    return [verify(x.tree, x.target_logits, x.params, generator, x.choices, x.batch) for x in inputs]


def verify_greedy(tree: DraftTree, target_logits: torch.Tensor, batch: SamplerBatch | None = None) -> VerifyResult:
    """Accept the first child whose token is the target's greedy choice at its parent (the argmax in an all-greedy
    batch); bonus = that choice at the last node."""
    return verify_choices(tree, greedy_choices(target_logits, batch))


def verify_choices(tree: DraftTree, choices: torch.Tensor) -> VerifyResult:
    """choices [n]: the target's token after each node. Accept the first child whose token is its parent's
    choice; the bonus is the last accepted node's choice."""
    best, tokens = choices.tolist(), tree.tokens.tolist()

    def step(node: int, kids: list[int]) -> tuple[int | None, int | None]:
        match = next((c for c in kids if tokens[c] == best[node]), None)
        return (match, None) if match is not None else (None, best[node])

    return _walk(tree, step)


def verify_sampling(tree: DraftTree, probs: torch.Tensor,
                    generator: "Draws | torch.Generator | None" = None) -> VerifyResult:
    """tree, probs [n, V] (target distributions after each node) -> VerifyResult, distributed as the target.

    Multi-candidate speculative sampling: at each node the children are tried in index order, child c
    accepted with min(1, p(c) / q_c(c)), and after a rejection p <- normalize(max(0, p - q_c)). Exact as
    long as each child's draft_probs row is the distribution its token was drawn from given the earlier
    siblings (one-hot for a deterministic candidate; i.i.d. or without-replacement sampling both qualify).
    A lone root (nothing drafted) needs no draft_probs: its token is drawn from p.
    """
    draws = as_draws(generator)
    if tree.size == 1:
        return _result(tree, [], draws.sample(normalized(probs[0])))
    if tree.draft_probs is None:
        raise ValueError("verify_sampling: the tree has no draft_probs (only greedy verification is possible)")
    if tree.draft_probs.shape != probs.shape:
        raise ValueError(f"verify_sampling: draft_probs {tuple(tree.draft_probs.shape)} "
                         f"vs target probs {tuple(probs.shape)}")
    tokens = tree.tokens.tolist()

    def step(node: int, kids: list[int]) -> tuple[int | None, int | None]:
        return _try_children(normalized(probs[node]), kids, tokens, tree.draft_probs, draws)

    return _walk(tree, step)


def kv_split(result: VerifyResult, tree_size: int) -> KvSplit:
    """Keep the root and the accepted path; free the rest. The bonus has no KV yet (it is the next anchor)."""
    keep = torch.cat([torch.tensor([0]), result.accepted_nodes])
    is_free = torch.ones(tree_size, dtype=torch.bool)
    is_free[keep] = False
    return KvSplit(keep=keep, free=is_free.nonzero().flatten())


def residual(p: torch.Tensor, q: torch.Tensor) -> torch.Tensor:
    """p, q [..., V] (float64, each row summing to 1) -> normalize(max(0, p - q)) per row; p itself only where that
    has no mass at all (p == q up to float64 rounding, so the rejection that led here had probability ~1e-16). Any
    positive mass is used as it is: a threshold would draw from p where the law needs the residual
    (p = (.5 + 4e-7, .5 - 4e-7), q = (.5, .5) must give token 0 after a rejection, always)."""
    r = (p - q).clamp_min(0.0)
    mass = r.sum(-1, keepdim=True)
    return torch.where(mass > 0, r / mass.clamp_min(torch.finfo(r.dtype).tiny), p)


def children(parents: torch.Tensor) -> list[list[int]]:
    """parents [n] -> each node's children in index order. Example: [-1, 0, 0, 1] -> [[1, 2], [3], [], []]."""
    kids: list[list[int]] = [[] for _ in range(parents.shape[0])]
    for i, parent in enumerate(parents.tolist()[1:], start=1):
        kids[parent].append(i)
    return kids


def _walk(tree: DraftTree, step: Step) -> VerifyResult:
    """Follow accepted children from the root until a step returns the bonus token."""
    kids = children(tree.parents)
    path, node = [], 0
    while True:
        child, bonus = step(node, kids[node])
        if child is None:
            return _result(tree, path, bonus)
        path.append(child)
        node = child


def _try_children(p: torch.Tensor, kids: list[int], tokens: list[int], draft_probs: torch.Tensor,
                  draws: Draws) -> tuple[int | None, int | None]:
    """p [V] float64 at one node -> (accepted child, None), or (None, bonus drawn from the final residual)."""
    for c in kids:
        q = normalized(draft_probs[c])
        x = tokens[c]
        if not q[x] > 0:  # also a NaN row (no mass)
            raise ValueError(f"verify_sampling: node {c} has token {x} with draft probability 0")
        if draws.accept(p[x], q[x]):
            return c, None
        p = residual(p, q)
    return None, draws.sample(p)


def normalized(p: torch.Tensor) -> torch.Tensor:
    """Float32 rows [..., V] as the float64 distributions they stand for (what multinomial draws from): a float32
    row sums to 1 only to ~1e-7, which would bias the residual by as much. An all-zero row stays zero."""
    p = p.double()
    return p / p.sum(-1, keepdim=True).clamp_min(torch.finfo(torch.float64).tiny)


def _accepts(p_x: torch.Tensor, q_x: torch.Tensor, generator: torch.Generator | None) -> bool:
    """True with probability min(1, p_x / q_x); never when p_x == 0."""
    u = torch.rand((), generator=generator, device=p_x.device, dtype=p_x.dtype)
    return bool(u * q_x < p_x)


def _sample(p: torch.Tensor, generator: torch.Generator | None) -> int:
    """One token from p [V]."""
    return int(torch.multinomial(p, 1, generator=generator))


def _result(tree: DraftTree, path: list[int], bonus: int) -> VerifyResult:
    nodes = torch.tensor(path, dtype=torch.long)
    return VerifyResult(accepted_nodes=nodes, accepted_tokens=tree.tokens[nodes].long(),
                        bonus_token=int(bonus), last_node=path[-1] if path else 0)


def _check_logits(tree: DraftTree, target_logits: torch.Tensor) -> None:
    if target_logits.dim() != 2 or target_logits.shape[0] != tree.size:
        raise ValueError(f"verify: target_logits must be [n={tree.size}, V], got {tuple(target_logits.shape)}")
