"""Complementary training (issue 13): where the lookup branch of the hybrid tree already proposes the right
continuation, the neural drafter need not; its loss at those positions is down-weighted.

Owns the per-anchor lookup coverage of a token sequence (the serving LookupIndex replayed over it) and the loss
scale it gives a block. Pure Python/torch; must not load models or train.
"""

from collections.abc import Sequence

import torch

from sgl_dspark.lookup import LookupIndex, LookupKnobs
from sgl_dspark.trace import leading_matches

DEFAULT_LOOKUP_KNOBS = LookupKnobs()


def lookup_depths(ids: Sequence[int], gamma: int, knobs: LookupKnobs = DEFAULT_LOOKUP_KNOBS) -> torch.Tensor:
    """[T] for each anchor a (the history is ids[:a+1], as when serving at that token): how many of the next
    tokens ids[a+1:a+1+gamma] the best lookup chain gets right in a row (0..gamma).

    Example: ids [1, 2, 3, 1, 2, 3, 9], gamma 2 -> [0, 0, 0, 2, 1, 0, 0] (after the second 1 the copy of "2 3" is
    right; after the second 2 the copy "3 1" is right once, then 9 breaks it)."""
    index, out = LookupIndex(knobs), torch.zeros(len(ids), dtype=torch.long)
    for a, token in enumerate(ids):
        index.append((token,))
        truth = ids[a + 1:a + 1 + gamma]
        if truth:
            out[a] = max((leading_matches(c.tokens[:gamma], truth) for c in index.propose()), default=0)
    return out


def complement_scale(depths: torch.Tensor, gamma: int, weight: float) -> torch.Tensor:
    """depths [B] (lookup_depths at the block anchors) -> [B, gamma] loss scale: 1 - weight at the draft positions
    the lookup covers (k < depth), 1 elsewhere. Example: depths [0, 2], gamma 3, weight 0.5 ->
    [[1, 1, 1], [0.5, 0.5, 1]]."""
    covered = torch.arange(gamma, device=depths.device)[None] < depths[:, None]
    return 1.0 - weight * covered.float()
