"""Verify budget: which drafted nodes of each request the target verifies in one step (paper 3.2.2, 5.2).

Owns the budget policy protocol (`plan`, `observe`) and its modes, chosen once by `make_budget`: "prefix"
(Algorithm 1 with its early stop, taken a level at a time: level k holds every request's k-th node, and the stop is
looked at only where a level is complete; each verified node costs one row of the verify batch, which runs every
request's real rows and no padding),
"lagged" (5.2: a global-argmax budget from confidences two steps old) and
"off" (verify all drafted). Pure torch on CPU; must not draft, verify, calibrate or import SGLang. Every mode
is non-anticipating: whether a node is verified never depends on that node's own token (paper appendix A).
"""

from collections import deque
from dataclasses import dataclass
from typing import Protocol

import torch

from sgl_dspark.config import DSparkKnobs
from sgl_dspark.cost import StepCostTable, refit
from sgl_dspark.tree import DraftTree

LAG_STEPS = 2  # the lagged budget uses the pool of this many plans ago (5.2: "two steps prior")


@dataclass(frozen=True)
class PlanInput:
    """One step's verify-budget input."""

    trees: tuple[DraftTree, ...]  # R requests' blocks (chain or tree), confidences already calibrated
    extra_tokens: int = 0  # tokens the same target step processes besides these blocks (e.g. a prefill chunk)
    overhead_s: float = 0.0  # seconds the whole step costs besides the verify forward (drafting, commit, SGLang)
    overhead_per_token_s: float = 0.0  # and per batch token (acceptance and commit grow with the rows)


@dataclass(frozen=True)
class VerifyPlan:
    selections: tuple[torch.Tensor, ...]  # R x [1 + verify_length_r] int64: sorted node indices, root 0 first
    verify_lengths: torch.Tensor  # [R] int64: draft nodes each request verifies
    batch_tokens: int  # B: rows the target step processes (each request's root and verified nodes, plus extra)
    expected_accepts: float  # tau: expected tokens committed by the step, bonus tokens included


@dataclass(frozen=True)
class StepResult:
    batch_tokens: int  # B the target step processed
    seconds: float  # its measured wall time


@dataclass(frozen=True)
class Knobs:
    min_verify: int  # draft nodes each request verifies regardless of the budget (when drafted)
    max_verify: int | None  # most draft nodes one request verifies (None: no cap)
    latency_target_s: float | None  # the step cost at the chosen B must not exceed this (None: no target)
    refit_alpha: float  # online cost-table refit weight per observed step (0: frozen)

    @staticmethod
    def from_config(config: DSparkKnobs) -> "Knobs":
        return Knobs(config.min_verify, config.max_verify, config.latency_target_s, config.cost_refit_alpha)


class BudgetPolicy(Protocol):
    def plan(self, batch: PlanInput) -> VerifyPlan: ...

    def observe(self, result: StepResult) -> None: ...


@dataclass(frozen=True)
class Candidates:
    """Every draft node (roots excluded) of a batch, in admission order: survival descending; ties go to the
    shallower node, then the lower request, then the lower node index, so a parent always precedes its child."""

    request: torch.Tensor  # [N] int64
    node: torch.Tensor  # [N] int64: index inside its request's tree
    survival: torch.Tensor  # [N] float64, non-increasing
    rank: torch.Tensor  # [N] int64: position among its own request's candidates (0 = first admissible)
    n_requests: int


@dataclass(frozen=True)
class Pool:
    """What a budget is chosen over: the forced nodes are in; the open nodes compete level by level
    (`level_sequence`), and a budget is one of the level ends."""

    batch_tokens: torch.Tensor  # [M + 1] int64: B after admitting the first i open nodes (every request's root and
    # admitted nodes, as the verify forward runs them, plus extra tokens)
    base_accepts: float  # tau with no open node: one per request (the bonus) + forced nodes' survival
    open_survival: torch.Tensor  # [M] float64, in level order
    level_ends: torch.Tensor  # [L + 1] int64: 0, then the number of open nodes admitted when each level is complete
    overhead_s: float = 0.0  # the whole step's seconds besides the verify forward (PlanInput)
    overhead_per_token_s: float = 0.0


def path_products(parents: torch.Tensor, conf: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """A forest: parents [N] (-1 at roots), conf [N] -> (survival [N] float64, depth [N] int64).

    Survival is the product of confidences from the root (excluded, counts 1) down to the node; computed by
    pointer jumping, so log2(depth) vectorised rounds. Example: [-1, 0, 0, 1], [1, .5, .4, .5] ->
    ([1, .5, .4, .25], [0, 1, 1, 2]).
    """
    root = parents < 0
    up = torch.where(root, torch.arange(parents.shape[0]), parents)
    surv = torch.where(root, 1.0, conf.to(torch.float64))
    depth = (~root).long()
    while not bool((up[up] == up).all()):  # invariant: surv[i] = product of conf on i .. up[i] (exclusive)
        surv, depth, up = surv * surv[up], depth + depth[up], up[up]
    return surv, depth


def candidates(trees: tuple[DraftTree, ...]) -> Candidates:
    """The batch's draft nodes with their survival, in admission order."""
    if not trees:
        empty = torch.zeros(0, dtype=torch.long)
        return Candidates(empty, empty, torch.zeros(0, dtype=torch.float64), empty, 0)
    sizes = torch.tensor([t.size for t in trees])
    offsets = torch.cumsum(sizes, 0) - sizes
    request = torch.repeat_interleave(torch.arange(len(trees)), sizes)
    parents = torch.cat([t.parents for t in trees])
    parents = torch.where(parents < 0, parents, parents + offsets[request])
    conf = torch.cat([t.confidence for t in trees]).to(torch.float64)
    draft = parents >= 0
    if bool(((conf[draft] < 0) | (conf[draft] > 1) | conf[draft].isnan()).any()):
        raise ValueError(f"verify budget: draft confidences must lie in [0, 1] (calibrated probabilities), got "
                         f"min {conf[draft].min().item()}, max {conf[draft].max().item()}")
    survival, depth = path_products(parents, conf)
    node = torch.arange(parents.shape[0]) - offsets[request]
    request, node, survival, depth = request[draft], node[draft], survival[draft], depth[draft]
    order = admission_order(survival, depth)
    rank = rank_within_request(request[order], len(trees))
    return Candidates(request[order], node[order], survival[order], rank, len(trees))


def admission_order(survival: torch.Tensor, depth: torch.Tensor) -> torch.Tensor:
    """[N] entries listed request-major then by node -> order [N]: survival descending, then depth ascending,
    then the listing order. Survival never grows along a path and depth breaks ties, so parents come first."""
    by_depth = torch.argsort(depth, stable=True)
    return by_depth[torch.argsort(-survival[by_depth], stable=True)]


def rank_within_request(request: torch.Tensor, n_requests: int) -> torch.Tensor:
    """request [N] (in admission order) -> rank [N]: how many earlier entries share the request.
    Example: [1, 0, 1, 1, 0] -> [0, 0, 1, 2, 1]."""
    grouped = torch.argsort(request, stable=True)
    counts = torch.bincount(request, minlength=n_requests)
    starts = torch.cumsum(counts, 0) - counts
    rank = torch.empty_like(request)
    rank[grouped] = torch.arange(request.shape[0]) - starts[request[grouped]]
    return rank


def eligible(cands: Candidates, knobs: Knobs) -> torch.Tensor:
    """[N] bool: within the request's max_verify cap (a prefix of its admission order, so prefix-closed)."""
    return torch.ones_like(cands.rank, dtype=torch.bool) if knobs.max_verify is None else cands.rank < knobs.max_verify


def level_sequence(cands: Candidates, open_: torch.Tensor) -> torch.Tensor:
    """open_ [N] bool -> [M] indices of the open nodes, level by level: level k holds every request's open node of
    rank k (its k-th by admission order), listed in admission order. A prefix of it is prefix-closed per request, and
    whether a node's level is admitted depends on its own request's higher-ranked nodes only, never on its
    descendants (appendix A). Example: open nodes of requests [0, 0, 1] (ranks 0, 1, 0) -> [0, 2, 1]."""
    index = open_.nonzero().squeeze(1)
    return index[torch.argsort(cands.rank[index], stable=True)]


def level_ends(ranks: torch.Tensor) -> torch.Tensor:
    """ranks [M] of a level sequence (non-decreasing) -> [L + 1]: 0 and the count admitted at each level's end.
    Example: [1, 1, 2, 3, 3] -> [0, 2, 3, 5]."""
    m = ranks.shape[0]
    inner = (ranks[1:] != ranks[:-1]).nonzero().squeeze(1) + 1
    return torch.cat([torch.zeros(1, dtype=torch.long), inner, torch.full((min(m, 1),), m, dtype=torch.long)])


def make_pool(cands: Candidates, forced: torch.Tensor, sequence: torch.Tensor, batch: PlanInput) -> Pool:
    base_accepts = cands.n_requests + float(cands.survival[forced].sum())
    return Pool(batch_rows(cands, forced, sequence, batch.extra_tokens), base_accepts, cands.survival[sequence],
                level_ends(cands.rank[sequence]), batch.overhead_s, batch.overhead_per_token_s)


def batch_rows(cands: Candidates, forced: torch.Tensor, sequence: torch.Tensor, extra: int) -> torch.Tensor:
    """[M + 1]: the verify forward's rows after admitting the first i open nodes of `sequence` (indices): every
    request's root, the forced nodes, i admitted nodes and the extra tokens (the forward runs real rows only).
    Example: 2 requests, no forced node, 3 open nodes -> [2, 3, 4, 5]."""
    base = cands.n_requests + int(forced.sum()) + extra
    return base + torch.arange(sequence.shape[0] + 1, dtype=torch.long)


def throughput(pool: Pool, table: StepCostTable) -> torch.Tensor:
    """[M + 1] float64: Theta_i = tau_i / seconds of the whole step after admitting the first i open nodes (Theta_0:
    none); the step's seconds are the verify forward's (the table) plus the pool's overhead (tau_i * SPS(B_i) when
    there is none)."""
    tau = pool.base_accepts + torch.cat([torch.zeros(1, dtype=torch.float64), torch.cumsum(pool.open_survival, 0)])
    batch = pool.batch_tokens
    return tau / (table.costs(batch) + pool.overhead_s + pool.overhead_per_token_s * batch)


def level_budget(pool: Pool, theta: torch.Tensor, choose) -> int:
    """Open nodes to admit: `choose` (early stop or global argmax) over Theta at the level ends only: a level (every
    request's next node) is admitted whole or not at all, so whether a node is verified depends on its own request's
    earlier nodes and the other requests' levels, never on its descendants."""
    return int(pool.level_ends[choose(theta[pool.level_ends])])


def early_stop_budget(theta: torch.Tensor) -> int:
    """Algorithm 1: admit while each admission raises Theta; stop at the first that does not.
    Example: [2.0, 2.9, 3.3, 3.2, 3.5] -> 2 (the later 3.5 is never looked at)."""
    drops = theta[1:] <= theta[:-1]
    return int(drops.int().argmax()) if bool(drops.any()) else theta.shape[0] - 1


def global_budget(theta: torch.Tensor) -> int:
    """Unconstrained search: the smallest i with the largest Theta_i. Lossless only on a pool that does not
    depend on the current step's tokens (the lagged mode); on the current pool it breaks appendix A."""
    return int(theta.argmax())


def latency_cap(pool: Pool, table: StepCostTable, target_s: float | None) -> int:
    """Most open nodes (of the level sequence) whose step cost stays within the target (forced ones are in)."""
    m = pool.open_survival.shape[0]
    if target_s is None:
        return m
    within = (table.costs(pool.batch_tokens) <= target_s).long().cumprod(0)
    return max(int(within.sum()) - 1, 0)


def make_plan(cands: Candidates, admitted: torch.Tensor, extra_tokens: int) -> VerifyPlan:
    """admitted [N] bool (prefix-closed per request) -> per-request sorted node indices with the root."""
    request, node = cands.request[admitted], cands.node[admitted]
    lengths = torch.bincount(request, minlength=cands.n_requests)
    nodes = node[torch.argsort(request * (int(node.max()) + 1 if node.numel() else 1) + node)]
    selections = tuple(torch.cat([torch.zeros(1, dtype=torch.long), part])
                       for part in torch.split(nodes, lengths.tolist()))
    tau = cands.n_requests + float(cands.survival[admitted].sum())
    return VerifyPlan(selections, lengths, cands.n_requests + int(lengths.sum()) + extra_tokens, tau)


class CostedBudget:
    """The shared shell of the budgeted modes: candidates -> forced / open split -> the mode's budget on the
    open nodes -> latency cap -> plan. A subclass only says how many open nodes to admit (`budget`)."""

    def __init__(self, knobs: Knobs, table: StepCostTable | None):
        if table is None:
            raise ValueError(f"verify budget {type(self).__name__} needs a step-cost table "
                             "(set cost_table or profile one)")
        self.knobs = knobs
        self.cost_table = table

    def plan(self, batch: PlanInput) -> VerifyPlan:
        cands = candidates(batch.trees)
        allowed = eligible(cands, self.knobs)
        forced = allowed & (cands.rank < self.knobs.min_verify)
        sequence = level_sequence(cands, allowed & ~forced & (cands.survival > 0))
        pool = make_pool(cands, forced, sequence, batch)
        count = min(self.budget(pool), latency_cap(pool, self.cost_table, self.knobs.latency_target_s))
        admitted = forced.clone()
        admitted[sequence[:count]] = True
        return make_plan(cands, admitted, batch.extra_tokens)

    def budget(self, pool: Pool) -> int:
        raise NotImplementedError

    def observe(self, result: StepResult) -> None:
        if self.knobs.refit_alpha > 0:
            self.cost_table = refit(self.cost_table, result.batch_tokens, result.seconds, self.knobs.refit_alpha)


class PrefixBudget(CostedBudget):
    """Paper Algorithm 1: greedy admission with the early stop (lossless on its own), a level at a time."""

    def budget(self, pool: Pool) -> int:
        return level_budget(pool, throughput(pool, self.cost_table), early_stop_budget)


class LaggedBudget(CostedBudget):
    """Paper 5.2: the budget K is the global argmax of Theta (at level ends) over the pool of `lag` plans ago, so it
    is known before this step's tokens exist (and may cross SPS cliffs); this step takes its first K open nodes. Until
    `lag` plans have been seen it falls back to the early stop (also lossless)."""

    def __init__(self, knobs: Knobs, table: StepCostTable | None, lag: int = LAG_STEPS):
        super().__init__(knobs, table)
        self.history: deque[Pool] = deque(maxlen=lag)

    def budget(self, pool: Pool) -> int:
        if len(self.history) == self.history.maxlen:
            old = self.history[0]
            k = level_budget(old, throughput(old, self.cost_table), global_budget)
        else:
            k = level_budget(pool, throughput(pool, self.cost_table), early_stop_budget)
        self.history.append(pool)
        return k


class VerifyAll:
    """"off": verify every drafted node (up to max_verify per request); no cost table needed."""

    def __init__(self, knobs: Knobs, table: StepCostTable | None = None):
        self.knobs = knobs

    def plan(self, batch: PlanInput) -> VerifyPlan:
        cands = candidates(batch.trees)
        return make_plan(cands, eligible(cands, self.knobs), batch.extra_tokens)

    def observe(self, result: StepResult) -> None:
        pass


BUDGETS: dict[str, type] = {"prefix": PrefixBudget, "lagged": LaggedBudget, "off": VerifyAll}


def make_budget(config: DSparkKnobs, table: StepCostTable | None) -> BudgetPolicy:
    """The mode is chosen here, once; the returned object never looks at the mode name again."""
    return BUDGETS[config.budget](Knobs.from_config(config), table)
