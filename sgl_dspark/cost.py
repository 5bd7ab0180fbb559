"""Step cost: seconds one target forward step takes for a batch of B tokens, and SPS(B) = 1 / cost(B).

Owns the cost-table record, its interpolation, profiling a step callable on the running hardware, the
online refit from measured steps, and the JSON file format. Pure Python/torch; must not import SGLang or
know what a step computes (the caller's callable does the work and any device synchronisation).
"""

import json
import math
import statistics
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from functools import cached_property
from pathlib import Path

import torch

from sgl_dspark.jsonfile import read_json

OUTLIER_RATIO = 2.0  # a refit sample is clipped to [pred / 2, pred * 2]: one hiccup moves the table little


@dataclass(frozen=True)
class StepCostTable:
    """Measured step cost at a few batch sizes; piecewise-linear between them, linear beyond the last.

    Below the first point the cost is held flat (a step never gets cheaper than the smallest one measured);
    above the last it follows the last segment's slope (never negative).
    """

    tokens: tuple[int, ...]  # [m] batch token counts, strictly increasing, >= 1
    seconds: tuple[float, ...]  # [m] seconds per target step at those counts, > 0, non-decreasing

    def __post_init__(self) -> None:
        problem = table_problem(self.tokens, self.seconds)
        if problem:
            raise ValueError(f"StepCostTable: {problem}")

    @cached_property
    def _points(self) -> tuple[torch.Tensor, torch.Tensor]:
        return torch.tensor(self.tokens, dtype=torch.float64), torch.tensor(self.seconds, dtype=torch.float64)

    def costs(self, batch_tokens: torch.Tensor) -> torch.Tensor:
        """batch_tokens [n] -> seconds [n] float64."""
        x, y = self._points
        b = batch_tokens.to(torch.float64)
        if x.shape[0] == 1:
            return y.expand_as(b).clone()
        i = (torch.searchsorted(x, b, right=True) - 1).clamp(0, x.shape[0] - 2)
        slope = (y[1:] - y[:-1]) / (x[1:] - x[:-1])  # [m-1]
        slope = torch.cat([slope[:-1], slope[-1:].clamp(min=0.0)])  # extrapolation never goes down
        out = y[i] + slope[i] * (b - x[i])
        return torch.where(b < x[0], y[0], out)

    def cost(self, batch_tokens: int) -> float:
        return float(self.costs(torch.tensor([batch_tokens]))[0])

    def sps(self, batch_tokens: torch.Tensor) -> torch.Tensor:
        """batch_tokens [n] -> steps per second [n] float64."""
        return 1.0 / self.costs(batch_tokens)


def table_problem(tokens: Sequence, seconds: Sequence) -> str | None:
    """The first thing wrong with a would-be table, as one line, or None."""
    if len(tokens) == 0 or len(tokens) != len(seconds):
        return f"tokens and seconds must be non-empty and equally long, got {len(tokens)} and {len(seconds)}"
    if not all(isinstance(t, int) and not isinstance(t, bool) and t >= 1 for t in tokens):
        return f"tokens must be integers >= 1, got {list(tokens)}"
    if any(b <= a for a, b in zip(tokens, tokens[1:])):
        return f"tokens must be strictly increasing, got {list(tokens)}"
    if not all(isinstance(s, (int, float)) and math.isfinite(s) and s > 0 for s in seconds):
        return f"seconds must be finite and > 0, got {list(seconds)}"
    if any(b < a for a, b in zip(seconds, seconds[1:])):
        return f"seconds must not decrease as tokens grow, got {list(seconds)}"
    return None


def nondecreasing(values: Sequence[float], weights: Sequence[float] | None = None) -> tuple[float, ...]:
    """Least-squares non-decreasing fit (pool adjacent violators). Example: [1, 3, 2, 4] -> [1, 2.5, 2.5, 4]."""
    blocks: list[list[float]] = []  # [mean, weight, count]
    for v, w in zip(values, weights or [1.0] * len(values)):
        blocks.append([float(v), float(w), 1])
        while len(blocks) > 1 and blocks[-2][0] > blocks[-1][0]:
            (m2, w2, n2), (m1, w1, n1) = blocks.pop(), blocks.pop()
            blocks.append([(m1 * w1 + m2 * w2) / (w1 + w2), w1 + w2, n1 + n2])
    return tuple(m for m, _, n in blocks for _ in range(n))


def from_measurements(tokens: Sequence[int], seconds: Sequence[float]) -> StepCostTable:
    """Noisy (tokens, seconds) points, one per distinct token count -> a table (sorted, made non-decreasing)."""
    pairs = sorted(zip(tokens, seconds))
    return StepCostTable(tuple(int(t) for t, _ in pairs), nondecreasing([s for _, s in pairs]))


def profile(step_fn: Callable[[int], object], token_counts: Sequence[int], repeats: int = 5, warmup: int = 1,
            clock: Callable[[], float] = time.perf_counter, budget_s: float | None = None) -> StepCostTable:
    """Time step_fn(n) for each token count n on this hardware: the median of `repeats` timed calls.

    step_fn must block until its step is done (e.g. call torch.cuda.synchronize() itself). With budget_s, counts
    are timed smallest first and none is started once budget_s has passed (the smallest is always timed); the
    table extrapolates beyond the last one timed.
    """
    if repeats < 1 or warmup < 0:
        raise ValueError(f"profile: repeats must be >= 1 and warmup >= 0, got {repeats} and {warmup}")
    counts = sorted(set(token_counts))
    medians = []
    began = clock()
    for n in counts:
        if medians and budget_s is not None and clock() - began >= budget_s:
            break
        for _ in range(warmup):
            step_fn(n)
        medians.append(statistics.median(_timed(step_fn, n, clock) for _ in range(repeats)))
    return from_measurements(counts[:len(medians)], medians)


def _timed(step_fn: Callable[[int], object], n: int, clock: Callable[[], float]) -> float:
    start = clock()
    step_fn(n)
    return clock() - start


def refit(table: StepCostTable, batch_tokens: int, seconds: float, alpha: float) -> StepCostTable:
    """Move the table towards one measured step (an exponentially weighted, outlier-clipped update).

    The residual against the interpolated prediction is shared between the two neighbouring points by
    their interpolation weights (at a table point this is a plain moving average of that point); outside
    the table the nearest end point takes it. The result is made non-decreasing again.
    """
    if not 0.0 <= alpha <= 1.0 or not math.isfinite(seconds) or seconds <= 0:
        raise ValueError(f"refit: need 0 <= alpha <= 1 and seconds > 0, got alpha={alpha}, seconds={seconds}")
    predicted = table.cost(batch_tokens)
    residual = min(max(seconds, predicted / OUTLIER_RATIO), predicted * OUTLIER_RATIO) - predicted
    new = list(table.seconds)
    for index, weight in _neighbour_weights(table.tokens, batch_tokens):
        new[index] = max(new[index] + alpha * weight * residual, 1e-12)
    return StepCostTable(table.tokens, nondecreasing(new))


def _neighbour_weights(tokens: Sequence[int], b: int) -> list[tuple[int, float]]:
    """Interpolation weights of batch size b on the table points. Example: ([2, 4], 3) -> [(0, .5), (1, .5)]."""
    if b <= tokens[0]:
        return [(0, 1.0)]
    if b >= tokens[-1]:
        return [(len(tokens) - 1, 1.0)]
    hi = next(i for i, t in enumerate(tokens) if t > b)
    u = (b - tokens[hi - 1]) / (tokens[hi] - tokens[hi - 1])
    return [(hi - 1, 1.0 - u), (hi, u)]


def save_cost_table(table: StepCostTable, path: str | Path, meta: dict | None = None) -> None:
    """Write {"tokens": [...], "seconds": [...], "meta": {...}} (meta: e.g. device name, date)."""
    doc = {"tokens": list(table.tokens), "seconds": list(table.seconds), "meta": meta or {}}
    Path(path).write_text(json.dumps(doc, indent=1) + "\n")


def load_cost_table(path: str | Path) -> StepCostTable:
    """Read a file written by save_cost_table; a bad file raises ValueError naming the file and the problem."""
    doc = read_json(path, "step-cost table", "profile one, or unset cost_table")
    if not isinstance(doc, dict) or not {"tokens", "seconds"} <= doc.keys():
        raise ValueError(f"step-cost table {path}: expected an object with 'tokens' and 'seconds' lists")
    tokens, seconds = doc["tokens"], doc["seconds"]
    problem = table_problem(tokens, seconds) if isinstance(tokens, list) and isinstance(seconds, list) else \
        "'tokens' and 'seconds' must be lists"
    if problem:
        raise ValueError(f"step-cost table {path}: {problem}")
    return StepCostTable(tuple(tokens), tuple(float(s) for s in seconds))
