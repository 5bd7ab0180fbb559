"""DSPARK is lossless inside the real server: greedy output token-identical to the plain server (float32) on the
20 prompts x 128 tokens (four at a time; a subset one at a time), chain and tree, with radix-cache prefix hits
(sampled output: test_dspark_sampling.py).

Two DSPARK servers, both with the bigram drafter (conftest: about a third of the drafts are accepted, so every
step mixes accepted drafts, KV commits of accepted paths, rejections and bonus tokens): `chain_server` (the
default, chain drafting) and `tree_server` (preset tree: side branches where the drafter is unsure). The module's
own servers (no-draft, tree, shipped) run in turn, each started while the one before it is in use.

Same-kernel reference: `nodraft_replies` come from DSPARK verifying no drafts (max-verify 0: every step verifies the
anchor alone, through the same target forward as DSPARK with drafts). Where DSPARK's output differs from plain,
the failure message says whether this server's output differs from plain by then too (the kernel's rounding
differs from plain SGLang's: not a DSPARK bug) or not (drafting or verification is wrong). That server runs for
the one test that keeps it honest on two prompts, and again for such a failure."""

import pytest
import requests

from conftest import GREEDY_128, dspark_spec, generate_all, warm_prefix_cache
from sgl_dspark.tools.launch import ServerSpec, relay, serving
from sgl_dspark.tools.models import SHIPPED_DRAFTER

pytestmark = pytest.mark.integration

CHAT_PROMPTS = 10  # the first 10 of the `prompts` fixture share one long system prompt
CONCURRENCY_CHECK = (0, 16)  # prompts re-run one at a time on the plain server (a chat and a raw one)
TREE_SOLO = (0, 5, 13, 16)  # the subset the tree server decodes one at a time
CHAIN_SOLO = (1, 4, 8, 11, 15, 19)  # the subset the chain server decodes one at a time (all 20 four at a time)
NODRAFT_CHECK = (0, 16)  # prompts the no-draft DSPARK server always decodes (a chat and a raw one)


def flush_cache(base_url: str) -> None:
    requests.post(f"{base_url}/flush_cache", timeout=60).raise_for_status()


def first_difference(got: list[int], want: list[int]) -> int | None:
    """The first position where two outputs differ (a length difference counts), or None when they are equal."""
    if got == want:
        return None
    return next((k for k, (a, b) in enumerate(zip(got, want)) if a != b), min(len(got), len(want)))


def mismatches(replies: list[dict], want: list[list[int]], indices: list[int]) -> list[str]:
    """One line per reply whose output_ids differ from the reference: prompt index, first differing position."""
    lines = []
    for i, reply, ref in zip(indices, replies, want):
        got = reply["output_ids"]
        at = first_difference(got, ref)
        if at is not None:
            lines.append(f"prompt {i}: first difference at token {at}: got {got[at:at + 4]}, want {ref[at:at + 4]} "
                         f"(lengths {len(got)}, {len(ref)})")
    return lines


def nodraft_spec(model_path: str) -> ServerSpec:
    """A DSPARK server that verifies no drafts (max-verify 0: each step verifies the anchor alone, through the target
    forward, GEMM and attention path of a DSPARK verify step). The shipped drafter (its recommended knobs turn
    lookup on), the gate, the draft process and draft-ahead on: that combination once took the server down (issue
    27)."""
    return dspark_spec(model_path, str(SHIPPED_DRAFTER), "--speculative-dspark-max-verify", "0",
                       "--speculative-dspark-draft-ahead", "true", gate=True, draft_process=True)


def nodraft_replies(request, texts: list[str], concurrency: int) -> list[dict]:
    """Greedy replies of the no-draft server, started for this call only (a failure's verdict)."""
    fixture = request.getfixturevalue
    with serving(nodraft_spec(fixture("default_model_path")),
                 fixture("tmp_path_factory").mktemp("dspark-nodraft-verdict")) as server:
        return generate_all(server.base_url, texts, concurrency, **GREEDY_128)


@pytest.fixture(scope="module")
def lossless_servers(default_model_path, bigram_drafter_path, tmp_path_factory):
    """This module's own servers in the order its tests ask for them, each started while the one before it is in
    use: the no-draft one, the tree (preset tree, the bigram drafter: side branches where the drafter is unsure),
    the shipped drafter with lookup (the demo's configuration)."""
    specs = {"nodraft": nodraft_spec(default_model_path),
             "tree": dspark_spec(default_model_path, bigram_drafter_path, "--speculative-dspark-preset", "tree"),
             "shipped": dspark_spec(default_model_path, str(SHIPPED_DRAFTER), "--speculative-dspark-lookup", "true")}
    with relay({name: (spec, tmp_path_factory.mktemp(f"dspark-{name}")) for name, spec in specs.items()}) as servers:
        yield servers


@pytest.fixture(scope="module")
def tree_server(lossless_servers):
    with lossless_servers.serving("tree") as server:
        yield server


def same_kernel_verdicts(request, prompts: list[str], plain_reference: list[list[int]], replies: list[dict],
                         indices: list[int]) -> list[str]:
    """For each reply that differs from plain: where the no-draft DSPARK server's output first differs from plain
    on that prompt, and what that says (a kernel/rounding difference, or a bug)."""
    bad = [(i, r["output_ids"]) for i, r in zip(indices, replies) if r["output_ids"] != plain_reference[i]]
    if not bad:
        return []
    references = nodraft_replies(request, [prompts[i] for i, _ in bad], 4)
    lines = []
    for (i, got), ref in zip(bad, references):
        at = first_difference(got, plain_reference[i])
        also = first_difference(ref["output_ids"], plain_reference[i])
        verdict = (f"no-draft DSPARK differs from plain too, first at token {also}: a kernel/rounding difference"
                   if also is not None and also <= at else
                   f"no-draft DSPARK matches plain through token {at}: a bug in drafting/verification")
        lines.append(f"prompt {i}: first difference at token {at}: got {got[at:at + 4]}, "
                     f"want {plain_reference[i][at:at + 4]}; {verdict}")
    return lines


def check_lossless(request, server, prompts: list[str], plain_reference: list[list[int]], indices: list[int],
                   concurrency: int) -> list[dict]:
    """Empty cache, one warm-up (the shared system prompt gets cached), then the prompts; every reply must equal
    the plain server's greedy output (else the message says what the no-draft DSPARK server does there) and the
    chat prompts must hit the radix cache."""
    flush_cache(server.base_url)
    warm_prefix_cache(server.base_url, prompts)
    replies = generate_all(server.base_url, [prompts[i] for i in indices], concurrency, **GREEDY_128)
    assert not same_kernel_verdicts(request, prompts, plain_reference, replies, indices)
    assert all(r["meta_info"]["completion_tokens"] == GREEDY_128["max_new_tokens"] for r in replies)
    chat_cached = [r["meta_info"]["cached_tokens"] for i, r in zip(indices, replies) if i < CHAT_PROMPTS]
    assert chat_cached and min(chat_cached) > 0, chat_cached  # every chat prompt reused the cached system prompt
    return replies


def test_plain_greedy_does_not_depend_on_concurrency(plain_server, prompts, plain_reference):
    """The session reference is computed four at a time; one at a time gives the same tokens."""
    replies = generate_all(plain_server.base_url, [prompts[i] for i in CONCURRENCY_CHECK], 1, **GREEDY_128)
    assert not mismatches(replies, [plain_reference[i] for i in CONCURRENCY_CHECK], list(CONCURRENCY_CHECK))


def test_no_draft_dspark_is_token_identical_to_plain(lossless_servers, prompts, plain_reference):
    """The same-kernel reference itself: one verify step per token, no draft verified, plain's output."""
    with lossless_servers.serving("nodraft") as server:
        replies = generate_all(server.base_url, [prompts[i] for i in NODRAFT_CHECK], 2, **GREEDY_128)
    assert not mismatches(replies, [plain_reference[i] for i in NODRAFT_CHECK], list(NODRAFT_CHECK))
    for r in replies:
        meta = r["meta_info"]
        assert meta["spec_verify_ct"] == meta["completion_tokens"] - 1, meta  # the prefill gives the first token
        assert meta.get("spec_num_proposed_drafts", 0) == 0, meta


def accepted_length(replies: list[dict]) -> float:
    """Tokens per verify step over all replies (bonus included; the prefill token is not a verify step's)."""
    return sum(r["meta_info"]["completion_tokens"] - 1 for r in replies) / sum(r["meta_info"]["spec_verify_ct"]
                                                                                for r in replies)


@pytest.mark.parametrize("concurrency", [1, 4])
def test_chain_greedy_is_token_identical_to_plain(request, chain_server, prompts, plain_reference, concurrency):
    indices = list(CHAIN_SOLO) if concurrency == 1 else list(range(len(prompts)))
    replies = check_lossless(request, chain_server, prompts, plain_reference, indices, concurrency)
    assert accepted_length(replies) > 1.3  # multi-token blocks were accepted, not only bonus tokens


def test_tree_greedy_is_token_identical_to_plain_four_at_a_time(request, tree_server, prompts, plain_reference):
    replies = check_lossless(request, tree_server, prompts, plain_reference, list(range(len(prompts))), 4)
    assert accepted_length(replies) > 1.3


def test_tree_greedy_is_token_identical_to_plain_one_at_a_time(request, tree_server, prompts, plain_reference):
    replies = check_lossless(request, tree_server, prompts, plain_reference, list(TREE_SOLO), 1)
    assert accepted_length(replies) > 1.3


SHIPPED_SUBSET = [0, 3, 7, 10, 14, 18]  # chat and raw/code prompts


def test_shipped_drafter_with_lookup_is_lossless(request, lossless_servers, prompts, plain_reference):
    """The demo's configuration: the trained drafter committed in the package, plus context lookup, at concurrency
    4; its drafts are accepted (accepted length > 1) and the output is still the plain server's."""
    with lossless_servers.serving("shipped") as server:
        replies = check_lossless(request, server, prompts, plain_reference, SHIPPED_SUBSET, 4)
    steps = sum(r["meta_info"]["spec_verify_ct"] for r in replies)
    assert sum(r["meta_info"]["completion_tokens"] for r in replies) / steps > 1.2
