"""Observability of the DSpark worker: per-step statistics, the periodic decode log line, DSpark's own Prometheus
series, and the per-request counts SGLang carries from the scheduler to the tokenizer (and what they mean there).

Owns only counting and reporting; must not change what the worker does. Imports no SGLang: the seam that reads
these counts inside SGLang is scheduler_patch/metrics.py.
"""

import logging
import time
from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from sgl_dspark.draft_worker.client import CAUSES

logger = logging.getLogger("sgl_dspark")

# Prometheus bucket edges for per-request lengths (draft tokens verified; tokens accepted, bonus included).
LENGTH_BUCKETS = (0, 1, 2, 3, 4, 5, 6, 8, 10, 12, 16, 24, 32, 48, 64)


@dataclass(frozen=True)
class StepStats:
    drafted: list[int]  # draft nodes per request, before scheduling
    verified: list[int]  # verify rows per request (root included)
    accepted: list[int]  # tau per request (bonus included)
    draft_s: float  # drafting + scheduling wall time
    verify_s: float  # target forward wall time
    commit_s: float  # acceptance + KV commit wall time
    drafted_ahead: int = 0  # requests whose draft was made ahead (during the previous step's tail)
    speculated: list[bool] | None = None  # per request: the gate let it draft (None: all did)
    share_s: float = 0.0  # under TP: this rank's time in the plan's broadcast (inside draft_s), 0 without TP
    lookup_tokens: int = 0  # accepted tokens only the lookup proposed (the request's context or the suffix cache)
    between_s: float | None = None  # since the previous decode step ended (SGLang's work between the two); None
    # for the first decode step after a prefill

    @property
    def speculating(self) -> int:
        """Requests that drafted this step."""
        return len(self.accepted) if self.speculated is None else sum(self.speculated)


@dataclass
class StepClock:
    """When one decode step started, finished drafting (draft, plan, pack) and finished the target's verify forward;
    the worker marks the two ends between its named steps, never inside them."""

    clock: Callable[[], float] = time.perf_counter
    start: float = field(init=False)
    drafted: float = field(init=False)
    verified: float = field(init=False)

    def __post_init__(self) -> None:
        self.start = self.drafted = self.verified = self.clock()

    def mark_drafted(self) -> None:
        self.drafted = self.clock()

    def mark_verified(self) -> None:
        self.verified = self.clock()

    @property
    def draft_s(self) -> float:
        return self.drafted - self.start

    @property
    def verify_s(self) -> float:
        return self.verified - self.drafted

    def since_verified(self) -> float:
        """Seconds from the end of the verify forward to now (acceptance, commit and the step's tail)."""
        return self.clock() - self.verified


# -- per-request counts: worker -> SGLang's GenerationBatchResult -> Req -> tokenizer meta_info ---------------

def result_counts(drafted: list[int], verify_rows: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """GenerationBatchResult's (cap_lens, block_accept_lens) for one decode step, both [bs] int32.

    cap_lens is the verify window (root included: SGLang's cap-length convention, "incl the bonus slot"), so
    SGLang's `spec_cap_length` means the same for DSPARK as for its builtin; block_accept_lens carries the draft
    length before scheduling (SGLang shows it only in a ragged-verify mode we never run). SGLang sums both onto
    each request (spec_num_cap_tokens, spec_num_block_accept_tokens) and ships them to the tokenizer.
    """
    return verify_rows.to(torch.int32), torch.tensor(drafted, dtype=torch.int32)


@dataclass(frozen=True)
class RequestCounts:
    """One request's speculative sums over its verify steps, as the tokenizer receives them."""

    verify_ct: int  # verify steps
    completion_tokens: int  # output tokens (SGLang counts the prefill's token too)
    correct_drafts: int  # accepted draft tokens, bonus excluded
    window_tokens: int  # verify windows, root included (spec_num_cap_tokens)
    drafted_tokens: int  # draft lengths before scheduling (spec_num_block_accept_tokens)

    @property
    def verified_drafts(self) -> int:
        return self.window_tokens - self.verify_ct


def accept_rate(correct_drafts: float, verified_drafts: float) -> float:
    """Accepted drafts / verified drafts: the rate that stays right when the verify length varies per step."""
    return correct_drafts / verified_drafts if verified_drafts > 0 else 0.0


def request_meta(c: RequestCounts) -> dict[str, float | int]:
    """DSPARK's meta_info spec_* values for one finished request (c.verify_ct > 0).

    spec_accept_length keeps SGLang's definition for every algorithm (completion_tokens / verify steps), so
    DSPARK compares with the builtins; spec_num_proposed_drafts is the verified count, keeping SGLang's identity
    spec_accept_rate = spec_num_correct_drafts / spec_num_proposed_drafts.
    """
    steps = c.verify_ct
    return {
        "spec_verify_ct": steps,
        "spec_accept_length": c.completion_tokens / steps,
        "spec_mean_draft_length": c.drafted_tokens / steps,
        "spec_mean_verify_length": c.verified_drafts / steps,
        "spec_accept_rate": accept_rate(c.correct_drafts, c.verified_drafts),
        "spec_num_correct_drafts": c.correct_drafts,
        "spec_num_proposed_drafts": c.verified_drafts,
    }


# -- the worker's own reporting: the periodic log line and the Prometheus series --------------------------------

@dataclass
class Totals:
    steps: int = 0
    requests: int = 0
    drafted: int = 0
    verified: int = 0
    accepted: int = 0
    draft_failures: int = 0
    draft_s: float = 0.0
    verify_s: float = 0.0
    commit_s: float = 0.0
    share_s: float = 0.0
    between_s: float = 0.0  # summed over the steps that have it (`between_steps`)
    between_steps: int = 0
    drafted_ahead: int = 0
    speculated: int = 0  # request-steps that drafted
    spec_steps: int = 0  # steps in which some request drafted
    warned_causes: set[str] = field(default_factory=set)  # draft-worker failure causes warned about this window

    def add(self, s: StepStats) -> None:
        self.steps += 1
        self.requests += len(s.accepted)
        self.drafted += sum(s.drafted)
        self.verified += sum(s.verified) - len(s.verified)
        self.accepted += sum(s.accepted)
        self.draft_s += s.draft_s
        self.verify_s += s.verify_s
        self.commit_s += s.commit_s
        self.share_s += s.share_s
        if s.between_s is not None:
            self.between_s += s.between_s
            self.between_steps += 1
        self.drafted_ahead += s.drafted_ahead
        self.speculated += s.speculating
        self.spec_steps += s.speculating > 0

    def line(self) -> str:
        """Per request-step means (accept_len is tau, bonus included), per-step milliseconds of each phase, and the
        gate's shares: speculated (request-steps that drafted) and spec_steps (steps in which some request did);
        under TP, share_ms is the part of draft_ms spent broadcasting rank 0's plan (0.0 without TP); between_ms
        is the mean time from one decode step's end to the next one's start (SGLang's own work between them: output
        processing, scheduling), over the steps not right after a prefill."""
        n = max(self.requests, 1)
        rate = accept_rate(self.accepted - self.requests, self.verified)
        ms = 1000.0 / max(self.steps, 1)
        return (f"DSpark decode: steps={self.steps} accept_len={self.accepted / n:.2f} "
                f"draft_len={self.drafted / n:.2f} verify_len={self.verified / n:.2f} accept_rate={rate:.2f} "
                f"draft_ms={self.draft_s * ms:.1f} verify_ms={self.verify_s * ms:.1f} "
                f"commit_ms={self.commit_s * ms:.1f} drafted_ahead={self.drafted_ahead / n:.2f} "
                f"draft_failures={self.draft_failures} speculated={self.speculated / n:.2f} "
                f"spec_steps={self.spec_steps / max(self.steps, 1):.2f} share_ms={self.share_s * ms:.1f} "
                f"between_ms={1000.0 * self.between_s / max(self.between_steps, 1):.1f}")


class Series:
    """DSpark's series on SGLang's /metrics. The worker runs in SGLang's scheduler process, which inherits the
    prometheus multiprocess directory SGLang's HTTP server collects from; so the series are not registered in
    this process's registry (registry=None), they are written to that directory."""

    def __init__(self, labels: dict[str, str], registry=None):
        from prometheus_client import Counter, Gauge, Histogram

        names = tuple(labels)
        self.labels = labels
        self.verify_length = Histogram(
            "sglang:dspark_verify_length", "DSPARK draft tokens verified per request per step",
            names, buckets=LENGTH_BUCKETS, registry=registry).labels(**labels)
        self.accept_length = Histogram(
            "sglang:dspark_accept_length", "DSPARK tokens accepted per request per step (bonus included)",
            names, buckets=LENGTH_BUCKETS, registry=registry).labels(**labels)
        self.draft_failures = Counter(
            "sglang:dspark_draft_worker_failures", "DSPARK steps that found the draft worker unavailable, by cause",
            (*names, "cause"), registry=registry)
        for cause in CAUSES:  # every cause on /metrics from the start, at 0
            self.draft_failures.labels(**labels, cause=cause)

        def gauge(name: str, doc: str):  # the scheduler's latest value (multiprocess: the most recent write wins)
            return Gauge(name, doc, names, multiprocess_mode="mostrecent", registry=registry).labels(**labels)

        self.worker_generation = gauge("sglang:dspark_draft_worker_generation",
                                       "DSPARK draft worker restarts so far (0: the first worker)")
        self.worker_drafted = gauge("sglang:dspark_draft_worker_drafted_nodes",
                                    "DSPARK draft nodes (anchors excluded) the current draft worker produced")
        self.arena_bytes = gauge("sglang:dspark_draft_arena_bytes",
                                 "DSPARK shared-memory bytes held for the draft worker's arenas")
        self.lookup_entries = gauge("sglang:dspark_lookup_entries",
                                    "DSPARK requests with context-lookup state (dropped when they leave the batch)")
        self.suffix_tokens = gauge("sglang:dspark_suffix_cache_tokens",
                                   "DSPARK tokens of earlier requests' histories held by the suffix cache")
        self.request_steps = Counter(
            "sglang:dspark_request_steps", "DSPARK request decode steps, by whether the request drafted (the gate)",
            (*names, "speculated"), registry=registry)
        self.lookup_tokens = Counter(
            "sglang:dspark_lookup_accepted_tokens",
            "DSPARK accepted tokens only the lookup proposed (the request's own context or the suffix cache)",
            names, registry=registry).labels(**labels)
        self.steps = Counter(
            "sglang:dspark_steps", "DSPARK decode steps, by whether any request drafted (the gate)",
            (*names, "speculated"), registry=registry)
        for counter in (self.request_steps, self.steps):
            for value in ("true", "false"):
                counter.labels(**labels, speculated=value)

    def draft_failed(self, cause: str) -> None:
        self.draft_failures.labels(**self.labels, cause=cause).inc()

    def draft_worker_state(self, generation: int, drafted: int, arena_bytes: int, lookup_entries: int,
                           suffix_tokens: int) -> None:
        self.worker_generation.set(generation)
        self.worker_drafted.set(drafted)
        self.arena_bytes.set(arena_bytes)
        self.lookup_entries.set(lookup_entries)
        self.suffix_tokens.set(suffix_tokens)

    def observe(self, s: StepStats) -> None:
        for rows, tau in zip(s.verified, s.accepted):
            self.verify_length.observe(rows - 1)
            self.accept_length.observe(tau)
        self.request_steps.labels(**self.labels, speculated="true").inc(s.speculating)
        self.request_steps.labels(**self.labels, speculated="false").inc(len(s.accepted) - s.speculating)
        self.steps.labels(**self.labels, speculated="true" if s.speculating else "false").inc()
        self.lookup_tokens.inc(s.lookup_tokens)


@dataclass
class WorkerMetrics:
    log_interval: int = 40  # decode steps per log line: SGLang's --decode-log-interval
    window: Totals = field(default_factory=Totals)
    draft_failures: int = 0
    failures_by_cause: dict[str, int] = field(default_factory=dict)
    series: Series | None = None  # only with --enable-metrics

    @staticmethod
    def create(log_interval: int, labels: dict[str, str] | None) -> "WorkerMetrics":
        """labels label DSpark's Prometheus series (the model's name, the DP replica's rank); None: no series
        (SGLang's metrics are off, or a TP rank that does not plan)."""
        series = None if labels is None else Series(labels)
        return WorkerMetrics(log_interval=log_interval, series=series)

    def observe(self, stats: StepStats) -> None:
        self.window.add(stats)
        if self.series is not None:
            self.series.observe(stats)
        if self.window.steps >= self.log_interval:
            logger.info(self.window.line())
            self.window = Totals()

    def draft_worker_failed(self, cause: str = "unknown", message: str = "") -> None:
        """Counted every time, per cause (DraftWorkerUnavailable.cause); warned once per cause per log window, with
        the exception's message, so a dead draft worker does not flood the log."""
        self.draft_failures += 1
        self.failures_by_cause[cause] = self.failures_by_cause.get(cause, 0) + 1
        self.window.draft_failures += 1
        if self.series is not None:
            self.series.draft_failed(cause)
        if cause not in self.window.warned_causes:
            self.window.warned_causes.add(cause)
            logger.warning("draft worker unavailable (%s%s): decoding without speculation while it is "
                           "(%d failures so far, %d %s)", cause, f": {message}" if message else "",
                           self.draft_failures, self.failures_by_cause[cause], cause)

    def draft_worker_state(self, generation: int, drafted: int, arena_bytes: int = 0, lookup_entries: int = 0,
                           suffix_tokens: int = 0) -> None:
        """The draft side's state on /metrics: the client's generation (restarts), the draft nodes the current worker
        produced (its own count), the shared-memory bytes of its arenas, the requests holding lookup state, the
        suffix cache's tokens. Called every step; only with metrics on."""
        if self.series is not None:
            self.series.draft_worker_state(generation, drafted, arena_bytes, lookup_entries, suffix_tokens)
