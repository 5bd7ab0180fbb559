"""DSPARK's sampled output is distributed as the plain server's: chi-square two-sample tests of the tokens after
the first (those come from verification) at temperature 1, at temperature 0.7 with top-p 0.9, under a regex
with a logit bias and with frequency / presence / repetition penalties, for chain drafting (default preset), tree
drafting (preset tree), context lookup (lookup on) and the tree under tensor parallelism (`--tp-size 2`, issue
31), with a drafter that disagrees with the target, so that rejections and residual draws are frequent.

The drafter (`disagreeing_drafter_path`) is a bigram model of the plain server's own samples, sharpened: after
token a it drafts a's most frequent successor with probability ~0.85 and the other successors seen with the rest,
in proportion to their frequencies; its confidence after a is the frequency of that top successor. It knows one
token of context where the target knows the whole prompt, and it is surer than the target (which gives that
successor about one half), so about half of the verified drafts are rejected at temperature 1 and a quarter at 0.7
(measured shares at RESULTS). Building it from the reference samples does not make the test circular: if
verification is exact, DSPARK's output distribution does not depend on the drafter at all.

Servers run one after another (one per configuration, each started while the one before it is tested; the TP one's
two ranks take both of CI's cores, the unit tests beside are done by then); the plain reference is session-wide.
"""

import math
from collections import Counter

import pytest
from scipy.stats import chi2_contingency

from conftest import after_first, contingency, draw, dspark_spec
from fixture_drafters import save_markov_drafter_for
from sgl_dspark.tools.launch import relay
from sgl_dspark.trace import read_trace

pytestmark = pytest.mark.integration

# The continuation repeats the prompt, so the lookup proposes copied chains; the target is unsure about it (at
# temperature 1: " " 0.69, then "4" 0.52, "7" 0.13, "1" 0.11), so drafts are rejected often.
PROMPT = "3 7 1 9 4 3 7 1 9 4 3 7 1 9"
SETTINGS = {
    "t1": {"temperature": 1.0, "max_new_tokens": 3, "ignore_eos": True},
    "t0.7-top_p0.9": {"temperature": 0.7, "top_p": 0.9, "max_new_tokens": 3, "ignore_eos": True},
    # The regex's mask and the logit bias on every verify row (sgl_dspark.constraints): " " is forced first and
    # third, the digit between is drawn from the masked, biased row ("3" +1).
    "t1-regex-bias": {"temperature": 1.0, "max_new_tokens": 3, "ignore_eos": True, "regex": r"( [0-9]){2,6}",
                      "logit_bias": {"35": 1.0}, "min_new_tokens": 2},
    # Penalties on every verify row with the counts of the output plus the draft path; the reference is plain
    # SGLang without overlap scheduling (`plain_sync_server`: with overlap its penalizers lag one token).
    "t1-penalties": {"temperature": 1.0, "max_new_tokens": 3, "ignore_eos": True, "frequency_penalty": 0.8,
                     "presence_penalty": 0.4, "repetition_penalty": 1.2},
}
SYNC_REFERENCE = ("t1-penalties",)
# Every step verifies at least one draft, so every token after the first goes through rejection sampling: left to
# itself, the prefix budget verifies none in most steps where the step-cost table says a second row per request
# costs more than the ~0.5 token it would gain (16 requests at a time on this CPU).
MIN_VERIFY = ("--speculative-dspark-min-verify", "1")
# The lookup configuration drafts one drafter token and verifies four nodes a request, so copied chains are
# verified every step whatever the step costs say. Four, not two: the drafter's node and the copied chain's first
# are mostly the same token (" "), folded into one node after selection, so with two only one node was verified
# in 92% of the steps and CI saw no lookup-only token accepted; with four the chain's second and third nodes
# (lookup-only) hang below it.
# tp2: the tree on two tensor-parallel ranks (issue 31): rank 0 plans each step and broadcasts it, every rank
# draws the same coins from its own verifier stream (seeded alike) and accepts alike; a rank whose coins differed
# would keep other tokens in its KV and the all-reduced forwards would no longer be the target's.
CONFIGS = {"chain": MIN_VERIFY, "tree": ("--speculative-dspark-preset", "tree", *MIN_VERIFY),
           "lookup": ("--speculative-dspark-lookup", "true", "--speculative-dspark-max-window", "1",
                      "--speculative-dspark-min-verify", "4"),
           "tp2": ("--tp-size", "2", "--speculative-dspark-preset", "tree", *MIN_VERIFY)}
# What the TP configuration is asked (its constraint and penalty rows are built by the same code on every rank, and
# checked above without TP): the two unconstrained settings, keeping the module's time within CI's budget.
TP_SETTINGS = ("t1", "t0.7-top_p0.9")
SAMPLES = 300
TRACE = "trace.jsonl"  # each configuration's step trace, in its log directory
CONCURRENCY = 16  # DSPARK's requests in flight (and its max running requests): verify batches of up to 16
P_FLOOR = 1e-3
REJECTED = (0.15, 0.9)  # the share of verified drafts rejected must lie here: rejection and acceptance both run

# The drafter: a token's most frequent successor gets logit DRAFT_LOGIT, each other successor seen gets
# DRAFT_LOGIT - RUNNER_UP_GAP + log(its frequency relative to the top one), every other id of the 4096-token draft
# vocabulary 0 (together ~7% of the mass).
DRAFT_LOGIT = 11.0
RUNNER_UP_GAP = 2.0
CONFIDENCE_RANGE = (0.05, 0.95)

# RESULTS, measured on this 2-core CPU (one run): share of verified drafts rejected (meta_info), chi-square p-value
#   chain   t1 0.48 p 0.41    t0.7-top_p0.9 0.24 p 0.16
#   tree    t1 0.50 p 0.55    t0.7-top_p0.9 0.25 p 0.19
#   lookup  t1 0.55 p 0.86    t0.7-top_p0.9 0.22 p 0.60
# Step traces of that run: every step verified a draft (1.1-1.6 per step); ~190 residual draws per 300 samples at
# temperature 1, ~110 at 0.7; lookup-only tokens accepted: 4 and 30. The module takes ~6 minutes. Lookup with
# min-verify 4 (2026-12-02, t1 alone): rejected share 0.62, p 0.59, 151 lookup-only tokens accepted in 427 steps.
# POWER, simulated from the target's exact distributions on PROMPT (HF model, float32), this drafter built from 300
# exact samples, one verified draft per step, 200 simulated tests of 300 vs 300 samples at P_FLOOR. A correct
# verifier was flagged 0 times. Flagged at temperature 1: a verifier that draws a rejected draft's replacement from
# p instead of the residual max(0, p - q) (total variation 0.17 on the pairs): 38%; one that verifies at
# temperature 0.7: 100%. At 0.7 / top-p 0.9: the residual drawn from p: 98.5%; temperature 1 instead: 100%; top-p
# ignored: 82%. Each configuration runs both settings, so a residual bug of the shared verifier fails this module
# with probability > 0.999. A flattened drafter (q ~ frequency^0.5, rejecting as often; simulated on the prompt
# "Pick a random number between 1 and 100:") gave the residual bug 3-4%: its effect on the output,
# min(p, q) - (1 - rejection) * p, is largest where q is sure of a token the target gives about a half.
# Not flagged: the pre-fix tree alternatives scored by the token just sampled (sgl-dspark d02ecff; p 0.33 / 0.68):
# they bias the output only where an alternative outranks the sampled child in the scheduler's admission order,
# which this drafter's confidences rarely produce (tests/unit/test_exact_law.py enumerates that case exactly).


def bigram_drafter_table(sequences: list[list[int]]) -> tuple[dict[int, dict[int, float]], dict[int, float]]:
    """Token sequences -> (the drafter's bigram logits, its confidence after each token).

    Example: [[1, 2], [1, 2], [1, 3], [1, 2]] -> logits {1: {2: 11.0, 3: 9 + log(1/3)}}, confidence {1: 0.75}."""
    counts: dict[int, Counter] = {}
    for seq in sequences:
        for prev, nxt in zip(seq, seq[1:]):
            counts.setdefault(prev, Counter())[nxt] += 1
    logits, confidence = {}, {}
    for prev, c in counts.items():
        (top, n_top), = c.most_common(1)
        logits[prev] = {t: DRAFT_LOGIT - (t != top) * RUNNER_UP_GAP + math.log(n / n_top) for t, n in c.items()}
        confidence[prev] = min(max(n_top / c.total(), CONFIDENCE_RANGE[0]), CONFIDENCE_RANGE[1])
    return logits, confidence


@pytest.fixture(scope="module")
def plain_samples(plain_server, plain_sync_server) -> dict[str, list[dict]]:
    """setting -> SAMPLES replies of the plain server to PROMPT (the non-overlapped one for penalties)."""
    return {s: draw(plain_sync_server if s in SYNC_REFERENCE else plain_server, PROMPT, SAMPLES, sampling)
            for s, sampling in SETTINGS.items()}


@pytest.fixture(scope="module")
def disagreeing_drafter_path(default_model_path, plain_samples, tmp_path_factory) -> str:
    logits, confidence = bigram_drafter_table([r["output_ids"] for r in plain_samples["t1"]])
    out = str(tmp_path_factory.mktemp("disagreeing-drafter"))
    return save_markov_drafter_for(default_model_path, out, logits, confidence, default_confidence=0.5)


@pytest.fixture(scope="module")
def sampling_servers(default_model_path, disagreeing_drafter_path, tmp_path_factory):
    """The configurations' servers in turn, each started while the one before it is tested."""
    jobs = {}
    for name, flags in CONFIGS.items():
        log_dir = tmp_path_factory.mktemp(f"dspark-sampling-{name}")
        jobs[name] = (dspark_spec(default_model_path, disagreeing_drafter_path, *flags, "--speculative-dspark-trace",
                                  str(log_dir / TRACE), max_running_requests=CONCURRENCY), log_dir)
    with relay(jobs) as servers:
        yield servers


@pytest.fixture(scope="module", params=list(CONFIGS))
def sampling_server(request, sampling_servers):
    """(configuration name, its DSPARK server, its step-trace path), one configuration at a time."""
    with sampling_servers.serving(request.param) as server:
        yield request.param, server, server.log_path.parent / TRACE


def rejected_share(replies: list[dict]) -> float:
    """1 - accepted / verified drafts over all replies (a verified draft that is not accepted was rejected, or was
    below or beside a rejected one)."""
    verified = sum(r["meta_info"].get("spec_num_proposed_drafts", 0) for r in replies)
    accepted = sum(r["meta_info"].get("spec_num_correct_drafts", 0) for r in replies)
    assert verified > 0, "no draft was verified"
    return 1.0 - accepted / verified


@pytest.mark.parametrize("setting", list(SETTINGS))
def test_sampled_output_is_distributed_as_plain(sampling_server, setting, plain_samples):
    name, server, trace = sampling_server
    if name == "tp2" and setting not in TP_SETTINGS:
        pytest.skip("the TP configuration draws the unconstrained settings only")
    replies = draw(server, PROMPT, SAMPLES, SETTINGS[setting], CONCURRENCY)
    table = contingency(after_first(plain_samples[setting]), after_first(replies))
    share = rejected_share(replies)
    print(f"{name} {setting}: rejected share {share:.2f}, table {table}")
    assert len(table[0]) >= 3, table  # enough categories for the test to mean something
    p_value = chi2_contingency(table).pvalue
    print(f"{name} {setting}: p-value {p_value:.3g}")
    assert p_value > P_FLOOR, (p_value, table)
    assert REJECTED[0] <= share <= REJECTED[1], share
    if name == "lookup":
        assert sum(r.lookup_accepted for r in read_trace(trace)) > 0  # copied chains were verified and accepted
