"""Acceptance report: what a benchmark run's replies and step traces say about one prompt set, and its table.

Owns the aggregation (accepted length tau from SGLang's meta_info, per-position conditional acceptance, the
confidence reliability diagram and ECE of the survival the scheduler plans with, the lookup's share of accepted
tokens) and the markdown table rendered from the report JSON. Pure; must not start servers or send requests
(benchmarks/acceptance.py does). ECE and the event definition come from sgl_dspark.calibration.
"""

import math
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

import torch

from sgl_dspark.calibration import DEFAULT_BINS, ece, prefix_events, reliability_bins
from sgl_dspark.trace import StepTrace

TABLE_START = "<!-- acceptance-table:start -->"
TABLE_END = "<!-- acceptance-table:end -->"
TABLE_POSITIONS = 4  # conditional acceptance shown for positions 1..4 in the table
NOT_SAMPLED = ("† SGLang's NGRAM verifies by argmax on CPU whatever the temperature: its output there is not "
               "sampled from the target, so this τ is not comparable.")


@dataclass(frozen=True)
class RequestOutcome:
    """One reply's speculative sums, from its meta_info."""

    completion_tokens: int
    verify_steps: int  # spec_verify_ct
    drafted: float  # spec_mean_draft_length * verify steps
    verified: float  # spec_mean_verify_length * verify steps


@dataclass(frozen=True)
class PositionAcceptance:
    """Paper Fig. 2: P(position k accepted | positions < k accepted), k = index + 1."""

    attempts: tuple[int, ...]  # [K] steps that verified position k with every position before it accepted
    accepts: tuple[int, ...]  # [K] of those, the steps that accepted position k

    @property
    def rates(self) -> tuple[float | None, ...]:
        return tuple(a / n if n else None for a, n in zip(self.accepts, self.attempts))


@dataclass(frozen=True)
class Reliability:
    """Paper Fig. 6 over the verified main-chain positions: survival (product of calibrated confidences up to
    position k) against the event "positions 1..k all accepted", in equal-width bins."""

    count: tuple[int, ...]  # [bins] scored (step, position) pairs per bin
    mean_confidence: tuple[float | None, ...]  # [bins] mean survival in the bin
    accept_rate: tuple[float | None, ...]  # [bins] share of the bin's pairs whose event happened
    ece: float | None  # pooled over every scored pair (None: none scored)
    ece_by_position: tuple[float | None, ...]  # [K]


@dataclass(frozen=True)
class SetReport:
    requests: int
    completion_tokens: int
    verify_steps: int
    tau: float | None  # completion tokens / verify steps (SGLang's spec_accept_length, aggregated)
    mean_draft_length: float | None  # draft tokens per verify step, before scheduling
    mean_verify_length: float | None  # draft tokens verified per verify step
    accepted_drafts: int | None  # accepted draft tokens over the traced steps, bonus excluded
    lookup_accepted: int | None  # of those, tokens only the lookup proposed
    lookup_share: float | None  # lookup_accepted / accepted_drafts
    positions: PositionAcceptance | None  # along the accepted path (drafter, side branches and lookup together)
    chain_positions: PositionAcceptance | None  # along the drafter's main chain only
    reliability: Reliability | None


def position_acceptance(reached: Sequence[int], accepted: Sequence[int]) -> PositionAcceptance:
    """Per step: the deepest position tried and the positions accepted (accepted <= reached) -> per-position
    counts. Example: reached [2, 1, 3], accepted [1, 1, 3] -> attempts (3, 2, 1), accepts (3, 1, 1)."""
    depth = max(reached, default=0)

    def at_least(values: Sequence[int]) -> tuple[int, ...]:
        counts = torch.bincount(torch.tensor(values, dtype=torch.long), minlength=depth + 1)
        return tuple(counts.flip(0).cumsum(0).flip(0)[1:].tolist())

    return PositionAcceptance(at_least(reached), at_least(accepted))


def path_positions(traces: Sequence[StepTrace]) -> PositionAcceptance:
    return position_acceptance([t.reached for t in traces], [t.tau - 1 for t in traces])


def chain_positions(traces: Sequence[StepTrace]) -> PositionAcceptance:
    """The main chain's position k is tried when it was verified and every chain position before it accepted."""
    return position_acceptance([min(t.chain_accepted + 1, len(t.chain_conf)) for t in traces],
                               [t.chain_accepted for t in traces])


def chain_records(traces: Sequence[StepTrace]) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """-> conf [N, K] float32, accepted [N, K] bool, valid [N, K] bool in sgl_dspark.calibration's layout
    (accepted: position k accepted given all before it; valid: position k was verified)."""
    k = max((len(t.chain_conf) for t in traces), default=0)
    conf = torch.zeros(len(traces), k)
    accepted = torch.zeros(len(traces), k, dtype=torch.bool)
    valid = torch.zeros(len(traces), k, dtype=torch.bool)
    for n, t in enumerate(traces):
        conf[n, :len(t.chain_conf)] = torch.tensor(t.chain_conf)
        accepted[n, :t.chain_accepted] = True
        valid[n, :len(t.chain_conf)] = True
    return conf, accepted, valid


def reliability(conf: torch.Tensor, accepted: torch.Tensor, valid: torch.Tensor,
                bins: int = DEFAULT_BINS) -> Reliability:
    """conf, accepted, valid [N, K] (chain_records) -> the reliability diagram of the survival."""
    event, scored = prefix_events(accepted, valid)
    survival = torch.cumprod(conf.double(), dim=-1)
    prob, label = survival[scored], event[scored]
    count, mean_conf, rate = reliability_bins(prob, label, bins)
    by_position = tuple(ece(survival[scored[:, k], k], event[scored[:, k], k], bins) if bool(scored[:, k].any())
                        else None for k in range(conf.shape[1]))
    return Reliability(count, mean_conf, rate, ece(prob, label, bins) if prob.numel() else None, by_position)


def ratio(num: float, den: float) -> float | None:
    return num / den if den else None


def summarize(outcomes: Sequence[RequestOutcome], traces: Sequence[StepTrace] = (),
              bins: int = DEFAULT_BINS) -> SetReport:
    """One prompt set: tau and mean lengths from the replies; the rest from the step traces (None without)."""
    steps = sum(o.verify_steps for o in outcomes)
    tokens = sum(o.completion_tokens for o in outcomes)
    base = dict(requests=len(outcomes), completion_tokens=tokens, verify_steps=steps, tau=ratio(tokens, steps),
                mean_draft_length=ratio(sum(o.drafted for o in outcomes), steps),
                mean_verify_length=ratio(sum(o.verified for o in outcomes), steps))
    if not traces:
        return SetReport(**base, accepted_drafts=None, lookup_accepted=None, lookup_share=None, positions=None,
                         chain_positions=None, reliability=None)
    drafts = sum(t.tau - 1 for t in traces)
    lookup = sum(t.lookup_accepted for t in traces)
    return SetReport(**base, accepted_drafts=drafts, lookup_accepted=lookup, lookup_share=ratio(lookup, drafts),
                     positions=path_positions(traces), chain_positions=chain_positions(traces),
                     reliability=reliability(*chain_records(traces), bins))


def outcome_of(meta: dict) -> RequestOutcome:
    """A /generate reply's meta_info -> its outcome (a reply without a verify step counts none)."""
    steps = int(meta.get("spec_verify_ct") or 0)
    return RequestOutcome(int(meta["completion_tokens"]), steps,
                          float(meta.get("spec_mean_draft_length") or 0.0) * steps,
                          float(meta.get("spec_mean_verify_length") or 0.0) * steps)


# -- the markdown table, rendered from the report JSON (plain dicts) -------------------------------------------

def _num(value: float | None, digits: int = 2) -> str:
    return "-" if value is None or (isinstance(value, float) and math.isnan(value)) else f"{value:.{digits}f}"


def _rates(positions: dict | None) -> str:
    if not positions:
        return "-"
    rates = [a / n if n else None for a, n in zip(positions["accepts"], positions["attempts"])]
    return " / ".join(_num(r) for r in rates[:TABLE_POSITIONS]) or "-"


def _ngram_tau(runs: Iterable[dict], temperature: float, name: str) -> str:
    """NGRAM's tau at this temperature, marked † where it verified by argmax instead of sampling."""
    for run in runs:
        if run["algorithm"] == "NGRAM" and run["temperature"] == temperature and name in run["sets"]:
            return _num(run["sets"][name]["tau"]) + ("" if run.get("exact_sampling", True) else " †")
    return "-"


TABLE_HEADER = ("| set | T | lookup | τ DSPARK | τ NGRAM | draft len | verify len | lookup share | ECE "
                f"| P(k accepted \\| < k), k = 1..{TABLE_POSITIONS} |\n"
                "|---|---|---|---|---|---|---|---|---|---|")


def markdown_table(doc: dict) -> str:
    """The report JSON -> one row per DSPARK run and prompt set, NGRAM's tau at the same temperature beside it."""
    rows = [TABLE_HEADER]
    for run in (r for r in doc["runs"] if r["algorithm"] == "DSPARK"):
        for name, s in run["sets"].items():
            rel = s.get("reliability") or {}
            rows.append(f"| {name} | {run['temperature']:g} | {'on' if run['lookup'] else 'off'} | {_num(s['tau'])} "
                        f"| {_ngram_tau(doc['runs'], run['temperature'], name)} "
                        f"| {_num(s['mean_draft_length'])} | {_num(s['mean_verify_length'])} "
                        f"| {_num(s['lookup_share'])} | {_num(rel.get('ece'), 3)} | {_rates(s.get('positions'))} |")
    meta = doc.get("meta", {})
    rows.append(f"\nPrompts per set: {meta.get('prompts_per_set', '?')}, max new tokens: "
                f"{meta.get('max_new_tokens', '?')}, drafter `{meta.get('drafter_name', '?')}`; τ counts the bonus "
                "token; lookup share: accepted draft tokens only the lookup proposed; ECE: of the survival.")
    if any(not r.get("exact_sampling", True) for r in doc["runs"]):
        rows.append(NOT_SAMPLED)
    return "\n".join(rows)


def splice_table(text: str, table: str, markers: tuple[str, str] = (TABLE_START, TABLE_END)) -> str | None:
    """Replace what lies between the table markers with `table`; None when the markers are absent."""
    (opening, _closing), start, end = markers, text.find(markers[0]), text.find(markers[1])
    if start < 0 or end < start:
        return None
    return f"{text[:start + len(opening)]}\n{table}\n{text[end:]}"
