"""Tree attention over a paged KV cache in plain torch: the reference the SGLang CPU backend runs and the GPU
kernels are checked against.

Owns the batch record (FlashInfer's CSR page table plus one dense mask per request) and the per-request SDPA.
Pure: no SGLang imports, no globals; runs on any torch device.
"""

from collections.abc import Sequence
from dataclasses import dataclass
from functools import cached_property

import torch
from torch.nn.functional import scaled_dot_product_attention

from attention_backends.mask import flatten_masks


class PageTableLengths:
    """Query rows and keys per request of a record holding FlashInfer's page table (qo_indptr, kv_indptr,
    kv_last_page_len, page_size). Example: kv_indptr [0, 2, 3], kv_last_page_len [1, 2], page_size 3 -> kv_lens
    [4, 2]."""

    @cached_property
    def q_lens(self) -> list[int]:
        return self.qo_indptr.diff().tolist()

    @cached_property
    def kv_lens(self) -> list[int]:
        return ((self.kv_indptr.diff() - 1) * self.page_size + self.kv_last_page_len).tolist()


@dataclass(frozen=True)
class PagedTreeBatch(PageTableLengths):
    """Query rows and paged keys of a batch of requests, with the mask each request's rows attend under.

    The page table is FlashInfer's paged-prefill layout; page_size 1 makes pages SGLang's token slots.
    Key j of request b lives in slot kv_indices[kv_indptr[b] + j // page_size] * page_size + j % page_size.
    """

    qo_indptr: torch.Tensor  # [batch + 1] int32: request b's query rows are q[qo_indptr[b]:qo_indptr[b + 1]]
    kv_indptr: torch.Tensor  # [batch + 1] int32: request b's pages are kv_indices[kv_indptr[b]:kv_indptr[b + 1]]
    kv_indices: torch.Tensor  # [kv_indptr[-1]] int32: page ids, in key order
    kv_last_page_len: torch.Tensor  # [batch] int32: entries used in each request's last page, 1..page_size
    masks: tuple[torch.Tensor, ...]  # per request bool [q_len_b, kv_len_b]: True = may attend
    page_size: int = 1

    def __post_init__(self) -> None:
        if len(self.masks) != self.batch_size or self.kv_indptr.shape[0] != self.batch_size + 1:
            raise ValueError(f"PagedTreeBatch: {len(self.masks)} masks, qo_indptr {tuple(self.qo_indptr.shape)}, "
                             f"kv_indptr {tuple(self.kv_indptr.shape)} disagree on the batch size")
        for b, (mask, q_len, kv_len) in enumerate(zip(self.masks, self.q_lens, self.kv_lens)):
            if tuple(mask.shape) != (q_len, kv_len):
                raise ValueError(f"PagedTreeBatch: mask {b} is {tuple(mask.shape)}, expected {(q_len, kv_len)}")

    @property
    def batch_size(self) -> int:
        return self.qo_indptr.shape[0] - 1

    @property
    def flat_mask(self) -> torch.Tensor:
        """bool [sum(q_len_b * kv_len_b)]: the masks in FlashInfer's custom-mask layout."""
        return flatten_masks(self.masks)

    @cached_property
    def kv_slots(self) -> tuple[torch.Tensor, ...]:
        """Per request [kv_len_b] int64: the cache slot of each key, in key order (computed once per batch)."""
        bounds = self.kv_indptr.tolist()
        offsets = torch.arange(self.page_size, device=self.kv_indices.device)
        slots = []
        for b, kv_len in enumerate(self.kv_lens):
            pages = self.kv_indices[bounds[b]:bounds[b + 1]].to(torch.int64)
            slots.append((pages[:, None] * self.page_size + offsets).reshape(-1)[:kv_len])
        return tuple(slots)

    @staticmethod
    def from_token_slots(slots: Sequence[torch.Tensor], masks: Sequence[torch.Tensor]) -> "PagedTreeBatch":
        """Per request slots [kv_len_b] and masks [q_len_b, kv_len_b] -> a page_size-1 batch."""
        device = slots[0].device if slots else torch.device("cpu")
        q_lens = torch.tensor([m.shape[0] for m in masks], dtype=torch.int32, device=device)
        kv_lens = torch.tensor([s.numel() for s in slots], dtype=torch.int32, device=device)
        return PagedTreeBatch(
            qo_indptr=exclusive_cumsum(q_lens), kv_indptr=exclusive_cumsum(kv_lens),
            kv_indices=torch.cat(list(slots)).to(torch.int32) if slots else torch.zeros(0, dtype=torch.int32),
            kv_last_page_len=torch.ones_like(kv_lens), masks=tuple(masks), page_size=1,
        )  # fmt: skip


def exclusive_cumsum(lens: torch.Tensor) -> torch.Tensor:
    """lens [n] -> [n + 1] in lens' dtype and device: 0, then the running sums. Example: [2, 3] -> [0, 2, 5]."""
    out = torch.zeros(lens.shape[0] + 1, dtype=lens.dtype, device=lens.device)
    out[1:] = lens.cumsum(0)
    return out


def token_rows(cache: torch.Tensor) -> torch.Tensor:
    """A KV cache [slots, heads, dim] (SGLang) or [pages, page_size, heads, dim] (NHD) -> [slots, heads, dim]."""
    return cache if cache.dim() == 3 else cache.reshape(-1, *cache.shape[-2:])


def paged_tree_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, batch: PagedTreeBatch,
                         scale: float, out: torch.Tensor | None = None) -> torch.Tensor:
    """Masked attention of each request's query rows over its paged keys, one SDPA per request.

    q [total_q, q_heads, dim]; k_cache/v_cache [slots, kv_heads, dim] or [pages, page_size, kv_heads, dim];
    q_heads a multiple of kv_heads (grouped-query attention). Returns out [total_q, q_heads, v_dim].
    """
    k_rows, v_rows = token_rows(k_cache), token_rows(v_cache)
    if out is None:
        out = q.new_empty(q.shape[0], q.shape[1], v_rows.shape[-1])
    gqa = q.shape[1] != k_rows.shape[1]
    starts = batch.qo_indptr.tolist()
    for b, (mask, slots) in enumerate(zip(batch.masks, batch.kv_slots)):
        rows = slice(starts[b], starts[b + 1])
        # [heads, len, dim] per request, as SDPA wants
        q_b = q[rows].movedim(0, 1)
        k_b = torch.index_select(k_rows, 0, slots).movedim(0, 1).to(q.dtype)  # on CPU ~4x faster than k_rows[slots]
        v_b = torch.index_select(v_rows, 0, slots).movedim(0, 1).to(q.dtype)
        o_b = scaled_dot_product_attention(q_b.unsqueeze(0), k_b.unsqueeze(0), v_b.unsqueeze(0),
                                           attn_mask=mask.to(q.device), scale=scale, enable_gqa=gqa)
        out[rows] = o_b.squeeze(0).movedim(1, 0)
    return out
