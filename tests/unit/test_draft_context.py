"""The in-process drafter's context (sgl_dspark.draft_worker.local.SlotContextStore and
sgl_dspark.drafter.context.ContextBuffer): with request ids, each request drafts from a buffer of its own that grows
by the rows written since its last draft only, and drafts what one padded copy of all its rows drafts."""

import torch

from fixture_drafters import tiny_hf_config
from sgl_dspark.draft_worker.client import ContextUpdate, DraftBatch
from sgl_dspark.draft_worker.local import RETAIN_CALLS, LocalDraftClient
from sgl_dspark.drafter import DraftKnobs
from sgl_dspark.drafter.context import HEADROOM, ContextBuffer, ContextKV
from sgl_dspark.drafter.fresh import random_drafter
from sgl_dspark.sampling import SamplingParams

GREEDY = SamplingParams(temperature=0.0)
DRAFTER, _ = random_drafter(tiny_hf_config(), seed=3)
SLOTS = torch.randperm(256, generator=torch.Generator().manual_seed(1))  # request b's position p -> SLOTS[64 b + p]


def features(n: int, seed: int) -> torch.Tensor:
    return torch.randn(n, 64, generator=torch.Generator().manual_seed(seed))


def slots(b: int, n: int) -> torch.Tensor:
    return SLOTS[64 * b:64 * b + n]


def decode(rids: bool, steps: int = 6) -> tuple[list[list], list[int]]:
    """Two requests (contexts of 5 and 9 rows) drafted `steps` times, 1-3 rows committed to each after every draft
    -> (each step's trees, context rows copied out of the pool at each step)."""
    client = LocalDraftClient(DRAFTER, DraftKnobs(), 256, seed=0)
    lengths = [5, 9]
    for b, n in enumerate(lengths):
        client.write_context(ContextUpdate(slots(b, n), torch.arange(n), features(n, b)))
    trees, copied = [], []
    for step in range(steps):
        batch = DraftBatch(tuple(slots(b, n) for b, n in enumerate(lengths)), torch.tensor([3 + step, 7]),
                           torch.tensor(lengths), (GREEDY, GREEDY), ("a", "b") if rids else ())
        before = client.rows_copied
        trees.append(client.propose(batch))
        copied.append(client.rows_copied - before)
        for b in range(2):  # the commit: the accepted rows' features at their slots
            k = 1 + (step + b) % 3
            new = torch.arange(lengths[b], lengths[b] + k)
            client.write_context(ContextUpdate(slots(b, lengths[b] + k)[-k:], new, features(k, 100 * step + b)))
            lengths[b] += k
    return trees, copied


def test_buffers_draft_what_the_padded_copy_drafts_and_copy_only_new_rows():
    buffered, copied = decode(rids=True)
    padded, copied_all = decode(rids=False)
    for mine, theirs in zip(buffered, padded):
        for a, b in zip(mine, theirs):
            assert torch.equal(a.tokens, b.tokens) and torch.equal(a.parents, b.parents)
            torch.testing.assert_close(a.confidence, b.confidence, rtol=1e-5, atol=1e-6)
    committed = [sum(1 + (step + b) % 3 for b in range(2)) for step in range(5)]
    assert copied == [5 + 9, *committed]  # every row once: the first draft's, then each commit's
    assert copied_all == [5 + 9 + sum(committed[:i]) for i in range(6)]  # every row, every step


def test_a_restarted_context_is_copied_again_and_idle_buffers_are_dropped():
    client = LocalDraftClient(DRAFTER, DraftKnobs(), 256, seed=0)
    client.write_context(ContextUpdate(SLOTS[:40], torch.arange(40) % 20, features(40, 0)))

    def draft(rid: str, context: torch.Tensor) -> int:
        before = client.rows_copied
        client.propose(DraftBatch((context,), torch.tensor([1]), torch.tensor([context.numel()]), (GREEDY,), (rid,)))
        return client.rows_copied - before

    assert draft("a", SLOTS[:6]) == 6
    assert draft("a", SLOTS[:8]) == 2  # extended: the two new rows
    assert draft("a", SLOTS[:8]) == 0
    client.write_context(ContextUpdate(SLOTS[20:28], torch.arange(8), features(8, 1), restart=("a",)))
    assert "a" not in client.store.buffers  # prefilled again (retracted, then back): its rows are dropped
    assert draft("a", SLOTS[20:28]) == 8  # and copied again, all of them
    assert draft("a", SLOTS[20:25]) == 5  # shorter than the buffer: not an extension
    for _ in range(RETAIN_CALLS):
        draft("b", SLOTS[30:32])
    assert "a" in client.store.buffers
    draft("b", SLOTS[30:32])
    assert "a" not in client.store.buffers and "b" in client.store.buffers


def test_a_restart_drafts_from_the_new_rows_not_the_old_ones():
    """Without the restart a same-length context would be taken as the old one; with it, the draft is the one a
    fresh client makes from the new rows."""
    def first_tree(client, rid: str, context: torch.Tensor):
        batch = DraftBatch((context,), torch.tensor([1]), torch.tensor([context.numel()]), (GREEDY,), (rid,))
        return client.propose(batch)[0]

    old = ContextUpdate(SLOTS[:6], torch.arange(6), features(6, 0))
    new = ContextUpdate(SLOTS[6:12], torch.arange(6), features(6, 5), restart=("a",))
    client, fresh = (LocalDraftClient(DRAFTER, DraftKnobs(), 256, seed=0) for _ in range(2))
    client.write_context(old)
    first_tree(client, "a", SLOTS[:6])
    client.write_context(new)
    fresh.write_context(new)
    mine, theirs = first_tree(client, "a", SLOTS[6:12]), first_tree(fresh, "a", SLOTS[6:12])
    torch.testing.assert_close(mine.confidence, theirs.confidence)
    assert torch.equal(mine.tokens, theirs.tokens)


def test_context_buffer_appends_grows_and_takes_the_block_after_its_rows():
    def rows(n: int, start: float) -> ContextKV:
        keys = start + torch.arange(n * 2 * 2 * 3, dtype=torch.float32).view(2, n, 2, 3)
        return ContextKV(keys, -keys)

    buffer = ContextBuffer(rows(3, 0.0), room=2)
    assert buffer.keys.shape[1] == 3 + 2 + HEADROOM and buffer.length == 3
    buffer.append(rows(HEADROOM + 1, 100.0))  # one row more than fits: it grows
    end = 3 + HEADROOM + 1
    assert buffer.keys.shape[1] == end + 2 + max(HEADROOM, end // 4) and buffer.length == end
    assert torch.equal(buffer.keys[:, :3], rows(3, 0.0).keys)  # the rows before survive the growth
    assert torch.equal(buffer.values[:, 3:end], -rows(HEADROOM + 1, 100.0).keys)
    buffer = ContextBuffer(rows(3, 0.0), room=2)
    buffer.append(rows(1, 100.0))
    assert buffer.keys.shape[1] == 3 + 2 + HEADROOM and buffer.length == 4  # within its headroom
    assert torch.equal(buffer.keys[:, :3], rows(3, 0.0).keys)
    assert torch.equal(buffer.values[:, 3], -rows(1, 100.0).keys[:, 0])
    block = torch.full((2, 2, 3), 0.5)
    k, v = buffer.with_block(1, block, -block)
    assert k.shape == (6, 2, 3) and torch.equal(k[4:], block) and torch.equal(v[4:], -block)
    assert torch.equal(k[:4], buffer.keys[1, :4]) and k.data_ptr() == buffer.keys[1].data_ptr()  # a view: no copy
    assert buffer.length == 4  # the block's rows are scratch
