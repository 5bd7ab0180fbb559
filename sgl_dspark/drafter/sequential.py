"""The sequential stage: grow each request's draft tree depth by depth from the shared parallel-pass hidden states.

Per depth k: confidence of every open branch (cheap, needs only h_k and x_{k-1}) -> admit branches by survival,
min/max window and node budget -> LM-head rows only for requests with an admitted branch -> Markov bias -> sample
-> optional siblings at low-confidence nodes. A greedy request's are deterministic alternatives (the next most
likely tokens, scored by their share of the mass the sampled token leaves). A sampled request's cannot be: an
alternative derived from the token just sampled and scored by it would make whether it (or its elder sibling, or
their subtrees) gets verified depend on that token, which breaks the lossless argument (sgl_dspark.verify). Its
siblings are instead further i.i.d. draws from the same draft distribution q, how many and their confidences
fixed from the parent's confidence before any is drawn (c * (1 - c)**j for the j-th), so recursive rejection over
them (sgl_dspark.acceptance.sample_trees) keeps the target law; with `sampled_trees` off its block is a chain.
Nodes are appended in topological order.
Depths every request drafts whatever the confidences are projected up front in one LM-head call (on a CPU that
costs about one depth's call: the matrix is read from memory once).
Must not run the backbone or touch SGLang.
"""

from dataclasses import dataclass

import torch

from sgl_dspark.calibration import calibrated
from sgl_dspark.drafter.knobs import DraftKnobs
from sgl_dspark.drafter.model import DSparkDrafter
from sgl_dspark.drafter.sampler import SampledRows, alternatives, sample_rows
from sgl_dspark.sampling import SamplingParams
from sgl_dspark.tree import DraftTree


@dataclass(frozen=True)
class Frontier:
    """Open branches: each row will receive one child at the current depth."""

    req: torch.Tensor  # [F] int64 request index
    parent: torch.Tensor  # [F] int64 parent node index in that request's tree
    prev: torch.Tensor  # [F] int64 parent's token (target id), x_{k-1}
    survival: torch.Tensor  # [F] float32 survival of the parent
    main: torch.Tensor  # [F] bool: on the request's main (first-child) chain
    state: torch.Tensor | None  # [F, r] recurrent state of the RNN head, else None

    @property
    def size(self) -> int:
        return self.req.shape[0]

    def to(self, device: torch.device) -> "Frontier":
        state = None if self.state is None else self.state.to(device)
        return Frontier(self.req.to(device), self.parent.to(device), self.prev.to(device),
                        self.survival.to(device), self.main.to(device), state)

    def take(self, rows: torch.Tensor) -> "Frontier":
        state = None if self.state is None else self.state[rows]
        return Frontier(self.req[rows], self.parent[rows], self.prev[rows], self.survival[rows], self.main[rows], state)


class TreeBuilder:
    """Accumulates one request's nodes; node 0 is the anchor."""

    def __init__(self, anchor: int, keep_probs: bool) -> None:
        self.tokens, self.parents, self.conf = [anchor], [-1], [1.0]
        self.probs: list[torch.Tensor | None] | None = [None] if keep_probs else None

    @property
    def size(self) -> int:
        return len(self.tokens)

    def add(self, token: int, parent: int, conf: float, probs: torch.Tensor | None) -> int:
        self.tokens.append(token)
        self.parents.append(parent)
        self.conf.append(conf)
        if self.probs is not None:
            self.probs.append(probs)
        return len(self.tokens) - 1

    def build(self, vocab_size: int) -> DraftTree:
        probs = None
        if self.probs is not None:  # on the drafter's device (the anchor's row is zeros)
            device = next((p.device for p in self.probs if p is not None), torch.device("cpu"))
            zero = torch.zeros(vocab_size, device=device)
            probs = torch.stack([zero if p is None else p.float().to(device) for p in self.probs])
        return DraftTree(torch.tensor(self.tokens), torch.tensor(self.parents),
                         torch.tensor(self.conf, dtype=torch.float32), probs)


@dataclass
class _Budget:
    """Per-request node budget; the main chain's remaining depths are reserved against side branches."""

    knobs: DraftKnobs
    used: list[int]
    main_alive: list[bool]

    def admit(self, req: int, main: bool, depth: int, survival: float) -> bool:
        k = self.knobs
        if not ((main and depth <= k.min_window) or survival >= k.survival_threshold):
            return False
        reserve = 0 if main or not self.main_alive[req] else k.max_window - depth
        if self.used[req] + 1 + reserve > k.max_nodes:
            return False
        self.used[req] += 1
        return True


def confidence(drafter: DSparkDrafter, hidden: torch.Tensor, prev: torch.Tensor,
               calibration: tuple[float, float]) -> torch.Tensor:
    """hidden [F, H], prev [F], (temperature, bias) -> calibrated c [F] (all ones without a confidence head)."""
    raw = drafter.confidence_logit(hidden, prev)
    if raw is None:
        return torch.ones(hidden.shape[0], device=hidden.device)
    return torch.sigmoid(raw) if calibration == (1.0, 0.0) else calibrated(raw.float(), *calibration)


def certain_depths(knobs: DraftKnobs) -> int:
    """Depths every request's main chain drafts whatever the confidences: all of them without a survival stop,
    else the min window (`_Budget.admit` admits those; the side-branch reserve keeps them within the budget)."""
    return knobs.max_window if knobs.survival_threshold == 0.0 else min(knobs.min_window, knobs.max_window)


def eager_logits(drafter: DSparkDrafter, hidden: torch.Tensor, depths: int) -> torch.Tensor | None:
    """hidden [B, gamma, H] -> U [B, depths, D] in one projection, or None when depths == 0. On a CPU the LM head
    is read from memory once per call, so one call for every certain depth costs about what one depth costs."""
    if depths == 0:
        return None
    b, _, h = hidden.shape
    return drafter.base_logits(hidden[:, :depths].reshape(b * depths, h)).view(b, depths, -1)


def step_logits(drafter: DSparkDrafter, hidden_k: torch.Tensor, frontier: Frontier,
                base_k: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor | None, int]:
    """hidden_k [B, H] -> (U_k + B(x_{k-1}) [F, D], next RNN state, LM-head rows projected here).
    U_k is projected once per request with an open branch, shared by all its branches; base_k [B, D] is U_k
    already projected for every request (then nothing is projected here)."""
    bias, state = drafter.markov_head.step(frontier.prev, hidden_k[frontier.req], frontier.state)
    if base_k is not None:
        return base_k.float()[frontier.req] + bias.float(), state, 0
    uniq, inv = torch.unique(frontier.req, return_inverse=True)
    base = drafter.base_logits(hidden_k[uniq])
    return base.float()[inv] + bias.float(), state, uniq.numel()


def admit(frontier: Frontier, conf: torch.Tensor, depth: int, budget: _Budget) -> torch.Tensor:
    """-> indices [F'] of the rows that draft a child at this depth (frontier is main-first per request)."""
    survival = (frontier.survival * conf).tolist()
    keep = []
    for i, (r, m) in enumerate(zip(frontier.req.tolist(), frontier.main.tolist())):
        ok = budget.admit(r, m, depth, survival[i])
        if m:
            budget.main_alive[r] = ok
        if ok:
            keep.append(i)
    return torch.tensor(keep, dtype=torch.long)


@dataclass(frozen=True)
class _Child:
    """A node just added; it opens a branch at the next depth."""

    req: int
    main: bool
    node: int
    token: int
    survival: float
    src: int  # frontier row it grew from (whose RNN state it inherits)


class _Grower:
    """Appends one depth's nodes to the trees and collects the next frontier."""

    def __init__(self, drafter: DSparkDrafter, builders: list[TreeBuilder], sampling: list[SamplingParams],
                 budget: _Budget, depth: int, generator: torch.Generator | None) -> None:
        self.drafter, self.builders, self.sampling, self.budget, self.depth = drafter, builders, sampling, budget, depth
        self.generator = generator
        self.rows: list[_Child] = []

    def children(self, frontier: Frontier, conf: torch.Tensor, tokens: torch.Tensor,
                 probs: torch.Tensor | None) -> None:
        """probs [F, V] q rows, or None when no request keeps them (all greedy)."""
        surv, c, toks = (frontier.survival * conf).tolist(), conf.tolist(), tokens.tolist()
        columns = zip(frontier.req.tolist(), frontier.parent.tolist(), frontier.main.tolist())
        for i, (r, parent, m) in enumerate(columns):
            row = None if self.builders[r].probs is None else probs[i]
            node = self.builders[r].add(toks[i], parent, c[i], row)
            self.rows.append(_Child(r, m, node, toks[i], surv[i], i))

    def siblings(self, frontier: Frontier, conf: torch.Tensor, logits: torch.Tensor, picked: SampledRows,
                 q: torch.Tensor | None, knobs: DraftKnobs) -> None:
        """Up to tree_width - 1 siblings of each low-confidence row's child: deterministic alternatives for a greedy
        request, i.i.d. draws from the child's q [F, V] for a sampled one (with `sampled_trees`)."""
        to_target, count = self.drafter.draft_to_target, knobs.tree_width - 1
        for i in (conf < knobs.branch_threshold).nonzero().flatten().tolist():
            r, parent, c_i = int(frontier.req[i]), int(frontier.parent[i]), float(conf[i])
            if self.sampling[r].is_greedy:
                ids, shares = alternatives(logits[i], int(picked.tokens[i]), count, self.sampling[r])
                confs, rows = [(1.0 - c_i) * s for s in shares.tolist()], None
            elif knobs.sampled_trees:  # drawn after their number and confidences are fixed (the lossless argument)
                ids = torch.multinomial(picked.probs[i], count, replacement=True, generator=self.generator)
                confs, rows = [c_i * (1.0 - c_i) ** j for j in range(1, count + 1)], q[i]
            else:
                continue
            for d, c in zip(ids.tolist(), confs):
                surv = float(frontier.survival[i]) * c
                if not self.budget.admit(r, False, self.depth, surv):
                    break
                token = d if to_target is None else int(to_target[d])
                node = self.builders[r].add(token, parent, c, rows)  # greedy requests keep no rows
                self.rows.append(_Child(r, False, node, token, surv, i))

    def next_frontier(self, state: torch.Tensor | None) -> Frontier:
        rows = sorted(self.rows, key=lambda c: (c.req, not c.main))  # stable: per request, main chain first

        def col(field: str, dtype: torch.dtype) -> torch.Tensor:
            return torch.tensor([getattr(c, field) for c in rows], dtype=dtype)

        src = col("src", torch.long)
        return Frontier(col("req", torch.long), col("node", torch.long), col("token", torch.long),
                        col("survival", torch.float32), col("main", torch.bool), None if state is None else state[src])


def _full_vocab(drafter: DSparkDrafter, probs: torch.Tensor, ids: torch.Tensor | None) -> torch.Tensor:
    """probs [F, D] over the draft vocabulary, ids [D] its target ids (None: the full vocabulary) -> [F, V];
    ids outside the map get exactly 0."""
    if ids is None:
        return probs
    full = probs.new_zeros(probs.shape[0], drafter.config.vocab_size)
    return full.index_copy_(1, ids.to(probs.device), probs)


def grow_trees(drafter: DSparkDrafter, hidden: torch.Tensor, anchors: torch.Tensor, sampling: list[SamplingParams],
               knobs: DraftKnobs, generator: torch.Generator | None = None) -> tuple[list[DraftTree], int]:
    """hidden [B, gamma, H] from one parallel pass, anchors [B], resolved knobs -> (one DraftTree per request,
    LM-head rows projected)."""
    b = hidden.shape[0]
    builders = [TreeBuilder(int(a), keep_probs=not p.is_greedy) for a, p in zip(anchors.tolist(), sampling)]
    budget = _Budget(knobs, [0] * b, [True] * b)
    state = drafter.markov_head.init_state(b, hidden[:, 0])
    frontier = Frontier(torch.arange(b), torch.zeros(b, dtype=torch.long), anchors.long().cpu(), torch.ones(b),
                        torch.ones(b, dtype=torch.bool), state).to(hidden.device)
    eager = certain_depths(knobs)
    base = eager_logits(drafter, hidden, eager)  # [B, eager, D]: every request drafts these depths
    lm_rows = b * eager
    to_target = drafter.draft_to_target
    keep_probs = any(bld.probs is not None for bld in builders)  # all greedy: no q rows to build
    for depth in range(1, knobs.max_window + 1):
        if frontier.size == 0:
            break
        h_k = hidden[:, depth - 1]
        conf = confidence(drafter, h_k[frontier.req], frontier.prev, knobs.calibration(depth))
        keep = admit(frontier, conf, depth, budget)
        frontier, conf = frontier.take(keep), conf[keep]
        if frontier.size == 0:
            break
        logits, state, rows = step_logits(drafter, h_k, frontier, None if depth > eager else base[:, depth - 1])
        lm_rows += rows
        picked = sample_rows(logits, [sampling[r] for r in frontier.req.tolist()], generator)
        tokens = picked.tokens if to_target is None else to_target[picked.tokens]
        grower = _Grower(drafter, builders, sampling, budget, depth, generator)
        q = _full_vocab(drafter, picked.probs, to_target) if keep_probs else None
        grower.children(frontier, conf, tokens, q)
        if knobs.tree_width > 1:
            grower.siblings(frontier, conf, logits, picked, q, knobs)
        frontier = grower.next_frontier(state).to(hidden.device)
    return [bld.build(drafter.config.vocab_size) for bld in builders], lm_rows
