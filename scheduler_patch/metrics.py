"""DSPARK's speculative metrics in SGLang's own places: per-request meta_info and the scheduler's spec gauges/log.

SGLang counts a builtin's proposed drafts as `speculative_num_draft_tokens - 1` per verify step; DSPARK verifies a
variable number. The worker ships each request's verify window and draft length in GenerationBatchResult's
cap_lens / block_accept_lens (sgl_dspark.observe.result_counts), which SGLang sums onto the Req and carries to the
tokenizer. Patches: `dspark.spec_meta_info` rewrites a DSPARK request's meta_info spec_* keys from those sums;
`dspark.spec_accept_rate` makes the scheduler's decode log line and `sglang:spec_accept_rate` gauge read accepted /
verified drafts. Builtin algorithms are untouched. Must not count anything itself (sgl_dspark.observe does).
"""


from sgl_dspark.observe import RequestCounts, accept_rate, request_meta

from scheduler_patch.algorithm import NAME, DSparkSpec
from scheduler_patch.patches import Patch, source_lacks

TOKENIZER = "sglang.srt.managers.tokenizer_manager.TokenizerManager"
REPORTER = "sglang.srt.managers.scheduler_components.metrics_reporter"
RESULTS = "sglang.srt.managers.scheduler_components.batch_result_processor.SchedulerBatchResultProcessor"
OUTPUTS = ("BatchTokenIDOutput", "BatchStrOutput")  # what carries the per-request sums scheduler -> tokenizer
CARRIED = ("spec_verify_ct", "spec_num_correct_drafts", "spec_num_cap_tokens", "spec_num_block_accept_tokens")
# Upstream source the patches rely on, whitespace-normalised: where the Req sums our counts, and the rate formula.
SUMS_ONTO_REQ = ("req.spec_num_block_accept_tokens += block_accept_lens[i]", "req.spec_num_cap_tokens += cap_lens[i]")
RATE_FORMULA = ("draft_per_round = get_spec().speculative_num_draft_tokens - 1",
                "total_draft_tokens = self.spec_num_forward_ct * draft_per_round",
                "num_correct_drafts / total_draft_tokens",
                "self.spec_num_cap_tokens / self.spec_num_forward_ct")


def names_dspark(algorithm) -> bool:
    """True for this plugin's algorithm, as a spec object (scheduler) or as the server-args string (tokenizer)."""
    return isinstance(algorithm, DSparkSpec) or (isinstance(algorithm, str) and algorithm.upper() == NAME)


# -- dspark.spec_meta_info: the tokenizer's per-request meta_info -----------------------------------------------

def request_counts(recv_obj, i: int) -> RequestCounts | None:
    """Request i's sums from a BatchStrOutput / BatchTokenIDOutput, or None when it has no verify step or the
    worker shipped no windows (each window holds its root, so the windows sum to at least the steps)."""
    lists = [getattr(recv_obj, name, None) for name in CARRIED]
    if any(values is None or len(values) <= i for values in lists):
        return None
    verify_ct, correct, window, drafted = (int(values[i]) for values in lists)
    if verify_ct <= 0 or window < verify_ct:
        return None
    return RequestCounts(verify_ct, int(recv_obj.completion_tokens[i]), correct, window, drafted)


def rewrite_spec_meta(meta_info: dict, counts: RequestCounts) -> None:
    """Replace SGLang's fixed-verify-length spec_* values with DSPARK's. spec_cap_length (verify window, root
    included) and the histograms stay as SGLang wrote them; spec_block_accept_length would be the draft length
    under another name, so it goes."""
    meta_info.pop("spec_block_accept_length", None)
    meta_info.update(request_meta(counts))


def _spec_meta_info(original, self, meta_info, recv_obj, i):
    original(self, meta_info, recv_obj, i)
    from sglang.srt.managers import tokenizer_manager

    if not names_dspark(tokenizer_manager.get_spec().speculative_algorithm):
        return
    counts = request_counts(recv_obj, i)
    if counts is not None:
        rewrite_spec_meta(meta_info, counts)


def _counts_reach_the_tokenizer() -> str | None:
    from sglang.srt.managers import io_struct

    for output in OUTPUTS:  # msgspec structs
        missing = set(CARRIED) - set(getattr(io_struct, output).__struct_fields__)
        if missing:
            return f"sglang.srt.managers.io_struct.{output} no longer carries {sorted(missing)}"
    return source_lacks(f"{RESULTS}._resolve_spec_v2_tokens", SUMS_ONTO_REQ)


# -- dspark.spec_accept_rate: the scheduler's decode log line and spec gauges -----------------------------------

def correct_drafts_in_sglang_units(correct: int, window_tokens: int, steps: int, draft_per_round: int) -> float:
    """The correct-draft count that makes SGLang's `correct / (steps * draft_per_round)` equal DSPARK's rate
    `correct / verified drafts` (verified = windows - steps, the roots excluded)."""
    return accept_rate(correct, window_tokens - steps) * steps * draft_per_round


def _report_decode_stats(original, self, *args, **kwargs):
    """On a log tick, restate this window's correct-draft count (read only by the rate, reset right after)."""
    if (names_dspark(self.scheduler.spec_algorithm) and 0 < self.spec_num_forward_ct <= self.spec_num_cap_tokens
            and self.forward_ct_decode % self.decode_log_interval == 0):
        from sglang.srt.managers.scheduler_components import metrics_reporter

        self.spec_num_correct_drafts = correct_drafts_in_sglang_units(
            self.spec_num_correct_drafts, self.spec_num_cap_tokens, self.spec_num_forward_ct,
            metrics_reporter.get_spec().speculative_num_draft_tokens - 1)
    return original(self, *args, **kwargs)


def _rate_formula_unchanged() -> str | None:
    return source_lacks(f"{REPORTER}.SchedulerMetricsReporter.report_decode_stats", RATE_FORMULA)


SPEC_META_INFO = Patch("dspark.spec_meta_info", f"{TOKENIZER}._calculate_spec_decoding_metrics", "method",
                       ("self", "meta_info", "recv_obj", "i"), _spec_meta_info, requires=_counts_reach_the_tokenizer)
SPEC_ACCEPT_RATE = Patch("dspark.spec_accept_rate", f"{REPORTER}.SchedulerMetricsReporter.report_decode_stats",
                         "method", ("self", "can_run_cuda_graph", "running_batch", "num_generated_tokens"),
                         _report_decode_stats, requires=_rate_formula_unchanged)
PATCHES = (SPEC_META_INFO, SPEC_ACCEPT_RATE)
