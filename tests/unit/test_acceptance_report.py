"""Acceptance report and step trace: per-position acceptance, reliability bins / ECE, tau, the markdown table."""

import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # `benchmarks` is a folder of scripts, not installed

from benchmarks.acceptance_report import (TABLE_END, TABLE_START, RequestOutcome, chain_positions,  # noqa: E402
                                          chain_records, markdown_table, outcome_of, position_acceptance, reliability,
                                          reliability_bins, splice_table, summarize)
from sgl_dspark.calibration import ece  # noqa: E402
from sgl_dspark.graft import Grafted  # noqa: E402
from sgl_dspark.trace import (StepTrace, TraceWriter, leading_matches, main_chain, read_trace,  # noqa: E402
                              reached_depth, step_trace)
from sgl_dspark.tree import DraftTree  # noqa: E402
from sgl_dspark.verify import VerifyResult  # noqa: E402


def trace(tau: int, reached: int, conf: list[float], chain_accepted: int, lookup: int = 0, rid: str = "r") -> StepTrace:
    return StepTrace(rid, len(conf), len(conf), tau, reached, conf, chain_accepted, lookup)


def test_position_acceptance_counts_attempts_and_accepts_per_position():
    counts = position_acceptance([2, 1, 3], [1, 1, 3])
    assert (counts.attempts, counts.accepts) == ((3, 2, 1), (3, 1, 1))
    assert counts.rates == (1.0, 0.5, 1.0)


def test_position_acceptance_of_nothing_is_empty():
    assert position_acceptance([], []).attempts == ()
    assert position_acceptance([0, 0], [0, 0]).rates == ()


def test_chain_positions_stop_at_the_verified_length():
    # 3 verified, 1 accepted -> positions 1, 2 tried; 2 verified, both accepted -> 1, 2 tried (3 not verified)
    counts = chain_positions([trace(2, 2, [0.9, 0.5, 0.2], 1), trace(3, 2, [0.9, 0.8], 2)])
    assert (counts.attempts, counts.accepts) == ((2, 2), (2, 1))


def test_chain_records_lay_out_calibration_rows():
    conf, accepted, valid = chain_records([trace(2, 2, [0.9, 0.5], 1), trace(1, 0, [], 0)])
    assert conf.tolist() == [[0.8999999761581421, 0.5], [0.0, 0.0]]
    assert accepted.tolist() == [[True, False], [False, False]]
    assert valid.tolist() == [[True, True], [False, False]]


def test_reliability_bins_by_equal_width():
    prob = torch.tensor([0.1, 0.15, 0.9], dtype=torch.float64)
    count, mean, rate = reliability_bins(prob, torch.tensor([0, 1, 1]), bins=2)
    assert count == (2, 1)
    assert mean == (0.125, 0.9)
    assert rate == (0.5, 1.0)


def test_reliability_bins_agree_with_calibration_ece():
    prob, label = torch.tensor([0.1, 0.1, 0.9, 0.9]), torch.tensor([0, 0, 1, 0])
    count, mean, rate = reliability_bins(prob, label, bins=10)
    gaps = sum(n * abs(m - r) for n, m, r in zip(count, mean, rate) if n)
    assert abs(gaps / 4 - ece(prob, label, 10)) < 1e-12


def test_reliability_scores_the_survival_against_first_k_accepted():
    # step 1: conf [0.5, 0.5], position 1 accepted, 2 rejected -> survival 0.5 (event 1), 0.25 (event 0)
    conf = torch.tensor([[0.5, 0.5]])
    rel = reliability(conf, torch.tensor([[True, False]]), torch.tensor([[True, True]]), bins=4)
    assert rel.count == (0, 1, 1, 0)  # 0.25 is bin 1's lower edge, 0.5 bin 2's
    assert rel.mean_confidence[2] == 0.5 and rel.accept_rate[2] == 1.0
    assert abs(rel.ece - (0.5 + 0.25) / 2) < 1e-12
    assert rel.ece_by_position == (0.5, 0.25)


def test_summarize_aggregates_tau_as_tokens_over_steps_and_the_lookup_share():
    outcomes = [RequestOutcome(10, 4, 12.0, 8.0), RequestOutcome(6, 4, 8.0, 4.0)]
    traces = [trace(3, 3, [0.9, 0.9, 0.9], 1, lookup=1), trace(2, 2, [0.9, 0.9], 1)]
    s = summarize(outcomes, traces)
    assert (s.tau, s.mean_draft_length, s.mean_verify_length) == (2.0, 2.5, 1.5)
    assert (s.accepted_drafts, s.lookup_accepted, s.lookup_share) == (3, 1, 1 / 3)
    assert (s.positions.attempts, s.positions.accepts) == ((2, 2, 1), (2, 1, 0))


def test_summarize_without_traces_reports_only_the_replies():
    s = summarize([RequestOutcome(9, 3, 0.0, 0.0)])
    assert s.tau == 3.0 and s.positions is None and s.lookup_share is None


def test_outcome_of_reads_meta_info():
    meta = {"completion_tokens": 10, "spec_verify_ct": 4, "spec_mean_draft_length": 3.0,
            "spec_mean_verify_length": 1.5}
    assert outcome_of(meta) == RequestOutcome(10, 4, 12.0, 6.0)
    assert outcome_of({"completion_tokens": 5}) == RequestOutcome(5, 0, 0.0, 0.0)


# -- the step trace -------------------------------------------------------------------------------------------

def grafted(parents: list[int], neural: list[bool], conf: list[float]) -> Grafted:
    n = len(parents)
    tree = DraftTree(torch.arange(10, 10 + n), torch.tensor(parents), torch.tensor(conf))
    group = torch.tensor([-1 if x else 0 for x in neural])
    return Grafted(tree, torch.tensor(neural), group)


def test_main_chain_follows_first_drafter_children():
    g = grafted([-1, 0, 1, 0, 2], [True, True, True, True, False], [1, 0.9, 0.8, 0.3, 0.5])
    assert main_chain(g) == [1, 2]
    assert leading_matches([1, 2, 3], [1, 2, 5]) == 2


def test_step_trace_of_a_path_through_a_lookup_branch():
    # root -> 1 -> 2 (drafter chain), lookup chain root -> 3 -> 4; the target accepts 3, 4
    g = grafted([-1, 0, 1, 0, 3], [True, True, True, False, False], [1, 0.9, 0.8, 0.4, 0.4])
    result = VerifyResult(torch.tensor([3, 4]), torch.tensor([13, 14]), 99, 4)
    t = step_trace("a", g, 2, result)
    assert t == StepTrace("a", 2, 4, 3, 2, [0.8999999761581421, 0.800000011920929], 0, 2)


def test_reached_depth_counts_a_rejected_child():
    g = grafted([-1, 0, 1], [True, True, True], [1, 0.9, 0.8])
    assert reached_depth(g, VerifyResult(torch.tensor([1]), torch.tensor([11]), 5, 1)) == 2
    assert reached_depth(g, VerifyResult(torch.tensor([1, 2]), torch.tensor([11, 12]), 5, 2)) == 2


def test_trace_file_round_trip(tmp_path):
    path = tmp_path / "t.jsonl"
    records = [trace(2, 2, [0.5, 0.25], 1, rid="x"), trace(1, 1, [0.5], 0, rid="y")]
    TraceWriter(path).write(records)
    assert read_trace(path) == records
    assert read_trace(tmp_path / "missing.jsonl") == []


# -- the table ------------------------------------------------------------------------------------------------

def report(tau: float) -> dict:
    return {"tau": tau, "mean_draft_length": 4.0, "mean_verify_length": 2.0, "lookup_share": 0.25,
            "reliability": {"ece": 0.1234}, "positions": {"attempts": [4, 2], "accepts": [2, 1]}}


def test_markdown_table_pairs_dspark_with_ngram_at_the_same_temperature():
    doc = {"meta": {"prompts_per_set": 2, "max_new_tokens": 32, "drafter_name": "d"},
           "runs": [{"algorithm": "DSPARK", "lookup": True, "temperature": 0.0, "sets": {"gsm8k": report(1.5)}},
                    {"algorithm": "NGRAM", "lookup": None, "temperature": 0.0,
                     "sets": {"gsm8k": {"tau": 1.25}}}]}
    lines = markdown_table(doc).splitlines()
    assert lines[2] == "| gsm8k | 0 | on | 1.50 | 1.25 | 4.00 | 2.00 | 0.25 | 0.123 | 0.50 / 0.50 |"
    doc["runs"][1]["exact_sampling"] = False
    lines = markdown_table(doc).splitlines()
    assert "| 1.25 † |" in lines[2] and lines[-1].startswith("† SGLang's NGRAM verifies by argmax")


def test_splice_table_replaces_between_markers_only():
    text = f"a\n{TABLE_START}\nold\n{TABLE_END}\nb\n"
    assert splice_table(text, "new") == f"a\n{TABLE_START}\nnew\n{TABLE_END}\nb\n"
    assert splice_table("no markers", "new") is None
