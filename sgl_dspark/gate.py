"""Speculation gate: before drafting, which requests speculate this step, so predicted tokens per second of the
whole step (drafting, verify forward, acceptance/commit, SGLang's share) never fall below plain decoding's.

Owns the whole-step cost model (`StepCosts`: linear parts refitted online beside the verify step-cost table),
each request's outlook (what speculating gave it lately) and the decision (`choose`). Pure torch on CPU; must not
draft, verify or import SGLang. Every input is from earlier steps, so the gate never looks at this step's tokens.
"""

import math
from dataclasses import dataclass, field, replace

import torch

from sgl_dspark.cost import StepCostTable
from sgl_dspark.packed_gemm import KernelTimes

FORGET = 0.97  # per observation: a linear cost part forgets old steps with this weight (half-life ~23 steps)
OUTLOOK_WEIGHT = 0.05  # per speculated step: weight of the newest outcome in a request's outlook (acceptance is bursty:
# a short memory gates requests in a dry spell and misses the burst after it)
PRIOR_WEIGHT = 0.05  # per speculated request-step: weight of the newest outcome in the batch-wide mean outlook
RECOVER = 0.02  # per gated step: share of the way a request's outlook moves back towards the batch-wide mean (so a
# request gated after a run of rejections does not stay gated on bursty acceptance, e.g. context lookup hits)
PROBE_EVERY = 16  # every this many steps, every request speculates (gated ones refresh their outlook together,
# so the drafting call's fixed cost is paid once for all of them)


@dataclass(frozen=True)
class LinearCost:
    """seconds(x) = intercept + slope * x, fitted by exponentially forgetting least squares on observed (x, y).

    Until two distinct x have been seen the slope is the prior's; the slope never goes below 0.
    Example: observe (0, 1.0) then (2, 2.0) with forget 1 -> intercept 1.0, slope 0.5.
    """

    prior_intercept: float
    prior_slope: float = 0.0
    forget: float = FORGET
    sums: tuple[float, float, float, float, float] = (0.0, 0.0, 0.0, 0.0, 0.0)  # w, wx, wy, wxx, wxy

    def observe(self, x: float, y: float) -> "LinearCost":
        if not (math.isfinite(x) and math.isfinite(y)):
            return self
        w, wx, wy, wxx, wxy = (s * self.forget for s in self.sums)
        return replace(self, sums=(w + 1.0, wx + x, wy + y, wxx + x * x, wxy + x * y))

    @property
    def coefficients(self) -> tuple[float, float]:
        w, wx, wy, wxx, wxy = self.sums
        if w <= 0:
            return self.prior_intercept, self.prior_slope
        mx, my = wx / w, wy / w
        var = wxx / w - mx * mx
        slope = max((wxy / w - mx * my) / var, 0.0) if var > 1e-9 * max(1.0, mx * mx) else self.prior_slope
        return max(my - slope * mx, 0.0), slope

    def seconds(self, x: torch.Tensor) -> torch.Tensor:
        """x [n] -> seconds [n] float64."""
        intercept, slope = self.coefficients
        return intercept + slope * x.to(torch.float64)


@dataclass(frozen=True)
class StepCosts:
    """One decode step's seconds as a function of (requests drafting k, batch tokens B, requests R)."""

    verify: StepCostTable  # the target's forward over B tokens (the verify budget's table, refitted by it)
    draft: LinearCost  # drafting + planning + packing when k >= 1 requests draft, by k (the call's fixed cost in
    # the intercept)
    floor: LinearCost  # planning + packing when none drafts, by requests
    tail: LinearCost  # acceptance + commit + observing, by batch tokens
    host: LinearCost  # SGLang's share between two decode steps, by requests
    kernels: KernelTimes | None = None  # plain SGLang's GEMM kernel against this server's (None: the same kernel)

    def seconds(self, drafting: torch.Tensor, batch_tokens: torch.Tensor, requests: int) -> torch.Tensor:
        """drafting [n], batch_tokens [n] -> whole-step seconds [n] float64."""
        r = torch.tensor([float(requests)])
        first = torch.where(drafting > 0, self.draft.seconds(drafting), self.floor.seconds(r))
        return first + self.verify.costs(batch_tokens) + self.tail.seconds(batch_tokens) + self.host.seconds(r)

    def plain_seconds(self, requests: int) -> float:
        """Plain SGLang's decode step of `requests` requests: this server's step without drafts, with plain's GEMM
        kernel in place of the one its target runs on (what the packed kernel saves or costs at that many rows)."""
        own = float(self.seconds(torch.zeros(1), torch.tensor([float(requests)]), requests)[0])
        if self.kernels is None:
            return own
        # never less than plain's GEMM pass alone (the refitted table may drift below the start-up timing)
        return max(own + self.kernels.saved(requests), self.kernels.plain.cost(requests))

    def besides_verify(self, drafted: int, requests: int) -> tuple[float, float]:
        """(seconds, seconds per batch token) the step costs besides the verify forward once `drafted` requests
        drafted: what the verify budget is priced with on top of the table."""
        first_and_host = self.seconds(torch.tensor([float(drafted)]), torch.zeros(1), requests) - self.verify.cost(0)
        return float(first_and_host[0]), self.tail.coefficients[1]

    def observed(self, drafting: int, requests: int, batch_tokens: int, draft_s: float, tail_s: float,
                 host_s: float | None) -> "StepCosts":
        """The model after one measured step (host_s None: not measured, e.g. a prefill came between)."""
        first = {"draft": self.draft.observe(drafting, draft_s)} if drafting else \
            {"floor": self.floor.observe(requests, draft_s)}
        host = {} if host_s is None else {"host": self.host.observe(requests, host_s)}
        return replace(self, tail=self.tail.observe(batch_tokens, tail_s), **first, **host)


def initial_costs(verify: StepCostTable, kernels: KernelTimes | None = None) -> StepCosts:
    """Before any step is measured: drafting ~10% of a one-token step per call, the rest small; refitted online.
    kernels: plain's GEMM kernel timed against the target's (start-up), when they differ."""
    return StepCosts(verify, draft=LinearCost(0.1 * verify.cost(1), 0.002), floor=LinearCost(0.001),
                     tail=LinearCost(0.002, 0.0005), host=LinearCost(0.005), kernels=kernels)


@dataclass(frozen=True)
class Outlook:
    """What speculating gave one request lately (exponential averages over its speculated steps)."""

    gain: float  # tokens per step beyond the one plain decoding gives (tau - 1)
    verified: float  # draft tokens verified per step


@dataclass(frozen=True)
class Decision:
    speculate: torch.Tensor  # [R] bool: requests that draft this step
    predicted_gain: float  # predicted tokens/s of the chosen step over plain decoding's (see `choose`)


def choose(outlooks: list[Outlook | None], costs: StepCosts, margin: float, probe: bool = False) -> Decision:
    """Requests ranked by outlook gain; the speculating set is the top k maximising predicted tokens per second of the
    whole step, if that beats plain decoding by `margin`: the faster of this server's step without drafts (k = 0)
    and plain SGLang's step (`StepCosts.plain_seconds`), so speculating is chosen only where it beats both. A
    request without an outlook yet speculates regardless, and on a probe step every request does. Example: one
    request, gain 1.0 at equal step cost -> it speculates (2 tokens per step against 1)."""
    r = len(outlooks)
    due = torch.tensor([probe or o is None for o in outlooks], dtype=torch.bool)
    gain = torch.tensor([0.0 if o is None else o.gain for o in outlooks], dtype=torch.float64)
    verified = torch.tensor([0.0 if o is None else o.verified for o in outlooks], dtype=torch.float64)
    order = torch.argsort(-gain, stable=True)
    k = torch.arange(r + 1, dtype=torch.float64)
    tokens = r + torch.cat([torch.zeros(1, dtype=torch.float64), torch.cumsum(gain[order], 0)])
    # the verify forward runs each request's root and verified nodes (no padding): the batch grows with the sum
    batch = r + torch.cat([torch.zeros(1, dtype=torch.float64), torch.cumsum(verified[order], 0)])
    theta = tokens / costs.seconds(k, batch, r)
    if not r:
        return Decision(due, 1.0)
    plain = max(float(theta[0]), r / costs.plain_seconds(r))  # tokens per second without speculating
    best = int(theta[1:].argmax()) + 1
    chosen = best if float(theta[best]) > (1.0 + margin) * plain else 0
    speculate = torch.zeros(r, dtype=torch.bool)
    speculate[order[:chosen]] = True
    return Decision(speculate | due, float(theta[chosen]) / plain)


@dataclass
class Gate:
    """Per-request outlooks and the whole-step cost model of one worker; `decide` before drafting, `observe` after."""

    costs: StepCosts
    margin: float
    outlooks: dict[str, Outlook] = field(default_factory=dict)
    prior: Outlook | None = None  # the mean outlook over every request's speculated steps
    steps: int = 0

    def decide(self, rids: list[str], verify: StepCostTable) -> Decision:
        self.costs = replace(self.costs, verify=verify)
        self.outlooks = {rid: self.outlooks[rid] for rid in rids if rid in self.outlooks}  # finished ones dropped
        self.steps += 1
        return choose([self.outlooks.get(rid) for rid in rids], self.costs, self.margin,
                      probe=self.steps % PROBE_EVERY == 0)

    def observe(self, step: "GatedStep") -> None:
        for rid, spec, tau, verified in zip(step.rids, step.speculated, step.accepted, step.verified):
            if spec:
                self.prior = next_outlook(self.prior, True, tau, verified, weight=PRIOR_WEIGHT)
            known = self.outlooks.get(rid) or (self.prior if spec else None)  # a new request starts from the mean
            if (outlook := next_outlook(known, spec, tau, verified, self.prior)) is not None:
                self.outlooks[rid] = outlook
        self.costs = self.costs.observed(sum(step.speculated), len(step.rids), sum(step.verified) + len(step.rids),
                                         step.draft_s, step.tail_s, step.host_s)


@dataclass(frozen=True)
class GatedStep:
    """What one decode step measured, for the gate."""

    rids: list[str]
    speculated: list[bool]  # per request: drafted this step
    accepted: list[int]  # per request: tau (bonus included)
    verified: list[int]  # per request: draft tokens verified
    draft_s: float  # drafting + planning + packing
    tail_s: float  # acceptance + commit + observing
    host_s: float | None  # SGLang's share since the previous decode step (None: a prefill came between)


def next_outlook(old: Outlook | None, speculated: bool, tau: int, verified: int, prior: Outlook | None = None,
                 weight: float = OUTLOOK_WEIGHT) -> Outlook | None:
    """A request's outlook after one step: a speculated step moves the averages by `weight` (the first sets them), a
    gated step moves them RECOVER of the way back to `prior` (none: it leaves them).
    Example: None, speculated, tau 3, verified 4 -> Outlook(2.0, 4.0)."""
    if not speculated:
        return old if old is None or prior is None else mix(old, prior, RECOVER)
    new = Outlook(float(tau - 1), float(verified))
    return new if old is None else mix(old, new, weight)


def mix(old: Outlook, new: Outlook, weight: float) -> Outlook:
    return Outlook((1 - weight) * old.gain + weight * new.gain, (1 - weight) * old.verified + weight * new.verified)
