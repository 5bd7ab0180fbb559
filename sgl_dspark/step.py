"""One decode step's algorithm, without SGLang: `decode_step` runs draft -> plan -> pack -> verify forward (a
callable handed in) -> constrain -> accept -> commit record -> learn, in that order.

The SGLang worker (scheduler_patch/runtime/worker.py) describes each request of its batch as a `StepRequest`, holds
the step's collaborators in `StepParts`, and calls `decode_step` with its target's forward; the served-path law test
(tests/unit/test_served_law.py) and the step harness (tests/step_harness.py) call it with synthetic targets. What is
SGLang's (its Req and batch, the KV pools, the forward, custom logit processors, logprobs) stays in the worker.
"""

import logging
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field, replace
from typing import Any

import torch

from sgl_dspark.config import DSparkKnobs
from sgl_dspark.constraints import (Penalties, PathCounts, additive_rows, apply_scaling, bias_row, grammar_masks,
                                   scaling_rows)
from sgl_dspark.draft_worker.client import DraftBatch, DraftClient, DraftWorkerUnavailable
from sgl_dspark.gate import Decision, Gate
from sgl_dspark.graft import Grafted, graft, lookup_accepted, outcome
from sgl_dspark.acceptance import sample_chains, sample_trees
from sgl_dspark.layout import AcceptRows, VerifyRows, kv_moves, pack_trees, padded, verify_results
from sgl_dspark.lookup import LookupRegistry
from sgl_dspark.sampling import SamplerBatch, SamplingParams, greedy_choices, target_probs
from sgl_dspark.budget import PlanInput, BudgetPolicy
from sgl_dspark.seeded import seeded_choices
from sgl_dspark.step_ops import TORCH_OPS, StepOps
from sgl_dspark.tree import DraftTree, depths
from sgl_dspark.verify import VerifyResult

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class StepRequest:
    """One request as the decode step sees it (the worker builds it from SGLang's Req)."""

    rid: str
    prompt: Sequence[int]  # the request's input ids
    output: Sequence[int]  # generated so far; the last one is the step's anchor (not yet in the KV cache)
    seq_len: int  # tokens in the KV cache (the anchor's position)
    slots: torch.Tensor  # [>= seq_len] KV slots of its tokens (a view; the drafter reads the first seq_len)
    sampling: SamplingParams
    seed: int | None = None  # sampling_seed: its draws come from sgl_dspark.seeded, not the verifier's stream
    penalties: Penalties = field(default_factory=Penalties)
    logit_bias: dict[str, float] | None = None
    grammar: Any = None  # SGLang's grammar object (BaseGrammarObject's interface) or None
    custom: bool = False  # has a custom logit processor: verifies its anchor alone (the worker applies it)

    @property
    def anchor(self) -> int:
        return int(self.output[-1])


@dataclass
class StepParts:
    """What a decode step drafts and plans with, built once (the worker's, or a test's)."""

    config: DSparkKnobs
    client: DraftClient
    budget: BudgetPolicy
    lookup: LookupRegistry | None  # None: lookup off
    gate: Gate | None  # None: every request drafts every step
    vocab: int
    stride: int  # the KV width reserved per request: no block may have more rows
    draft_failed: Callable[[DraftWorkerUnavailable], None]  # counts and logs a draft-side fault
    # Under tensor parallelism every rank must verify one plan: shared(make) runs make() (draft -> pack) on the
    # planning rank and returns its DecodeStep on every rank. None: this process plans alone.
    shared: Callable[[Callable[[], "DecodeStep"]], "DecodeStep"] | None = None
    ops: StepOps = TORCH_OPS  # the batched ops acceptance and packing run (sgl_dspark.step_ops: Triton's on a GPU)


@dataclass
class DecodeStep:
    """What one decode step carries from drafting to commit."""

    trees: list[Grafted]  # selected (scheduled) blocks, one per request, with each node's provenance
    drafted: list[int]  # draft length per request before scheduling
    speculated: list[bool]  # per request: the gate let it draft this step
    rows: VerifyRows
    seq_lens: list[int]


@dataclass(frozen=True)
class Accepted:
    """A step's verdict: what SGLang and the commit read, on the logits' device, and the same paths on the host."""

    rows: AcceptRows  # on the logits' device
    host: AcceptRows  # on the CPU (one transfer): the commit's slot bookkeeping
    results: list[VerifyResult]  # per request, from `host`: lookup statistics, trace


# -- the step, in step order --------------------------------------------------------------------------------------

@dataclass(frozen=True)
class Verified:
    """What the target's verify forward hands the step: its outputs on the real rows (VerifyRows.real), [R, ...],
    which the step puts in the fixed width ([bs * width, ...], `in_width`) before reading them."""

    logits: torch.Tensor  # [R or bs * width, V] on the target's device (constrained in place by the step)
    hidden: torch.Tensor  # [R or bs * width, F] every verify row's features for the drafter
    output: Any = None  # the forward's own result (the worker's: SGLang's logits output, for logprobs)


def in_width(verified: Verified, rows: VerifyRows) -> Verified:
    """The forward's outputs on the real rows -> the same in the fixed width (padding rows zero)."""
    real, total = rows.real, rows.tokens.shape[0]
    return replace(verified, logits=padded(verified.logits, real, total), hidden=padded(verified.hidden, real, total))


@dataclass(frozen=True)
class Commit:
    """What a step keeps of its verify rows: each request's root and accepted path, moved to the front of its window
    (host tensors)."""

    kept: torch.Tensor  # [M] int64 flat verify rows kept (root first), request after request
    front: torch.Tensor  # [M] int64 the flat rows they end up in: the first accept_len rows of each window
    positions: torch.Tensor  # [M] int64 their positions (the drafter's context grows by these rows)
    move_dst: torch.Tensor  # [K] int64 flat rows whose KV is overwritten (rows already in place left out)
    move_src: torch.Tensor  # [K] int64 the rows it comes from


@dataclass(frozen=True)
class StepOutcome:
    step: DecodeStep
    verified: Verified
    verdict: Accepted
    commit: Commit
    lookup_tokens: int  # tokens lookup nodes got accepted this step


def decode_step(parts: StepParts, reqs: Sequence[StepRequest], forward: Callable[[DecodeStep], Verified],
                sampler: SamplerBatch, generator: torch.Generator,
                custom: Callable[[DecodeStep, torch.Tensor], None] | None = None) -> StepOutcome:
    """One decode step of `reqs`; `forward` runs the target on the step's verify rows, `custom` (the worker's custom
    logit processors) transforms the constrained logits in place before acceptance."""
    if parts.shared is None:
        step = draft_and_plan(parts, reqs)  # gate -> draft -> graft -> budget -> pack
    else:  # tensor parallelism: the planning rank's step, on every rank
        step = parts.shared(lambda: draft_and_plan(parts, reqs))
    verified = in_width(forward(step), step.rows)  # the target's verify forward, on the real rows
    constrain(step, reqs, verified.logits, parts.vocab)
    if custom is not None:
        custom(step, verified.logits)
    verdict = accept(step, reqs, verified.logits, sampler, generator, parts.stride, parts.ops)
    commit = commit_record(step, verdict.host)
    return StepOutcome(step, verified, verdict, commit, learn_lookup(parts.lookup, step, reqs, verdict.results))


def commit_record(step: DecodeStep, accepted: AcceptRows) -> Commit:
    """The host verdict -> the rows to keep and where they go.

    Example: width 4, seq_lens [10], accept_index [[0, 2, -1, -1]] -> kept [0, 2], front [0, 1], positions [10, 11],
    one move (dst 1, src 2)."""
    bs, width = accepted.accept_index.shape
    on = accepted.accept_index >= 0  # [bs, width]: the first accept_len entries of each request
    columns = torch.arange(width)
    front = (torch.arange(bs)[:, None] * width + columns)[on]
    positions = (torch.tensor(step.seq_lens, dtype=torch.long)[:, None] + columns)[on]
    dst, src = kv_moves(accepted, width)
    return Commit(accepted.accept_index[on], front, positions, dst, src)


# -- draft -> plan -> pack ---------------------------------------------------------------------------------------

def draft_and_plan(parts: StepParts, reqs: Sequence[StepRequest]) -> DecodeStep:
    speculate = speculating(parts, reqs)
    if not parts.config.drafts:  # max_verify 0: the verify path with the anchor alone
        blocks = [Grafted.plain(root_only(r, parts.vocab)) for r in reqs]
    else:
        blocks = with_lookup(parts, reqs, draft(parts, reqs, speculate))
    blocks = [Grafted.plain(root_only(r, parts.vocab)) if r.custom else g for g, r in zip(blocks, reqs)]
    plan = parts.budget.plan(plan_input(parts, blocks, sum(speculate)))
    selected = [g.select(keep) for g, keep in zip(blocks, plan.selections)]
    widest = max(g.tree.size for g in selected)
    if widest > parts.stride:  # never write past the KV SGLang reserved (launch.verify_tokens per request)
        logger.error("sgl-dspark: a block of %d rows exceeds the reserved verify width %d; this step verifies "
                     "no drafts", widest, parts.stride)
        selected = [Grafted.plain(root_only(r, parts.vocab)) for r in reqs]
    seq_lens = [r.seq_len for r in reqs]
    rows = pack_trees([g.tree for g in selected], seq_lens)
    return DecodeStep(selected, [g.tree.size - 1 for g in blocks], speculate, rows, seq_lens)


def speculating(parts: StepParts, reqs: Sequence[StepRequest]) -> list[bool]:
    """Per request: does it draft this step (the gate's choice; none without drafts, all without the gate; never
    a request with a custom logit processor)."""
    if not parts.config.drafts:
        return [False] * len(reqs)
    table = getattr(parts.budget, "cost_table", None)
    if parts.gate is None or table is None:
        return [not r.custom for r in reqs]
    decision: Decision = parts.gate.decide([r.rid for r in reqs], table)
    return [bool(s) and not r.custom for s, r in zip(decision.speculate, reqs)]


def root_only(req: StepRequest, vocab: int) -> DraftTree:
    """The block of a request that drafts nothing this step (plain decoding through the verify path); a sampled
    one carries its (unused) draft-probability row, so lookup nodes can still be grafted onto it."""
    probs = None if req.sampling.is_greedy else torch.zeros(1, vocab)
    return DraftTree.chain(torch.tensor([req.anchor]), torch.ones(1), probs)


def draft_batch(reqs: Sequence[StepRequest], seq_lens: Sequence[int], anchors: Sequence[int]) -> DraftBatch:
    """What the drafter needs of these requests, with their anchors at `seq_lens` (this step's, or the next's when
    drafting ahead)."""
    return DraftBatch(context_slots=tuple(r.slots[:n].long() for r, n in zip(reqs, seq_lens)),  # on their device
                      anchors=torch.tensor(list(anchors), dtype=torch.long),
                      anchor_positions=torch.tensor(list(seq_lens), dtype=torch.long),
                      sampling=tuple(r.sampling for r in reqs), rids=tuple(r.rid for r in reqs))


def draft(parts: StepParts, reqs: Sequence[StepRequest], speculate: list[bool]) -> list[DraftTree]:
    """The drafter's blocks for the speculating requests (one call), the anchor alone for the others; a draft-side
    fault leaves every request with its anchor alone (plain decoding), counted and logged."""
    trees = [root_only(r, parts.vocab) for r in reqs]
    chosen = [r for r, s in zip(reqs, speculate) if s]
    if not chosen:
        return trees
    try:
        drafted = parts.client.propose(draft_batch(chosen, [r.seq_len for r in chosen], [r.anchor for r in chosen]))
    except DraftWorkerUnavailable as exc:
        parts.draft_failed(exc)
        return trees
    for i, tree in zip([i for i, s in enumerate(speculate) if s], drafted):
        trees[i] = tree
    return trees


def with_lookup(parts: StepParts, reqs: Sequence[StepRequest], trees: list[DraftTree]) -> list[Grafted]:
    """Graft the request's own-context lookup chains, and the suffix cache's from other requests' histories, onto its
    tree (lookup knob): onto the drafter's, or onto the anchor alone where the gate held drafting back (lookup costs
    no drafter call; the verify budget prices its verification like any draft node's)."""
    if parts.lookup is None:
        return [Grafted.plain(t) for t in trees]
    entries = [parts.lookup.sync(r.rid, r.prompt, r.output) for r in reqs]
    parts.lookup.retain(r.rid for r in reqs)
    return [graft(t, parts.lookup.propose(r.rid), e.stats, parts.lookup.knobs.max_nodes)
            for t, e, r in zip(trees, entries, reqs)]


def plan_input(parts: StepParts, blocks: list[Grafted], drafted: int) -> PlanInput:
    """The verify budget is priced with the whole step: what drafting took and the gate's model of the
    rest (acceptance, commit, SGLang's share)."""
    trees = tuple(g.tree for g in blocks)
    if parts.gate is None:
        return PlanInput(trees)
    overhead_s, per_token_s = parts.gate.costs.besides_verify(drafted, len(blocks))
    return PlanInput(trees, overhead_s=overhead_s, overhead_per_token_s=per_token_s)


# -- constrain -> accept -> learn (on the verify forward's logits) -----------------------------------------------

def constrain(step: DecodeStep, reqs: Sequence[StepRequest], logits: torch.Tensor, vocab: int) -> None:
    """Plain decoding's logit transforms (penalties, grammar mask, logit bias) on every verify row as if its path
    had been generated (sgl_dspark.constraints), in place on `logits` ([bs * width, V]), so acceptance and
    logprobs both see them. Custom logit processors are the worker's (they are SGLang's objects)."""
    width = step.rows.width
    for b, (g, req) in enumerate(zip(step.trees, reqs)):
        rows = logits[b * width:b * width + g.tree.size]
        penalties, bias = req.penalties, bias_row(req.logit_bias, vocab)
        if penalties.active:
            counts = PathCounts.of(g.tree, req.output, vocab)
            if penalties.additive:
                rows += additive_rows(penalties, counts).to(rows.device)
            if penalties.scaling:
                apply_scaling(rows, scaling_rows(penalties, counts).to(rows.device))
        if req.grammar is not None:
            masks = req.grammar.allocate_vocab_mask(vocab_size=vocab, batch_size=g.tree.size, device="cpu")
            grammar_masks(req.grammar, g.tree, masks)
            req.grammar.apply_vocab_mask(rows, req.grammar.move_vocab_mask(masks, rows.device))
        if bias is not None:
            rows += bias.to(rows.device)


def accept(step: DecodeStep, reqs: Sequence[StepRequest], logits: torch.Tensor, sampler: SamplerBatch,
           generator: torch.Generator, stride: int, ops: StepOps = TORCH_OPS) -> Accepted:
    """Lossless acceptance of every request's block from its (constrained) verify rows [bs * width, V], on the
    logits' device, then the verdict on the host in one transfer."""
    rows = accept_on_device(step, reqs, logits, sampler, generator, stride, ops)
    host = rows.to_host()
    return Accepted(rows, host, verify_results(host, step.rows.width))


def accept_on_device(step: DecodeStep, reqs: Sequence[StepRequest], logits: torch.Tensor, sampler: SamplerBatch,
                     generator: torch.Generator, stride: int, ops: StepOps = TORCH_OPS) -> AcceptRows:
    """Requests whose token after each node is fixed without looking at the drafts (greedy; seeded, from
    sgl_dspark.seeded) match it, and sampled requests are accepted by speculative sampling with coins drawn first from
    `generator` (the VERIFY stream, sgl_dspark.streams): chains in one pass, trees (lookup siblings) depth by depth
    (sgl_dspark.acceptance). No loop over requests and nothing read back to the host (a seeded request's choices are
    computed on the logits' device too: its noise depends on the seed and positions only)."""
    width = step.rows.width
    logits = logits.view(len(reqs), width, -1)
    device = logits.device
    tokens = step.rows.tokens.view(-1, width).to(device)
    parents = step.rows.parents.to(device)
    choices = target_choices(step, reqs, logits, sampler)
    on_path = ops.matched_path(tokens, parents, step.rows.mask.to(device), step.rows.sizes, choices)
    sampled = [b for b, r in enumerate(reqs) if drawn(r)]
    if sampled:
        index = torch.tensor(sampled, device=device)
        coins = torch.rand(len(sampled), width, generator=generator, dtype=torch.float64).to(device)  # drawn first
        bonus_coins = torch.rand(len(sampled), generator=generator, dtype=torch.float64).to(device)
        probs, q = target_rows(reqs, logits, sampler, sampled), draft_rows(step, sampled, width, device)
        sizes = step.rows.sizes[sampled]
        trees = [step.trees[b].tree for b in sampled]
        if all(t.is_chain for t in trees):
            paths, bonus = sample_chains(tokens[index], sizes, probs, q, coins, bonus_coins)
        else:
            depth, fanout = tree_bounds(trees)
            paths, bonus = sample_trees(tokens[index], parents[index], sizes, probs, q, coins, bonus_coins, depth,
                                        fanout)
        on_path[index] = paths
        last = torch.where(paths, torch.arange(width, device=device), 0).amax(1, keepdim=True)  # the deepest
        choices[index] = torch.zeros_like(choices[index]).scatter(1, last, bonus[:, None])
    return ops.path_rows(tokens, on_path, choices, stride)


def tree_bounds(trees: Sequence[DraftTree]) -> tuple[int, int]:
    """(deepest node's depth, most children of one node) over the trees (host tensors)."""
    depth = max(int(depths(t.parents).max()) for t in trees)
    fanout = max(int(torch.bincount(t.parents[1:]).max()) if t.size > 1 else 0 for t in trees)
    return depth, fanout


def target_rows(reqs: Sequence[StepRequest], logits: torch.Tensor, sampler: SamplerBatch,
                chosen: list[int]) -> torch.Tensor:
    """[k, width, V] the target's sampling distribution after each row of the chosen requests (padding rows too)."""
    return torch.stack([target_probs(logits[b], reqs[b].sampling, sampler) for b in chosen])


def draft_rows(step: DecodeStep, chosen: list[int], width: int, device: torch.device) -> torch.Tensor:
    """[k, width, V] on `device` (the logits'): each chosen request's draft-probability rows, zero-padded to the
    width (a drafter on that device made them there: no host copy)."""
    probs = [step.trees[b].tree.draft_probs for b in chosen]
    out = torch.zeros(len(chosen), width, probs[0].shape[-1], device=device)
    for i, p in enumerate(probs):
        out[i, :p.shape[0]] = p
    return out


def drawn(req: StepRequest) -> bool:
    """The request's tokens are drawn by the verifier's generator (sampled, no seed of its own)."""
    return not req.sampling.is_greedy and req.seed is None


def target_choices(step: DecodeStep, reqs: Sequence[StepRequest], logits: torch.Tensor,
                   sampler: SamplerBatch) -> torch.Tensor:
    """logits [bs, width, V] -> [bs, width] the target's token after each node for greedy and seeded requests (the
    argmax, or the first of SGLang's sort in a batch that sorts; the seeded Gumbel-max choice), 0 for the others."""
    bs, width, vocab = logits.shape
    choices = torch.zeros(bs, width, dtype=torch.long, device=logits.device)
    greedy = [b for b, r in enumerate(reqs) if r.sampling.is_greedy]
    if len(greedy) == bs:
        choices[:] = greedy_choices(logits.view(-1, vocab), sampler).view(bs, width)
    elif greedy:
        index = torch.tensor(greedy, device=logits.device)
        choices[index] = greedy_choices(logits[index].view(-1, vocab), sampler).view(-1, width)
    positions = step.rows.positions.view(bs, width)
    for b, (g, req) in enumerate(zip(step.trees, reqs)):
        if req.seed is not None and not req.sampling.is_greedy:
            n = g.tree.size
            choices[b, :n] = seeded_choices(logits[b, :n], req.sampling, req.seed, positions[b, :n],
                                            sampler.filtered)
    return choices


def learn_lookup(lookup: LookupRegistry | None, step: DecodeStep, reqs: Sequence[StepRequest],
                 results: list[VerifyResult]) -> int:
    """Each request's lookup statistics learn what its grafted chains achieved; returns the tokens lookup nodes
    got accepted this step."""
    if lookup is None:
        return 0
    for g, result, req in zip(step.trees, results, reqs):
        lookup.entries[req.rid].stats.observe(outcome(g, result))
    return sum(lookup_accepted(g, r) for g, r in zip(step.trees, results))
