"""FlashInfer's view of a tree-verify batch: the CSR page table and flat custom mask that
`BatchPrefillWithPagedKVCacheWrapper.plan` reads, and how to build it.

Owns the record (`TreeCSR`) and its builders: from a `PagedTreeBatch`, or from a verify batch's host-side lengths,
a KV index table (SGLang's `KVIndexTable` contract) and its FULL-layout mask. The lengths come from the host, so
building on a GPU reads nothing back from it. Pure torch: no SGLang, no flashinfer.
"""

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Protocol

import torch

from attention_backends.mask import Rows, row_counts
from attention_backends.paged import PagedTreeBatch, PageTableLengths, exclusive_cumsum


@dataclass(frozen=True)
class TreeCSR(PageTableLengths):
    """What plan() reads. Key j of request b is token kv_indices[kv_indptr[b] + j // page_size] * page_size +
    j % page_size; request b's mask is [q_len_b, kv_len_b] row-major at offset sum(q_len_c * kv_len_c, c < b) of
    `mask` (FlashInfer's custom-mask layout, True = may attend)."""

    qo_indptr: torch.Tensor  # [bs + 1] int32, host
    kv_indptr: torch.Tensor  # [bs + 1] int32, host: page offsets
    kv_indices: torch.Tensor  # [kv_indptr[-1]] int32, on the cache's device: page ids in key order
    kv_last_page_len: torch.Tensor  # [bs] int32, host: keys in each request's last page, 1..page_size
    mask: torch.Tensor  # [sum(q_len_b * kv_len_b)] bool, on the cache's device
    page_size: int = 1

    def __post_init__(self) -> None:
        host = (self.qo_indptr, self.kv_indptr, self.kv_last_page_len)
        if any(t.device.type != "cpu" for t in host):
            raise ValueError("TreeCSR: indptrs and last-page lengths live on the host (plan() reads them there)")
        reads = sum(q * k for q, k in zip(self.q_lens, self.kv_lens))
        if self.mask.numel() != reads:
            raise ValueError(f"TreeCSR: mask has {self.mask.numel()} elements, the batch reads {reads}")


class KVTable(Protocol):
    """SGLang's `KVIndexTable` (sglang.srt.mem_cache.kv_index_translator), as far as a gather reads it: lane b's
    entry j is ids[row_ids[b], j // entry_page_size], expanded to a token when an entry is a page, then mapped
    through v2p (page-granular, at the translator's page size) when v2p is given."""

    ids: torch.Tensor  # [rows, width]
    row_ids: torch.Tensor  # [>= bs]
    entry_page_size: int
    v2p: torch.Tensor | None  # [virtual pages] physical page of each virtual page


def csr_of(batch: PagedTreeBatch, device: torch.device | str) -> TreeCSR:
    """A PagedTreeBatch (any device) -> its TreeCSR with the indices and the mask on `device`."""
    return TreeCSR(
        qo_indptr=batch.qo_indptr.cpu().to(torch.int32), kv_indptr=batch.kv_indptr.cpu().to(torch.int32),
        kv_indices=batch.kv_indices.to(device=device, dtype=torch.int32),
        kv_last_page_len=batch.kv_last_page_len.cpu().to(torch.int32), mask=batch.flat_mask.to(device),
        page_size=batch.page_size,
    )  # fmt: skip


def verify_csr(prefix_lens: Sequence[int], n_draft: Rows, slots: torch.Tensor, mask: torch.Tensor) -> TreeCSR:
    """A TARGET_VERIFY batch at page size 1 (SGLang's verify layout): request b has n_b query rows (n_draft: one count
    for all, or one per request) and prefix_lens[b] + n_b keys, whose token slots are `slots`
    [sum(prefix_lens[b] + n_b)] in order.
    Example: prefix_lens [2, 0], n_draft 2 -> qo_indptr [0, 2, 4], kv_indptr [0, 4, 6], kv_last_page_len [1, 1];
    n_draft [1, 3] -> qo_indptr [0, 1, 4], kv_indptr [0, 3, 6]."""
    counts = torch.tensor(row_counts(n_draft, len(prefix_lens)), dtype=torch.int32)
    kv_lens = torch.tensor(list(prefix_lens), dtype=torch.int32) + counts
    return TreeCSR(
        qo_indptr=exclusive_cumsum(counts), kv_indptr=exclusive_cumsum(kv_lens), kv_indices=slots.to(torch.int32),
        kv_last_page_len=torch.ones(len(prefix_lens), dtype=torch.int32), mask=mask,
    )  # fmt: skip


def table_slots(table: KVTable, lens: Sequence[int], v2p_page_size: int = 1) -> torch.Tensor:
    """The first lens[b] token slots of each lane b of `table`, concatenated -> [sum(lens)] int64 on the table's
    device. One gather, sized from the host lengths: no read-back from the device."""
    device = table.ids.device
    total = int(sum(lens))
    pinned = device.type == "cuda"  # a pinned copy is asynchronous; a pageable one waits for the stream
    lens_t = torch.tensor(list(lens), dtype=torch.int64, pin_memory=pinned).to(device, non_blocking=pinned)
    lane = torch.repeat_interleave(torch.arange(len(lens), device=device), lens_t, output_size=total)
    pos = torch.arange(total, device=device) - exclusive_cumsum(lens_t)[lane]
    rows = table.row_ids[:len(lens)].to(device=device, dtype=torch.int64)[lane]
    page = table.entry_page_size
    slots = table.ids[rows, pos // page].to(torch.int64)
    if page > 1:
        slots = slots * page + pos % page
    if table.v2p is None:
        return slots
    slots = slots.clamp(min=0)  # the sink (-1) reads page 0, as SGLang's own gather does
    return table.v2p[slots // v2p_page_size].to(torch.int64) * v2p_page_size + slots % v2p_page_size
