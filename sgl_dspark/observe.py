"""Observability of the DSpark worker: per-step statistics, the periodic decode log line, failure counts.

Owns only counting and reporting; must not change what the worker does.
"""

import logging
from dataclasses import dataclass, field

logger = logging.getLogger("sgl_dspark")


@dataclass(frozen=True)
class StepStats:
    drafted: list[int]  # draft nodes per request, before scheduling
    verified: list[int]  # verify rows per request (root included)
    accepted: list[int]  # tau per request (bonus included)
    draft_s: float  # drafting + scheduling wall time
    verify_s: float  # target forward wall time
    commit_s: float  # acceptance + KV commit wall time


@dataclass
class Totals:
    steps: int = 0
    requests: int = 0
    drafted: int = 0
    verified: int = 0
    accepted: int = 0
    draft_s: float = 0.0
    verify_s: float = 0.0
    commit_s: float = 0.0

    def add(self, s: StepStats) -> None:
        self.steps += 1
        self.requests += len(s.accepted)
        self.drafted += sum(s.drafted)
        self.verified += sum(s.verified) - len(s.verified)
        self.accepted += sum(s.accepted)
        self.draft_s += s.draft_s
        self.verify_s += s.verify_s
        self.commit_s += s.commit_s

    def line(self) -> str:
        n = max(self.requests, 1)
        correct = self.accepted - self.requests
        rate = correct / self.verified if self.verified else 0.0
        ms = 1000.0 / max(self.steps, 1)
        return (f"DSpark decode: steps={self.steps} accept_len={self.accepted / n:.2f} "
                f"draft_len={self.drafted / n:.2f} verify_len={self.verified / n:.2f} accept_rate={rate:.2f} "
                f"draft_ms={self.draft_s * ms:.1f} verify_ms={self.verify_s * ms:.1f} "
                f"commit_ms={self.commit_s * ms:.1f}")


@dataclass
class WorkerMetrics:
    log_interval: int = 40
    window: Totals = field(default_factory=Totals)
    draft_failures: int = 0

    @staticmethod
    def from_server_args(server_args) -> "WorkerMetrics":
        return WorkerMetrics(log_interval=int(getattr(server_args, "decode_log_interval", 40) or 40))

    def observe(self, stats: StepStats) -> None:
        self.window.add(stats)
        if self.window.steps >= self.log_interval:
            logger.info(self.window.line())
            self.window = Totals()

    def draft_worker_failed(self) -> None:
        self.draft_failures += 1
        logger.warning("draft worker unavailable: this step decodes without speculation")
