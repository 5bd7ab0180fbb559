"""Tied logits break as plain SGLang breaks them for the same batch: top-k, top-p, min-p and a greedy request in a
batch with a sampled one, at SmolLM2's 49,152-token vocabulary, where SGLang's CPU sort is not stable.

The oracle is SGLang's own sampler op (`top_k_top_p_min_p_sampling_from_probs_torch`) fed as `Sampler.forward`
feeds it (float32 temperature division, softmax, the batch's top-k / top-p / min-p tensors and max_top_k); its
support is read off its draws. Each case also checks that a stable sort would have kept another set, so the case
can fail.
"""

import pytest
import torch

from sglang.srt.layers.sampler import top_k_top_p_min_p_sampling_from_probs_torch

from sgl_dspark.sampling import TOP_K_ALL, SamplerBatch, SamplingParams, greedy_choices, target_probs
from sgl_dspark.tree import DraftTree
from sgl_dspark.verify import verify

VOCAB = 49152
TIED = (100, 40000, 45000)
GREEDY = SamplingParams(temperature=1.0, top_k=1)  # how SGLang hands a temperature-0 request to its sampler
PLAIN = SamplingParams(temperature=1.0)


def tied_row(seed: int = 0) -> torch.Tensor:
    """[1, VOCAB] logits: noise well below three exactly tied maxima."""
    row = torch.randn(1, VOCAB, generator=torch.Generator().manual_seed(seed)) - 20.0
    row[0, list(TIED)] = 5.0
    return row


def sglang_support(logits: torch.Tensor, batch: list[SamplingParams], row: int = 0, draws: int = 300) -> set[int]:
    """The tokens SGLang's sampler draws for request `row` of `batch` (all given these logits), over many draws."""
    n = len(batch)
    probs = torch.softmax(logits.repeat(n, 1) / torch.tensor([[p.temperature] for p in batch]), dim=-1)
    ks = [1 if p.is_greedy else (TOP_K_ALL if p.top_k <= 0 else p.top_k) for p in batch]
    max_top_k = max(ks) if all(k < TOP_K_ALL for k in ks) else None
    seen = set()
    torch.manual_seed(0)
    for _ in range(draws):
        ids = top_k_top_p_min_p_sampling_from_probs_torch(
            probs.clone(), torch.tensor(ks, dtype=torch.int32), torch.tensor([p.top_p for p in batch]),
            torch.tensor([p.min_p for p in batch]), any(p.min_p > 0 for p in batch), None,
            torch.zeros(n, dtype=torch.long), max_top_k=max_top_k)
        seen.add(int(ids[row]))
    return seen


def ours_support(logits: torch.Tensor, batch: list[SamplingParams], row: int = 0) -> set[int]:
    probs = target_probs(logits, batch[row], SamplerBatch.of(batch))
    return set(probs[0].nonzero().flatten().tolist())


def stable_support(logits: torch.Tensor, keep: int) -> set[int]:
    """The first `keep` tied ids in a stable descending sort (what the previous filter kept)."""
    return set(logits[0].sort(descending=True, stable=True).indices[:keep].tolist())


@pytest.mark.parametrize("params, others, keep", [
    (SamplingParams(top_k=2), [], 2),  # alone: SGLang takes topk(2)
    (SamplingParams(top_k=2), [PLAIN], 2),  # beside a request without top-k: a full sort
    (SamplingParams(top_p=0.5), [], 2),
    (SamplingParams(top_p=0.3), [SamplingParams(top_k=5)], 1),
    (SamplingParams(min_p=0.5, top_k=2), [], 2),
], ids=["top_k-alone", "top_k-mixed", "top_p", "top_p-topk-batch", "min_p"])
def test_tied_truncation_keeps_what_sglang_keeps(params, others, keep):
    logits = tied_row()
    batch = [params] + others
    want = sglang_support(logits, batch)
    assert len(want) == keep and want <= set(TIED)
    assert ours_support(logits, batch) == want


def test_some_tie_case_differs_from_a_stable_sort():
    """The cases above could fail: on this vocabulary SGLang's sort does not keep tied ids in index order."""
    logits = tied_row()
    cases = [([SamplingParams(top_k=2)], 2), ([SamplingParams(top_k=2), PLAIN], 2), ([SamplingParams(top_p=0.5)], 2)]
    assert any(sglang_support(logits, b, draws=100) != stable_support(logits, k) for b, k in cases)


def test_greedy_in_a_sampled_batch_takes_sglangs_sorted_first():
    logits = tied_row()
    batch = [GREEDY, PLAIN]
    want = sglang_support(logits, batch, draws=3)
    assert len(want) == 1
    got = int(greedy_choices(logits, SamplerBatch.of(batch))[0])
    assert {got} == want
    result = verify(DraftTree.chain(torch.tensor([7]), torch.ones(1)), logits, GREEDY, batch=SamplerBatch.of(batch))
    assert result.bonus_token == got
    assert int(greedy_choices(logits, SamplerBatch.of([GREEDY]))[0]) == TIED[0]  # all greedy: argmax, first index


def test_sampler_batch_follows_sglangs_rules():
    assert SamplerBatch.of([GREEDY, GREEDY]) == SamplerBatch(True, True, 1)
    assert SamplerBatch.of([GREEDY, PLAIN]) == SamplerBatch(False, True, None)
    assert SamplerBatch.of([PLAIN]) == SamplerBatch(False, False, None)
    assert SamplerBatch.of([SamplingParams(top_k=3), SamplingParams(top_k=7, top_p=0.9)]) == \
        SamplerBatch(False, True, 7)
    assert SamplerBatch.of([SamplingParams(min_p=0.1)]) == SamplerBatch(False, True, None)
