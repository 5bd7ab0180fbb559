"""Seeded sampling: SGLang's murmur3 Gumbel-max noise reproduced in pure torch; one seed, one choice; a sample of p."""

import struct

import torch
from scipy.stats import chisquare

from sgl_dspark.sampling import SamplingParams, target_probs
from sgl_dspark.seeded import gumbel_argmax, murmur3, seeded_choices


def murmur3_reference(data: bytes, seed: int = 0) -> int:
    """Textbook MurmurHash3 x86_32, one byte string at a time."""
    c1, c2, h = 0xCC9E2D51, 0x1B873593, seed
    rotl = lambda x, r: ((x << r) | (x >> (32 - r))) & 0xFFFFFFFF  # noqa: E731
    body = len(data) // 4 * 4
    for i in range(0, body, 4):
        k = rotl(int.from_bytes(data[i:i + 4], "little") * c1 & 0xFFFFFFFF, 15) * c2 & 0xFFFFFFFF
        h = (rotl(h ^ k, 13) * 5 + 0xE6546B64) & 0xFFFFFFFF
    tail = int.from_bytes(data[body:], "little") if len(data) > body else 0
    if len(data) > body:
        h ^= rotl(tail * c1 & 0xFFFFFFFF, 15) * c2 & 0xFFFFFFFF
    h ^= len(data)
    for shift, mult in ((16, 0x85EBCA6B), (13, 0xC2B2AE35)):
        h = (h ^ (h >> shift)) * mult & 0xFFFFFFFF
    return h ^ (h >> 16)


def test_the_reference_is_murmur3():
    assert murmur3_reference(b"") == 0
    assert murmur3_reference(b"", 1) == 0x514E28B7
    assert murmur3_reference(b"Hello, world!", 1234) == 0xFAF6CDB3


def test_vectorised_hash_equals_the_reference_on_seed_position_column():
    seeds, positions, cols = torch.tensor([0, 7, 2**40 + 3, -5]), torch.tensor([0, 1, 99, 123456]), torch.arange(6)
    got = murmur3(seeds, positions, cols)
    for i in range(4):
        for j in range(6):
            key = struct.pack("<QII", seeds[i].item() & (2**64 - 1), positions[i].item(), j)
            assert got[i, j].item() == murmur3_reference(key)


def test_one_seed_one_choice_and_seeds_differ():
    logits = torch.randn(5, 40, generator=torch.Generator().manual_seed(0))
    params, pos = SamplingParams(temperature=0.9, top_p=0.9), torch.arange(5)
    assert torch.equal(seeded_choices(logits, params, 3, pos), seeded_choices(logits, params, 3, pos))
    runs = {tuple(seeded_choices(logits, params, s, pos).tolist()) for s in range(20)}
    assert len(runs) > 10


def test_choices_are_samples_of_the_target_distribution():
    """Over many seeds the seeded choice at one row follows target_probs (temperature, top-k and top-p)."""
    logits = torch.tensor([[1.0, 0.2, -0.5, 0.7, -2.0, 0.0]])
    for params in (SamplingParams(temperature=0.8), SamplingParams(temperature=1.0, top_k=4, top_p=0.9)):
        counts = torch.zeros(6)
        for seed in range(3000):
            counts[seeded_choices(logits, params, seed, torch.tensor([17]))] += 1
        p = target_probs(logits, params)[0]
        keep = p > 0
        assert counts[~keep].sum() == 0
        assert chisquare(counts[keep].numpy(), (p[keep] * 3000).numpy()).pvalue > 1e-3


def test_gumbel_argmax_never_picks_an_impossible_column():
    logprobs = torch.tensor([[0.0, float("-inf"), -1.0]]).expand(50, -1)
    assert not (gumbel_argmax(logprobs, torch.arange(50), torch.arange(50)) == 1).any()
