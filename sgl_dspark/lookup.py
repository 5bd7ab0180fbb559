"""Lookup proposer: draft chains copied from a request's own history (prompt lookup / suffix match), and the
online estimate of how often such copies are accepted.

Owns the per-request n-gram index (updated incrementally as tokens arrive), the candidate chains it proposes,
the acceptance statistics that turn into lookup confidences, and the registry of both keyed by request id.
Pure Python/torch on CPU; must not build trees (sgl_dspark.graft does), verify, or import SGLang.
"""

from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Protocol

import torch


@dataclass(frozen=True)
class LookupKnobs:
    """The serving defaults of width, max_len and max_nodes are the knobs lookup_width, lookup_max_len and
    lookup_max_nodes of configs/default.json (a unit test keeps them equal)."""

    max_ngram: int = 4  # longest suffix matched
    min_ngram: int = 1  # shortest suffix matched
    width: int = 2  # most distinct candidate chains per step
    max_len: int = 8  # tokens per candidate chain
    max_nodes: int = 16  # most tree nodes the lookup may add per request and step (see graft)
    probe: int = 8  # most earlier occurrences looked at per suffix length
    prior_accept: float = 0.5  # acceptance rate assumed before anything is observed
    prior_strength: float = 2.0  # pseudo-trials behind that assumption (global table)
    request_strength: float = 4.0  # pseudo-trials the global estimate lends each request's own table
    decay: float = 0.98  # per observed step, how much of a request's past counts it keeps

    def __post_init__(self) -> None:
        if not 1 <= self.min_ngram <= self.max_ngram:
            raise ValueError(f"lookup: need 1 <= min_ngram ({self.min_ngram}) <= max_ngram ({self.max_ngram})")
        if min(self.width, self.max_len, self.probe) < 1 or self.max_nodes < 0:
            raise ValueError("lookup: width, max_len and probe must be >= 1, max_nodes >= 0")
        if not 0.0 < self.prior_accept < 1.0 or not 0.0 < self.decay <= 1.0:
            raise ValueError("lookup: prior_accept must lie in (0, 1) and decay in (0, 1]")
        if self.prior_strength <= 0 or self.request_strength <= 0:
            raise ValueError("lookup: prior_strength and request_strength must be positive")

    @property
    def sizes(self) -> tuple[int, ...]:
        """Suffix lengths, longest first."""
        return tuple(range(self.max_ngram, self.min_ngram - 1, -1))

    @property
    def groups(self) -> int:
        return 3 * len(self.sizes)

    def group(self, rank: int, match: int, shared: bool = False) -> int:
        """Statistics group of a chain: the request's own first chain, its others, or the suffix cache's (other
        requests' histories), times its matched suffix length."""
        return (2 if shared else min(rank, 1)) * len(self.sizes) + (self.max_ngram - match)


@dataclass(frozen=True)
class Candidate:
    """One proposed continuation of the history (the anchor is history[-1], not part of it)."""

    tokens: tuple[int, ...]  # [<= max_len]
    match: int  # length of the suffix that matched
    rank: int  # position among this step's candidates (0 = longest, most recent match)
    shared: bool = False  # from the suffix cache (another request's history), not the request's own


class LookupIndex:
    """One request's history and, per suffix length n, each n-gram's most recent continuation start, with a
    link to the previous one. An n-gram is registered once the token after it exists, so the history's own
    suffix never matches itself."""

    def __init__(self, knobs: LookupKnobs):
        self.knobs = knobs
        self.tokens: list[int] = []
        self.last: list[dict[tuple[int, ...], int]] = [{} for _ in knobs.sizes]  # n-gram -> latest start
        self.prev: list[list[int]] = [[] for _ in knobs.sizes]  # [start] -> earlier start of the same n-gram, -1

    def __len__(self) -> int:
        return len(self.tokens)

    def append(self, tokens: Iterable[int]) -> None:
        old = len(self.tokens)
        self.tokens.extend(int(t) for t in tokens)
        toks, size = self.tokens, len(self.tokens)
        for i, n in enumerate(self.knobs.sizes):  # each new token is the start of the n-gram just before it
            last, prev, first = self.last[i], self.prev[i], min(max(old, n), size)
            prev.extend([-1] * (first - old))  # no n-gram fits before these starts
            for start, key in enumerate(zip(*(toks[first - n + j:size - n + j] for j in range(n))), first):
                prev.append(last.get(key, -1))
                last[key] = start

    def propose(self) -> list[Candidate]:
        """Distinct chains, longest suffix first, most recent occurrence first; at most `width`."""
        k, size = self.knobs, len(self.tokens)
        out: list[Candidate] = []
        seen: set[int] = set()
        for i, n in enumerate(k.sizes):
            start = self.last[i].get(tuple(self.tokens[size - n:]), -1) if size >= n else -1
            for _ in range(k.probe):
                if start < 0 or len(out) == k.width:
                    break
                if start not in seen:  # a longer suffix already matched here
                    seen.add(start)
                    chain = self.continuation(start)
                    if all(c.tokens != chain for c in out):
                        out.append(Candidate(chain, n, len(out)))
                start = self.prev[i][start]
        return out

    def continuation(self, start: int) -> tuple[int, ...]:
        """max_len tokens copied from `start`; past the end of the history the copy repeats itself (period
        len - start), which is what a loop in the history would do next.
        Example: history [5, 6, 7, 8, 5, 6], start 2, max_len 6 -> (7, 8, 5, 6, 7, 8)."""
        period = len(self.tokens) - start
        return tuple(self.tokens[start + j % period] for j in range(self.knobs.max_len))


@dataclass(frozen=True)
class LookupOutcome:
    """Lookup-proposed nodes verified in one step whose parent was accepted: one Bernoulli trial each."""

    group: torch.Tensor  # [m] int64
    depth: torch.Tensor  # [m] int64, >= 1
    accepted: torch.Tensor  # [m] bool


class LookupStats:
    """Beta-binomial acceptance rates per (group, depth) = P(lookup node accepted | parent accepted).

    The global table (prior=None) starts from Beta(prior_accept, prior_strength) and never forgets; a request's
    table lends `request_strength` pseudo-trials from the global mean, forgets with `decay`, and forwards every
    observation to the global table."""

    def __init__(self, knobs: LookupKnobs, prior: "LookupStats | None" = None):
        self.knobs, self.prior = knobs, prior
        self.accepts = torch.zeros(knobs.groups, knobs.max_len, dtype=torch.float64)  # [G, D]
        self.trials = torch.zeros(knobs.groups, knobs.max_len, dtype=torch.float64)  # [G, D]

    def observe(self, outcome: LookupOutcome) -> None:
        if outcome.group.shape[0] == 0:  # a step without lookup trials says nothing (and forgets nothing)
            return
        if self.prior is not None:
            self.prior.observe(outcome)
            self.accepts.mul_(self.knobs.decay)
            self.trials.mul_(self.knobs.decay)
        cell = self._cell(outcome.group, outcome.depth)
        self.trials.view(-1).index_add_(0, cell, torch.ones(cell.shape[0], dtype=torch.float64))
        self.accepts.view(-1).index_add_(0, cell, outcome.accepted.double())

    def mean(self) -> torch.Tensor:
        """[G, D] float64 posterior mean acceptance rate."""
        k = self.knobs
        if self.prior is None:
            return (self.accepts + k.prior_accept * k.prior_strength) / (self.trials + k.prior_strength)
        return (self.accepts + k.request_strength * self.prior.mean()) / (self.trials + k.request_strength)

    def conf(self, group: torch.Tensor, depth: torch.Tensor) -> torch.Tensor:
        """group [m], depth [m] -> confidence [m] float32 in (0, 1); depths past max_len share the last cell."""
        return self.mean().view(-1)[self._cell(group, depth)].float()

    def _cell(self, group: torch.Tensor, depth: torch.Tensor) -> torch.Tensor:
        return group.long() * self.knobs.max_len + depth.long().clamp(1, self.knobs.max_len) - 1


@dataclass
class LookupEntry:
    """One request's lookup state."""

    index: LookupIndex
    stats: LookupStats


class SharedHistories(Protocol):
    """Histories shared across requests (sgl_dspark.suffix.SuffixCache): they take a finished request's history
    and propose chains continuing another request's suffix."""

    def add(self, tokens: Sequence[int]) -> None: ...

    def propose(self, history: Sequence[int], taken: Sequence[Candidate], rank: int) -> list[Candidate]: ...


class LookupRegistry:
    """Per-request lookup state keyed by request id, plus the global acceptance prior shared by all and the suffix
    cache (None: off) that every request's history joins when it leaves the batch."""

    def __init__(self, knobs: LookupKnobs, suffix: SharedHistories | None = None):
        self.knobs, self.suffix = knobs, suffix
        self.prior = LookupStats(knobs)
        self.entries: dict[str, LookupEntry] = {}

    def sync(self, rid: str, prompt: Sequence[int], output: Sequence[int]) -> LookupEntry:
        """The entry of `rid` with its index caught up to prompt + output (only the new tail is indexed; a
        history shorter than the index, e.g. a retracted request, is re-indexed from scratch)."""
        entry = self.entries.get(rid)
        if entry is None or len(entry.index) > len(prompt) + len(output):
            stats = LookupStats(self.knobs, self.prior) if entry is None else entry.stats
            entry = self.entries[rid] = LookupEntry(LookupIndex(self.knobs), stats)
        seen = len(entry.index)
        if seen < len(prompt):
            entry.index.append(prompt[seen:])
        entry.index.append(output[max(seen - len(prompt), 0):])
        return entry

    def propose(self, rid: str) -> list[Candidate]:
        """The chains for `rid` this step: its own history's, then the suffix cache's (distinct from those)."""
        entry = self.entries[rid]
        own = entry.index.propose()
        return own if self.suffix is None else own + self.suffix.propose(entry.index.tokens, own, len(own))

    def retain(self, rids: Iterable[str]) -> None:
        """Drop every entry whose request is not in `rids` (finished or aborted requests); its history joins the
        suffix cache."""
        keep = set(rids)
        for rid in [r for r in self.entries if r not in keep]:
            if self.suffix is not None:
                self.suffix.add(self.entries[rid].index.tokens)
            del self.entries[rid]
