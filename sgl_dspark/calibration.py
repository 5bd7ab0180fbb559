"""Confidence calibration of the confidence head: per draft position, a temperature and a bias on the logit.

c' = sigmoid(logit(c) / T_j + b_j) at draft position j. With b = 0 this is the paper's Sequential Temperature
Scaling (3.2.1); a temperature alone cannot remove a constant bias (a head that is 10 points too confident at every
confidence), the bias can. Owns how the pair is applied, fitted (per position, the log loss of "position j accepted
given all before it were", which Platt scaling minimises), reported (ECE and AUC of the cumulative product, the
survival the verify budget plans with, before/after; reliability bins) and stored (JSON).
Pure torch; must not import SGLang or run the drafter (the rollouts it fits on are collected elsewhere).
"""

import json
import math
from dataclasses import asdict, dataclass, fields
from pathlib import Path

import torch

from sgl_dspark.jsonfile import read_json


def calibrated(logit: torch.Tensor, temperature, bias=0.0) -> torch.Tensor:
    """The calibrated confidence of raw logits: sigmoid(logit / temperature + bias) (broadcasting)."""
    return torch.sigmoid(logit / temperature + bias)


def calibrate_confidence(conf: torch.Tensor, temperatures: torch.Tensor,
                         biases: torch.Tensor | None = None) -> torch.Tensor:
    """conf [..., k] raw confidences of draft positions 1..k; temperatures (and biases) [>= k] -> calibrated
    [..., k]. T = 1, b = 0 leave c unchanged."""
    k = conf.shape[-1]
    logit = torch.logit(conf.float().clamp(1e-6, 1 - 1e-6))
    bias = 0.0 if biases is None else biases[:k].to(logit)
    return calibrated(logit, temperatures[:k].to(logit), bias)


DEFAULT_BINS = 15


@dataclass(frozen=True)
class CalibrationReport:
    """Per draft position k: the cumulative product prod_{i<=k} c_i against the event "first k accepted",
    over the rows with a confidence at every position <= k."""

    samples: tuple[int, ...]  # [k] rows scored at each position
    ece_before: tuple[float, ...]  # [k] expected calibration error, raw confidences
    ece_after: tuple[float, ...]  # [k] the same calibrated
    auc_before: tuple[float, ...]  # [k] rank AUC, raw (nan when one class is absent)
    auc_after: tuple[float, ...]  # [k] rank AUC, calibrated


@dataclass(frozen=True)
class Calibration:
    temperatures: torch.Tensor  # [k] float32, > 0: T_j for draft position j (1-based j = index + 1)
    report: CalibrationReport | None
    biases: torch.Tensor | None = None  # [k] float32: b_j; None: all 0 (temperatures alone, as STS)

    @property
    def bias_values(self) -> torch.Tensor:
        return torch.zeros_like(self.temperatures) if self.biases is None else self.biases


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


FIT_STEPS = 50  # Newton steps per position (two parameters: a handful converge)
PRIOR = 1.0  # weight of the pull towards T = 1, b = 0 (one pseudo-row's worth: only matters with few rows)


def fit_platt(conf: torch.Tensor, accepted: torch.Tensor, valid: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """conf, accepted, valid [N, k] -> (temperatures [k], biases [k]) float32.

    Position j's pair minimises the log loss of sigmoid(logit(c_j) * s + b) against "j accepted" over the rows whose
    positions before j were all accepted and that have a confidence at j (the conditional event the survival's
    j-th factor predicts), plus PRIOR * ((log s)^2 + b^2); T = 1 / s. Fitted on log s, so T stays positive. A
    position with no such row keeps T = 1, b = 0.
    """
    check_records(conf, accepted, valid)
    event, scored = prefix_events(accepted, valid)
    logit = torch.logit(conf.to(torch.float64).clamp(1e-6, 1 - 1e-6))
    reached = torch.cat([torch.ones(conf.shape[0], 1, dtype=torch.bool), event[:, :-1]], 1) & scored
    pairs = [_fit_pair(logit[reached[:, j], j], accepted[reached[:, j], j].to(torch.float64))
             for j in range(conf.shape[1])]
    return (torch.tensor([1.0 / math.exp(u) for u, _ in pairs], dtype=torch.float32),
            torch.tensor([b for _, b in pairs], dtype=torch.float32))


def _fit_pair(x: torch.Tensor, y: torch.Tensor) -> tuple[float, float]:
    """(log s, b) minimising sum BCE(sigmoid(x e^u + b), y) + PRIOR (u^2 + b^2), by damped Newton steps."""
    theta = torch.zeros(2, dtype=torch.float64)

    def loss(t: torch.Tensor) -> torch.Tensor:
        z = x * t[0].exp() + t[1]
        return torch.nn.functional.binary_cross_entropy_with_logits(z, y, reduction="sum") + PRIOR * (t ** 2).sum()

    for _ in range(FIT_STEPS):
        grad = torch.autograd.functional.jacobian(loss, theta)
        hess = torch.autograd.functional.hessian(loss, theta)
        step = torch.linalg.solve(hess + 1e-9 * torch.eye(2, dtype=torch.float64), grad)
        t, current = 1.0, float(loss(theta))
        while float(loss(theta - t * step)) > current and t > 1e-4:  # halve until the loss does not rise
            t /= 2
        theta = theta - t * step
        if float(step.abs().max()) * t < 1e-10:
            break
    return float(theta[0]), float(theta[1])


def calibration_report(conf: torch.Tensor, accepted: torch.Tensor, valid: torch.Tensor, temperatures: torch.Tensor,
                       biases: torch.Tensor | None = None, bins: int = DEFAULT_BINS) -> CalibrationReport:
    """ECE and AUC per position of the raw and the calibrated cumulative products."""
    check_records(conf, accepted, valid)
    event, scored = prefix_events(accepted, valid)
    before = torch.cumprod(conf.to(torch.float64), dim=-1)
    after = torch.cumprod(calibrate_confidence(conf, temperatures, biases).to(torch.float64), dim=-1)
    columns = [(scored[:, k], event[:, k], before[:, k], after[:, k]) for k in range(conf.shape[1])]
    return CalibrationReport(
        samples=tuple(int(rows.sum()) for rows, *_ in columns),
        ece_before=tuple(ece(b[rows], e[rows], bins) for rows, e, b, _ in columns),
        ece_after=tuple(ece(a[rows], e[rows], bins) for rows, e, _, a in columns),
        auc_before=tuple(auc(b[rows], e[rows]) for rows, e, b, _ in columns),
        auc_after=tuple(auc(a[rows], e[rows]) for rows, e, _, a in columns),
    )


def fit_calibration(conf: torch.Tensor, accepted: torch.Tensor, valid: torch.Tensor,
                    bins: int = DEFAULT_BINS) -> Calibration:
    """fit_platt, then its report on the same records (use held-out rollouts: the drafter's training data
    would understate its overconfidence)."""
    temperatures, biases = fit_platt(conf, accepted, valid)
    return Calibration(temperatures, calibration_report(conf, accepted, valid, temperatures, biases, bins), biases)


def reliability_bins(prob: torch.Tensor, label: torch.Tensor, bins: int = DEFAULT_BINS):
    """prob [n], label [n] -> (count, mean prob, label rate) per equal-width bin, binned as `ece` bins.
    Example: prob [0.1, 0.15, 0.9], label [0, 1, 1], 2 bins -> (2, 1), (0.125, 0.9), (0.5, 1.0)."""
    index = (prob.double() * bins).long().clamp(0, bins - 1)
    count = torch.bincount(index, minlength=bins)
    prob_sum = torch.zeros(bins, dtype=torch.float64).index_add_(0, index, prob.double())
    label_sum = torch.zeros(bins, dtype=torch.float64).index_add_(0, index, label.double())

    def mean(sums: torch.Tensor) -> tuple[float | None, ...]:
        return tuple(float(s) / int(c) if c else None for s, c in zip(sums, count))

    return tuple(count.tolist()), mean(prob_sum), mean(label_sum)


def check_records(conf: torch.Tensor, accepted: torch.Tensor, valid: torch.Tensor) -> None:
    if conf.dim() != 2 or accepted.shape != conf.shape or valid.shape != conf.shape:
        raise ValueError(f"calibration records: conf, accepted, valid must all be [N, k], got "
                         f"{tuple(conf.shape)}, {tuple(accepted.shape)}, {tuple(valid.shape)}")
    if accepted.dtype != torch.bool or valid.dtype != torch.bool:
        raise ValueError(f"calibration records: accepted and valid must be bool, got {accepted.dtype}, {valid.dtype}")


def save_calibration(calibration: Calibration, path: str | Path) -> None:
    """Write {"temperatures": [...], "biases": [...], "report": {...} | null}; nan is written as null."""
    report = None if calibration.report is None else {
        name: [None if isinstance(v, float) and math.isnan(v) else v for v in values]
        for name, values in asdict(calibration.report).items()}
    doc = {"temperatures": calibration.temperatures.tolist(), "biases": calibration.bias_values.tolist(),
           "report": report}
    Path(path).write_text(json.dumps(doc, indent=1) + "\n")


def load_calibration(path: str | Path) -> Calibration:
    """Read a file written by save_calibration ("biases" may be absent: all 0); a bad file raises ValueError naming
    the file and the problem."""
    doc = read_json(path, "calibration", "fit one, or unset calibration")
    temps = doc.get("temperatures") if isinstance(doc, dict) else None
    if not isinstance(temps, list) or not temps or not all(_finite(t) and t > 0 for t in temps):
        raise ValueError(f"calibration {path}: 'temperatures' must be a non-empty list of numbers > 0")
    biases = doc.get("biases")
    if biases is not None and (not isinstance(biases, list) or len(biases) != len(temps)
                               or not all(_finite(b) for b in biases)):
        raise ValueError(f"calibration {path}: 'biases' must be absent or a list of {len(temps)} finite numbers")
    return Calibration(torch.tensor(temps, dtype=torch.float32), _report_from_json(doc.get("report"), len(temps), path),
                       None if biases is None else torch.tensor(biases, dtype=torch.float32))


def _finite(v: object) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v)


def _report_from_json(doc: object, k: int, path: str | Path) -> CalibrationReport | None:
    if doc is None:
        return None
    names = [f.name for f in fields(CalibrationReport)]
    if not isinstance(doc, dict) or sorted(doc) != sorted(names) or any(
            not isinstance(doc[n], list) or len(doc[n]) != k for n in names):
        raise ValueError(f"calibration {path}: 'report' must be null or hold {names}, each a list of {k} values")
    return CalibrationReport(**{n: tuple(math.nan if v is None else v for v in doc[n]) for n in names})


def drafter_calibration(knob: str | None, drafter_path: str | Path) -> tuple[tuple[float, ...], tuple[float, ...]]:
    """(temperatures, biases) the server drafts with: from the calibration knob's file, else from the
    `calibration.json` that `python -m sgl_dspark.training.calibrate` wrote beside the drafter, else ((), ()) (raw
    confidences). A bad file raises ValueError naming it."""
    beside = Path(drafter_path) / "calibration.json"
    path = knob if knob is not None else (beside if beside.is_file() else None)
    if path is None:
        return (), ()
    calibration = load_calibration(path)
    return tuple(calibration.temperatures.tolist()), tuple(calibration.bias_values.tolist())
