"""The server's random streams (sgl_dspark.streams): one derivation from --random-seed, a stream per role and per
draft-worker start, none equal to SGLang's own (seeded with --random-seed itself)."""

import pytest
import torch
from scipy.stats import chisquare

from sgl_dspark.drafter.sampler import sample_rows
from sgl_dspark.sampling import SamplingParams
from sgl_dspark.streams import DRAFT, ROLES, VERIFY, stream, stream_seed
from sgl_dspark.tree import DraftTree
from sgl_dspark.verify import verify_sampling


def low(seed: int) -> int:
    return seed & 0xFFFFFFFF


@pytest.mark.parametrize("base", [0, 1, 42, 2**32, 2**40 + 7])
def test_every_role_and_start_gets_a_seed_of_its_own(base):
    seeds = [stream_seed(base, VERIFY)] + [stream_seed(base, DRAFT, start) for start in range(4)]
    assert len({low(s) for s in seeds} | {low(base)}) == len(seeds) + 1
    assert stream_seed(base, DRAFT, 2) == stream_seed(base, DRAFT, 2)  # a derivation, not a draw


def test_streams_draw_different_words():
    words = {role: torch.rand(8, generator=stream(0, role)) for role in ROLES}
    sglang = torch.rand(8, generator=torch.Generator().manual_seed(0))
    assert not torch.equal(words[VERIFY], words[DRAFT])
    assert not any(torch.equal(w, sglang) for w in words.values())
    assert torch.equal(torch.rand(8, generator=stream(0, VERIFY)), words[VERIFY])


def test_unknown_role_is_refused():
    with pytest.raises(ValueError, match="unknown role"):
        stream_seed(0, "prefill")


# -- the issue's case: the project's drafting and acceptance draws, generators seeded as the worker seeds them ------

P = torch.tensor([0.2, 0.6, 0.2])  # the target's law at every position
Q_LOGITS = torch.tensor([0.55, 0.30, 0.15]).log()  # the drafter's, which disagrees
CHAIN, TOKENS, RUNS, CONTROL_RUNS = 3, 9, 30_000, 3000


def issue_case(draft_seed: int, verify_seed: int) -> list[int]:
    """Chains of CHAIN drafted with `sample_rows` from the drafter's generator, all verified with
    `verify_sampling` from the verifier's, until TOKENS tokens."""
    drafting, verifying = torch.Generator().manual_seed(draft_seed), torch.Generator().manual_seed(verify_seed)
    params = SamplingParams(temperature=1.0)
    out = [0]
    while len(out) <= TOKENS:
        rows = [sample_rows(Q_LOGITS[None], [params], drafting) for _ in range(CHAIN)]
        tokens = torch.tensor([out[-1]] + [int(r.tokens[0]) for r in rows])
        q = torch.cat([torch.zeros(1, 3)] + [r.probs for r in rows])
        result = verify_sampling(DraftTree.chain(tokens, torch.ones(CHAIN + 1), q), P.expand(CHAIN + 1, 3),
                                 verifying)
        out += [*result.accepted_tokens.tolist(), result.bonus_token]
    return out[1:TOKENS + 1]


def position_tests(alike: bool, runs: int = RUNS) -> tuple[list[float], list[float]]:
    """Per position: the chi-square p-value of its law against P, and the largest |observed - expected| share over
    the three tokens in standard errors."""
    out = torch.tensor([issue_case(*((s, s) if alike else (stream_seed(s, DRAFT), stream_seed(s, VERIFY))))
                        for s in range(runs)])
    counts = torch.stack([(out == t).sum(0) for t in range(3)], dim=1).double()  # [TOKENS, 3]
    want = P.double() / P.double().sum()  # exactly 1 in float64, as chisquare checks
    p_values = [float(chisquare(row.tolist(), (want * float(row.sum())).tolist()).pvalue) for row in counts]
    se = (P.double() * (1 - P.double()) / runs).sqrt()
    return p_values, ((counts / runs - P.double()) / se).abs().max(1).values.tolist()


def test_the_issue_case_reads_the_target_law_at_every_position():
    """With the worker's streams, 30,000 runs: every position within 2 standard errors (measured: at most 1.63 over
    the 9 positions' 27 shares; chi-square p >= 0.19 at each; at 3,000 runs the largest was 2.76, at position 8,
    chance for the largest of ~18 independent shares). The same seeds with drafter and verifier seeded alike, as
    before issue 27, 3,000 runs: 14.4 s.e. off at the first token (the bias the issue reported), p = 4e-50."""
    independent, z = position_tests(alike=False)
    assert min(independent) > 1e-3 and max(z) < 2, (independent, z)
    alike, z = position_tests(alike=True, runs=CONTROL_RUNS)
    assert alike[0] < 1e-20 and z[0] > 10, (alike, z)
