"""DSPARK observability: the per-request counts the worker ships, what the tokenizer's meta_info makes of them, the
scheduler's accept-rate restatement, the periodic log line and DSpark's own Prometheus series."""

import logging
from types import SimpleNamespace

import pytest
import torch
from prometheus_client import CollectorRegistry

from scheduler_patch import metrics
from scheduler_patch.runtime.setup import worker_metrics
from sgl_dspark.observe import (RequestCounts, Series, StepClock, StepStats, Totals, WorkerMetrics, request_meta,
                               result_counts)

# Two steps of a 2-request batch: request 0 drafts 4/5, verifies 3/2 (rows 4/3), accepts 2/1;
# request 1 drafts 2/0, verifies 2/0 (rows 3/1), accepts 3/1.
STEPS = (StepStats([4, 2], [4, 3], [2, 3], 0.010, 0.030, 0.002, lookup_tokens=3),
         StepStats([5, 0], [3, 1], [1, 1], 0.020, 0.050, 0.004, drafted_ahead=2, speculated=[True, False]))


def test_result_counts_are_the_verify_window_and_the_draft_length():
    cap, block = result_counts([3, 0, 5], torch.tensor([3, 1, 4]))
    assert cap.tolist() == [3, 1, 4] and block.tolist() == [3, 0, 5]
    assert cap.dtype == block.dtype == torch.int32


def test_request_meta_divides_by_the_verified_drafts_not_a_fixed_length():
    # 4 verify steps, windows 4+3+4+3 = 14 -> 10 verified drafts, 8 of them accepted; 16 drafted.
    meta = request_meta(RequestCounts(verify_ct=4, completion_tokens=13, correct_drafts=8, window_tokens=14,
                                      drafted_tokens=16))
    assert meta == {"spec_verify_ct": 4, "spec_accept_length": 3.25, "spec_mean_draft_length": 4.0,
                    "spec_mean_verify_length": 2.5, "spec_accept_rate": 0.8, "spec_num_correct_drafts": 8,
                    "spec_num_proposed_drafts": 10}


def test_a_request_that_verified_no_draft_has_rate_zero():
    meta = request_meta(RequestCounts(verify_ct=2, completion_tokens=3, correct_drafts=0, window_tokens=2,
                                      drafted_tokens=0))
    assert meta["spec_accept_rate"] == 0.0 and meta["spec_mean_verify_length"] == 0.0


# -- dspark.spec_meta_info ---------------------------------------------------------------------------------------

def batch_output(**fields):
    """A BatchStrOutput stand-in for two requests; request 1 never reached a verify step."""
    base = dict(spec_verify_ct=[4, 0], spec_num_correct_drafts=[8, 0], spec_num_cap_tokens=[14, 0],
                spec_num_block_accept_tokens=[16, 0], completion_tokens=[13, 1])
    return SimpleNamespace(**{**base, **fields})


def test_request_counts_read_the_carried_sums():
    assert metrics.request_counts(batch_output(), 0) == RequestCounts(4, 13, 8, 14, 16)
    assert metrics.request_counts(batch_output(), 1) is None
    assert metrics.request_counts(batch_output(spec_num_cap_tokens=None), 0) is None
    assert metrics.request_counts(batch_output(spec_num_cap_tokens=[0, 0]), 0) is None  # no windows shipped


def test_rewrite_replaces_sglangs_fixed_length_values():
    # What SGLang wrote with speculative_num_draft_tokens=9: 4 steps * 8 "proposed" drafts.
    meta = {"e2e_latency": 1.0, "spec_accept_rate": 0.25, "spec_accept_length": 3.25, "spec_num_correct_drafts": 8,
            "spec_num_proposed_drafts": 32, "spec_verify_ct": 4, "spec_cap_length": 3.5,
            "spec_block_accept_length": 4.0, "spec_cap_lens_histogram": [0, 0, 0, 2, 2]}
    metrics.rewrite_spec_meta(meta, RequestCounts(4, 13, 8, 14, 16))
    assert meta == {"e2e_latency": 1.0, "spec_accept_rate": 0.8, "spec_accept_length": 3.25,
                    "spec_num_correct_drafts": 8, "spec_num_proposed_drafts": 10, "spec_verify_ct": 4,
                    "spec_cap_length": 3.5, "spec_cap_lens_histogram": [0, 0, 0, 2, 2],
                    "spec_mean_draft_length": 4.0, "spec_mean_verify_length": 2.5}


@pytest.mark.parametrize("algorithm, rewritten", [("DSPARK", True), ("dspark", True), ("EAGLE", False)])
def test_spec_meta_info_rewrites_dspark_requests_only(monkeypatch, algorithm, rewritten):
    from sglang.srt.managers import tokenizer_manager

    monkeypatch.setattr(tokenizer_manager, "get_spec", lambda: SimpleNamespace(speculative_algorithm=algorithm))

    def upstream(self, meta_info, recv_obj, i):
        meta_info["spec_accept_rate"] = 0.25

    meta = {}
    metrics._spec_meta_info(upstream, None, meta, batch_output(), 0)
    assert meta["spec_accept_rate"] == (0.8 if rewritten else 0.25)
    assert ("spec_mean_verify_length" in meta) is rewritten


def test_names_dspark():
    from scheduler_patch.algorithm import spec

    assert metrics.names_dspark(spec()) and metrics.names_dspark("DSpark")
    assert not metrics.names_dspark("EAGLE") and not metrics.names_dspark(None)


# -- dspark.spec_accept_rate -------------------------------------------------------------------------------------

def test_correct_drafts_in_sglang_units_make_sglangs_formula_read_the_true_rate():
    # 8 request-steps, windows 20 -> 12 verified drafts, 6 accepted: rate 0.5; SGLang divides by 8 * 4.
    restated = metrics.correct_drafts_in_sglang_units(6, 20, 8, 4)
    assert restated / (8 * 4) == 0.5
    assert metrics.correct_drafts_in_sglang_units(0, 8, 8, 4) == 0.0


def reporter(algorithm, forward_ct_decode):
    return SimpleNamespace(scheduler=SimpleNamespace(spec_algorithm=algorithm), spec_num_forward_ct=8,
                           spec_num_correct_drafts=6, spec_num_cap_tokens=20, forward_ct_decode=forward_ct_decode,
                           decode_log_interval=10)


def sglang_rate(self, can_run_cuda_graph, running_batch=None, num_generated_tokens=0):
    """SGLang's formula, for a verify length of 5 tokens (4 drafts)."""
    return self.spec_num_correct_drafts / (self.spec_num_forward_ct * 4)


@pytest.mark.parametrize("algorithm, tick, windows, rate", [
    ("dspark", 20, 20, 0.5), ("dspark", 21, 20, 6 / 32), ("eagle", 20, 20, 6 / 32),
    ("dspark", 20, 0, 6 / 32),  # no windows shipped: SGLang's own value stands
])
def test_the_scheduler_rate_is_restated_on_dspark_log_ticks_only(monkeypatch, algorithm, tick, windows, rate):
    from sglang.srt.managers.scheduler_components import metrics_reporter

    from scheduler_patch.algorithm import spec

    monkeypatch.setattr(metrics_reporter, "get_spec", lambda: SimpleNamespace(speculative_num_draft_tokens=5))
    ours = spec() if algorithm == "dspark" else SimpleNamespace(name="EAGLE")
    state = reporter(ours, tick)
    state.spec_num_cap_tokens = windows
    assert metrics._report_decode_stats(sglang_rate, state, False) == pytest.approx(rate)


def test_the_metrics_patches_fit_the_pinned_sglang():
    for patch in metrics.PATCHES:
        patch.check()


# -- the worker's log line and series ----------------------------------------------------------------------------

def test_the_log_line_shows_means_per_request_step_and_the_time_split():
    totals = Totals()
    for step in STEPS:
        totals.add(step)
    # 4 request-steps: accepted 7, drafted 11, verified 3+2+2+0 = 7 drafts of which 7-4 = 3 accepted.
    assert totals.line() == ("DSpark decode: steps=2 accept_len=1.75 draft_len=2.75 verify_len=1.75 "
                             "accept_rate=0.43 draft_ms=15.0 verify_ms=40.0 commit_ms=3.0 drafted_ahead=0.50 "
                             "draft_failures=0 speculated=0.75 spec_steps=1.00 share_ms=0.0 between_ms=0.0")
    totals.add(StepStats([0, 0], [1, 1], [1, 1], 0.001, 0.030, 0.002, speculated=[False, False]))
    assert "speculated=0.50 spec_steps=0.67 share_ms=0.0" in totals.line()  # the gate let no request draft
    totals.add(StepStats([1], [2], [2], 0.010, 0.030, 0.002, share_s=0.004))
    assert "share_ms=1.0 " in totals.line()  # 4 ms of broadcast over 4 steps
    totals.add(StepStats([1], [2], [2], 0.010, 0.030, 0.002, between_s=0.006))
    totals.add(StepStats([1], [2], [2], 0.010, 0.030, 0.002, between_s=0.002))
    assert totals.line().endswith("between_ms=4.0")  # the mean over the two steps that had a step before them


def test_worker_metrics_log_every_interval_and_start_a_new_window(caplog):
    wm = WorkerMetrics(log_interval=2)
    with caplog.at_level(logging.INFO, logger="sgl_dspark"):
        for step in (*STEPS, STEPS[0]):
            wm.observe(step)
    lines = [r.getMessage() for r in caplog.records if r.getMessage().startswith("DSpark decode:")]
    assert lines == [lines[0]] and "steps=2 accept_len=1.75" in lines[0]
    assert wm.window.steps == 1


def test_draft_worker_failures_are_counted_every_time_and_warned_once_per_window(caplog):
    wm = WorkerMetrics(log_interval=1)
    with caplog.at_level(logging.WARNING, logger="sgl_dspark"):
        wm.draft_worker_failed()
        wm.draft_worker_failed()
        wm.observe(STEPS[0])
        wm.draft_worker_failed()
    assert wm.draft_failures == 3 and wm.window.draft_failures == 1
    assert len([r for r in caplog.records if r.levelno == logging.WARNING]) == 2


def test_series_record_lengths_and_failures():
    registry = CollectorRegistry()
    wm = WorkerMetrics(series=Series({"model_name": "m"}, registry=registry))
    for step in STEPS:
        wm.observe(step)
    wm.draft_worker_failed()
    value = lambda name, **extra: registry.get_sample_value(name, {"model_name": "m", **extra})  # noqa: E731
    assert value("sglang:dspark_verify_length_count") == 4 and value("sglang:dspark_verify_length_sum") == 7
    assert value("sglang:dspark_verify_length_bucket", le="0.0") == 1
    assert value("sglang:dspark_accept_length_sum") == 7 and value("sglang:dspark_accept_length_bucket", le="1.0") == 2
    assert value("sglang:dspark_draft_worker_failures_total", cause="unknown") == 1
    assert value("sglang:dspark_draft_worker_failures_total", cause="dead") == 0  # every cause listed from the start
    assert value("sglang:dspark_request_steps_total", speculated="true") == 3  # the gate held one request back
    assert value("sglang:dspark_request_steps_total", speculated="false") == 1
    assert value("sglang:dspark_steps_total", speculated="true") == 2
    assert value("sglang:dspark_steps_total", speculated="false") == 0
    assert value("sglang:dspark_lookup_accepted_tokens_total") == 3


def test_series_exist_only_with_a_model_name():
    wm = WorkerMetrics.create(7, None)
    assert wm.series is None and wm.log_interval == 7


@pytest.mark.parametrize("fields, interval, dp_rank, plans, labels", [
    ({"enable_metrics": False, "decode_log_interval": 7}, 7, None, True, None),
    ({"enable_metrics": True, "decode_log_interval": None}, 40, None, True, {"model_name": "m"}),
    ({"enable_metrics": True, "decode_log_interval": 5, "served_model_name": "served"}, 5, None, True,
     {"model_name": "served"}),
    ({"enable_metrics": True, "decode_log_interval": 5}, 5, 1, True, {"model_name": "m", "dp_rank": "1"}),
    ({"enable_metrics": True, "decode_log_interval": 5}, 5, None, False, None),  # a TP rank that does not plan
])
def test_the_worker_reads_its_metrics_settings_from_sglangs_server_args(fields, interval, dp_rank, plans, labels):
    from sglang.srt.runtime_context import get_parallel

    with get_parallel().override(dp_rank=dp_rank):  # the DP replica's rank, as SGLang's controller stamps it
        wm = worker_metrics(SimpleNamespace(model_path="m", **fields), plans)
    assert wm.log_interval == interval and (None if wm.series is None else wm.series.labels) == labels


def test_the_step_clock_splits_a_step_at_its_two_marks():
    ticks = iter([1.0, 1.5, 3.5, 4.0])
    clock = StepClock(lambda: next(ticks))
    clock.mark_drafted()
    clock.mark_verified()
    assert (clock.draft_s, clock.verify_s, clock.since_verified()) == (0.5, 2.0, 0.5)
