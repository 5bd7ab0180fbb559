"""The slot ledger: after a draft-worker restart a request drafts from the part of its context written since, and
gets no draft only while nothing of it is written."""

import torch

from sgl_dspark.draft_worker.client import DraftBatch
from sgl_dspark.draft_worker.ledger import SlotLedger
from sgl_dspark.sampling import SamplingParams

GREEDY, WARM = SamplingParams(0.0), SamplingParams(0.8)


def batch(*contexts: list[int]) -> DraftBatch:
    n = len(contexts)
    return DraftBatch(tuple(torch.tensor(c, dtype=torch.long) for c in contexts), torch.arange(10, 10 + n),
                      torch.tensor([len(c) for c in contexts]), (GREEDY, WARM, GREEDY)[:n])


def ledger(*written: int) -> SlotLedger:
    out = SlotLedger(16)
    out.mark(torch.tensor(written, dtype=torch.long))
    return out


def test_the_docstring_example():
    part, rows = ledger(3, 4).drafted_part(batch([3, 4, 5], [7], []))
    assert rows == [0, 2]
    assert [c.tolist() for c in part.context_slots] == [[3, 4], []]
    assert part.anchors.tolist() == [10, 12] and part.anchor_positions.tolist() == [3, 0]
    assert part.sampling == (GREEDY, GREEDY)


def test_a_fully_written_batch_is_drafted_as_it_is():
    b = batch([1, 2], [3])
    part, rows = ledger(1, 2, 3).drafted_part(b)
    assert part is b and rows == [0, 1]


def test_unwritten_slots_anywhere_in_the_context_are_dropped_in_order():
    part, rows = ledger(2, 5, 9).drafted_part(batch([9, 1, 5, 2, 8]))
    assert rows == [0] and part.context_slots[0].tolist() == [9, 5, 2]
    assert part.anchor_positions.tolist() == [5]  # the anchor keeps its position: context rows carry their own


def test_nothing_written_drafts_nothing_and_clear_forgets():
    assert ledger().drafted_part(batch([1], [2]))[1] == []
    written = ledger(1, 2)
    assert written.stale((torch.tensor([1, 2]), torch.tensor([2, 3]))) == [1]
    written.clear()
    assert written.stale((torch.tensor([1]),)) == [0] and written.drafted_part(batch([1]))[1] == []
