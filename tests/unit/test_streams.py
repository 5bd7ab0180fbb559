"""The server's random streams (sgl_dspark.streams): one derivation from --random-seed, a stream per role and per
draft-worker start, none equal to SGLang's own (seeded with --random-seed itself)."""

import pytest
import torch

from sgl_dspark.streams import DRAFT, ROLES, VERIFY, stream, stream_seed


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
