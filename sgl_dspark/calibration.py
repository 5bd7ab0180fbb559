"""Confidence calibration: Sequential Temperature Scaling (STS) of the confidence head.

Owns the per-position temperatures, how they are applied, fitted (a grid search per position on the ECE of
the cumulative product, paper 3.2.1), reported (ECE and AUC before/after) and stored (JSON).
Pure torch; must not import SGLang or run the drafter (the rollouts it fits on are collected elsewhere).
"""

import json
import math
from dataclasses import asdict, dataclass, fields
from pathlib import Path

import torch

from sgl_dspark.jsonfile import read_json


def calibrate_confidence(conf: torch.Tensor, temperatures: torch.Tensor) -> torch.Tensor:
    """conf [..., k] raw confidences of draft positions 1..k; temperatures [>= k] -> calibrated [..., k].

    c' = sigmoid(logit(c) / T_j) at position j; T = 1 leaves c unchanged.
    """
    k = conf.shape[-1]
    logit = torch.logit(conf.float().clamp(1e-6, 1 - 1e-6))
    return torch.sigmoid(logit / temperatures[:k].to(logit))


DEFAULT_GRID = torch.logspace(-1, 1, 201, dtype=torch.float64)  # T in [0.1, 10], log-spaced, holds T = 1
DEFAULT_BINS = 15


@dataclass(frozen=True)
class CalibrationReport:
    """Per draft position k: the cumulative product prod_{i<=k} c_i against the event "first k accepted",
    over the rows with a confidence at every position <= k."""

    samples: tuple[int, ...]  # [k] rows scored at each position
    ece_before: tuple[float, ...]  # [k] expected calibration error, raw confidences
    ece_after: tuple[float, ...]  # [k] the same with the STS temperatures applied
    auc_before: tuple[float, ...]  # [k] rank AUC, raw (nan when one class is absent)
    auc_after: tuple[float, ...]  # [k] rank AUC, calibrated


@dataclass(frozen=True)
class Calibration:
    temperatures: torch.Tensor  # [k] float32, > 0: T_j for draft position j (1-based j = index + 1)
    report: CalibrationReport | None


def prefix_events(accepted: torch.Tensor, valid: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """accepted, valid [N, k] bool -> (event [N, k]: positions 1..k all accepted,
    scored [N, k]: positions 1..k all valid, so the row has the whole cumulative product at k).

    accepted[n, j] means position j was accepted given all before it were; after the first rejection its
    value no longer matters (the event is already false). valid[n, j] means the record has a confidence for
    position j: keep it True past a rejection when that confidence is known, or those rows drop out of the
    later positions and bias them towards acceptance.
    """
    event = torch.cumprod(accepted.long(), dim=-1).bool()
    scored = torch.cumprod(valid.long(), dim=-1).bool()
    return event, scored


def ece(prob: torch.Tensor, label: torch.Tensor, bins: int = DEFAULT_BINS) -> float:
    """Expected calibration error with equal-width bins: sum_b |sum of prob - sum of label in b| / n.
    Example: prob [0.1, 0.1, 0.9, 0.9], label [0, 0, 1, 0], 10 bins -> (0.2 + 0.8) / 4 = 0.25."""
    return float(ece_grid(prob[None], label, bins)[0])


def ece_grid(prob: torch.Tensor, label: torch.Tensor, bins: int = DEFAULT_BINS) -> torch.Tensor:
    """prob [G, n] (G candidate calibrations of the same n rows), label [n] -> ECE [G] float64."""
    prob = prob.to(torch.float64)
    n = max(prob.shape[1], 1)
    index = (prob * bins).long().clamp(0, bins - 1)
    pred_sum = torch.zeros(prob.shape[0], bins, dtype=torch.float64).scatter_add_(1, index, prob)
    label_sum = torch.zeros_like(pred_sum).scatter_add_(1, index, label.to(torch.float64).expand_as(prob))
    return (pred_sum - label_sum).abs().sum(1) / n


def auc(score: torch.Tensor, label: torch.Tensor) -> float:
    """Rank (Mann-Whitney) AUC, ties counted half; nan if a class is absent.
    Example: score [0.1, 0.4, 0.35, 0.8], label [0, 0, 1, 1] -> 0.75."""
    label = label.bool()
    pos, neg = int(label.sum()), int((~label).sum())
    if pos == 0 or neg == 0:
        return math.nan
    return (float(average_ranks(score)[label].sum()) - pos * (pos + 1) / 2) / (pos * neg)


def average_ranks(x: torch.Tensor) -> torch.Tensor:
    """x [n] -> 1-based ranks [n] float64, tied values sharing their mean rank. Example: [3, 1, 3] -> [2.5, 1, 2.5]."""
    values, order = torch.sort(x, stable=True)
    _, inverse, counts = torch.unique_consecutive(values, return_inverse=True, return_counts=True)
    ends = torch.cumsum(counts, 0).to(torch.float64)
    mean_rank = ends - (counts.to(torch.float64) - 1) / 2
    ranks = torch.empty(x.shape[0], dtype=torch.float64)
    ranks[order] = mean_rank[inverse]
    return ranks


def fit_sts(conf: torch.Tensor, accepted: torch.Tensor, valid: torch.Tensor, grid: torch.Tensor = DEFAULT_GRID,
            bins: int = DEFAULT_BINS) -> torch.Tensor:
    """Sequential Temperature Scaling (paper 3.2.1): conf, accepted, valid [N, k] -> temperatures [k] float32.

    Left to right, position k's temperature is the grid value minimising the ECE of the cumulative product
    (calibrated positions < k held fixed) against "first k accepted"; ties go to the value nearest T = 1,
    and a position with no scored row keeps T = 1.
    """
    check_records(conf, accepted, valid)
    event, scored = prefix_events(accepted, valid)
    logit = torch.logit(conf.to(torch.float64).clamp(1e-6, 1 - 1e-6))
    grid = grid.to(torch.float64)
    prefix = torch.ones(conf.shape[0], dtype=torch.float64)  # calibrated prod_{i<k} c_i
    temps = []
    for k in range(conf.shape[1]):
        rows = scored[:, k]
        candidates = prefix[rows] * torch.sigmoid(logit[rows, k][None, :] / grid[:, None])  # [G, n_k]
        errors = ece_grid(candidates, event[rows, k], bins)
        temps.append(_nearest_one(grid, errors) if bool(rows.any()) else 1.0)
        prefix = prefix * torch.sigmoid(logit[:, k] / temps[-1])
    return torch.tensor(temps, dtype=torch.float32)


def _nearest_one(grid: torch.Tensor, errors: torch.Tensor) -> float:
    """The grid value with the least error; among (numerically) equal errors, the one nearest T = 1."""
    best = errors <= errors.min() + 1e-12
    distance = torch.where(best, grid.log().abs(), torch.inf)
    return float(grid[distance.argmin()])


def calibration_report(conf: torch.Tensor, accepted: torch.Tensor, valid: torch.Tensor, temperatures: torch.Tensor,
                       bins: int = DEFAULT_BINS) -> CalibrationReport:
    """ECE and AUC per position of the raw and the calibrated cumulative products."""
    check_records(conf, accepted, valid)
    event, scored = prefix_events(accepted, valid)
    before = torch.cumprod(conf.to(torch.float64), dim=-1)
    after = torch.cumprod(calibrate_confidence(conf, temperatures).to(torch.float64), dim=-1)
    columns = [(scored[:, k], event[:, k], before[:, k], after[:, k]) for k in range(conf.shape[1])]
    return CalibrationReport(
        samples=tuple(int(rows.sum()) for rows, *_ in columns),
        ece_before=tuple(ece(b[rows], e[rows], bins) for rows, e, b, _ in columns),
        ece_after=tuple(ece(a[rows], e[rows], bins) for rows, e, _, a in columns),
        auc_before=tuple(auc(b[rows], e[rows]) for rows, e, b, _ in columns),
        auc_after=tuple(auc(a[rows], e[rows]) for rows, e, _, a in columns),
    )


def fit_calibration(conf: torch.Tensor, accepted: torch.Tensor, valid: torch.Tensor,
                    grid: torch.Tensor = DEFAULT_GRID, bins: int = DEFAULT_BINS) -> Calibration:
    """fit_sts, then its report on the same records (use held-out rollouts: the drafter's training data
    would understate its overconfidence)."""
    temperatures = fit_sts(conf, accepted, valid, grid, bins)
    return Calibration(temperatures, calibration_report(conf, accepted, valid, temperatures, bins))


def check_records(conf: torch.Tensor, accepted: torch.Tensor, valid: torch.Tensor) -> None:
    if conf.dim() != 2 or accepted.shape != conf.shape or valid.shape != conf.shape:
        raise ValueError(f"calibration records: conf, accepted, valid must all be [N, k], got "
                         f"{tuple(conf.shape)}, {tuple(accepted.shape)}, {tuple(valid.shape)}")
    if accepted.dtype != torch.bool or valid.dtype != torch.bool:
        raise ValueError(f"calibration records: accepted and valid must be bool, got {accepted.dtype}, {valid.dtype}")


def save_calibration(calibration: Calibration, path: str | Path) -> None:
    """Write {"temperatures": [...], "report": {...} | null}; nan is written as null."""
    report = None if calibration.report is None else {
        name: [None if isinstance(v, float) and math.isnan(v) else v for v in values]
        for name, values in asdict(calibration.report).items()}
    doc = {"temperatures": calibration.temperatures.tolist(), "report": report}
    Path(path).write_text(json.dumps(doc, indent=1) + "\n")


def load_calibration(path: str | Path) -> Calibration:
    """Read a file written by save_calibration; a bad file raises ValueError naming the file and the problem."""
    doc = read_json(path, "calibration", "fit one, or unset calibration")
    temps = doc.get("temperatures") if isinstance(doc, dict) else None
    if not isinstance(temps, list) or not temps or not all(
            isinstance(t, (int, float)) and not isinstance(t, bool) and math.isfinite(t) and t > 0 for t in temps):
        raise ValueError(f"calibration {path}: 'temperatures' must be a non-empty list of numbers > 0")
    return Calibration(torch.tensor(temps, dtype=torch.float32), _report_from_json(doc.get("report"), len(temps), path))


def _report_from_json(doc: object, k: int, path: str | Path) -> CalibrationReport | None:
    if doc is None:
        return None
    names = [f.name for f in fields(CalibrationReport)]
    if not isinstance(doc, dict) or sorted(doc) != sorted(names) or any(
            not isinstance(doc[n], list) or len(doc[n]) != k for n in names):
        raise ValueError(f"calibration {path}: 'report' must be null or hold {names}, each a list of {k} values")
    return CalibrationReport(**{n: tuple(math.nan if v is None else v for v in doc[n]) for n in names})


def drafter_temperatures(knob: str | None, drafter_path: str | Path) -> tuple[float, ...]:
    """The STS temperatures the server drafts with: from the calibration knob's file, else from the
    `calibration.json` that `python -m sgl_dspark.training.calibrate` wrote beside the drafter, else () (raw
    confidences). A bad file raises ValueError naming it."""
    beside = Path(drafter_path) / "calibration.json"
    path = knob if knob is not None else (beside if beside.is_file() else None)
    return () if path is None else tuple(load_calibration(path).temperatures.tolist())
