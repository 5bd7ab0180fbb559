"""Verification masks: which keys each verify row may see, as one dense bool matrix per request.

Owns the translation from SGLang's flattened `spec_info.custom_mask` layouts to dense masks and to the flat
layout FlashInfer consumes. Pure functions of tensors and ints: no SGLang imports, no globals; nothing here reads a
tensor back to the host.

Row i of a request's mask is verify row (draft node) i; its columns are the request's keys in cache order:
the cached prefix (`prefix_len` slots of `req_to_token`), then the request's verify rows themselves.
"""

from collections.abc import Sequence
from enum import Enum

import torch


class MaskLayout(Enum):
    """How SGLang flattens the verify tree mask of a batch (`TreeMaskMode` in sglang.kernels.ops.speculative).

    DRAFT_ONLY (QLEN_ONLY, SGLang's choice on CPU): per request an [n, n] block, row-major, requests back to
        back: element (b, i, j) at b*n*n + i*n + j. The prefix is implicitly visible.
    FULL (FULL_MASK, SGLang's choice on GPUs): per request an [n, prefix_b + n] block, row-major, requests
        back to back: request b starts at n*sum(prefix_<b) + b*n*n. This is FlashInfer's custom-mask layout.
    A ragged batch (the dspark worker's: request b has n_b rows, `spec_row_counts`) lays each request's block out
    the same way with its own n_b.
    In both, True means "may attend"; the draft part is ancestor-or-self (a chain is lower-triangular).
    A buffer may be longer than the batch needs (CUDA-graph padding); the tail is ignored.
    """

    DRAFT_ONLY = "draft_only"
    FULL = "full"


def chain_mask(n: int) -> torch.Tensor:
    """n -> bool [n, n], lower-triangular: draft i sees drafts 0..i."""
    return torch.ones(n, n, dtype=torch.bool).tril()


def with_prefix(draft_mask: torch.Tensor, prefix_len: int) -> torch.Tensor:
    """draft_mask [n, n] -> [n, prefix_len + n]: every verify row also sees the whole cached prefix."""
    n = draft_mask.shape[0]
    prefix = torch.ones(n, prefix_len, dtype=torch.bool, device=draft_mask.device)
    return torch.cat([prefix, draft_mask.to(torch.bool)], dim=1)


ROW_COUNTS = "dspark_row_counts"  # the spec info's attribute with each request's verify rows (ragged batches)

Rows = int | Sequence[int]  # verify rows: the same count for every request, or one count per request


def row_counts(n_draft: Rows, bs: int) -> list[int]:
    """Each request's verify rows. Example: (2, 3) -> [2, 2, 2]; ([1, 3], 2) -> [1, 3]."""
    counts = [int(n_draft)] * bs if isinstance(n_draft, int) else [int(n) for n in n_draft]
    if len(counts) != bs:
        raise ValueError(f"{len(counts)} verify row counts for a batch of {bs} requests")
    return counts


def spec_row_counts(spec_info, bs: int) -> list[int]:
    """The rows of each request of a TARGET_VERIFY batch: the spec info's ROW_COUNTS when it has them (the dspark
    worker's ragged batches), else its draft_token_num for every request (SGLang's own workers)."""
    counts = getattr(spec_info, ROW_COUNTS, None)
    return row_counts(int(spec_info.draft_token_num) if counts is None else counts, bs)


def layout_numel(layout: MaskLayout, prefix_lens: Sequence[int], n_draft: Rows) -> int:
    """Elements of `custom_mask` that a batch with these prefix lengths reads."""
    counts = row_counts(n_draft, len(prefix_lens))
    if layout is MaskLayout.DRAFT_ONLY:
        return sum(n * n for n in counts)
    return sum(n * (p + n) for n, p in zip(counts, prefix_lens))


def dense_verify_masks(custom_mask: torch.Tensor, prefix_lens: Sequence[int], n_draft: Rows,
                       layout: MaskLayout) -> list[torch.Tensor]:
    """custom_mask [>= layout_numel] -> one bool [n_b, prefix_lens[b] + n_b] per request (n_b its verify rows)."""
    flat = _flat(custom_mask, prefix_lens, n_draft, layout)
    masks, start = [], 0
    for prefix_len, n in zip(prefix_lens, row_counts(n_draft, len(prefix_lens))):
        width = n if layout is MaskLayout.DRAFT_ONLY else prefix_len + n
        block = flat[start:start + n * width].view(n, width).to(torch.bool)
        masks.append(with_prefix(block, prefix_len) if layout is MaskLayout.DRAFT_ONLY else block)
        start += n * width
    return masks


def flatten_masks(masks: Sequence[torch.Tensor]) -> torch.Tensor:
    """Per-request bool [q_len_b, kv_len_b] -> flat bool [sum(q_len_b * kv_len_b)] (the FULL layout)."""
    if not masks:
        return torch.zeros(0, dtype=torch.bool)
    return torch.cat([m.reshape(-1).to(torch.bool) for m in masks])


def full_layout(custom_mask: torch.Tensor, prefix_lens: Sequence[int], n_draft: Rows,
                layout: MaskLayout) -> torch.Tensor:
    """custom_mask [>= layout_numel] -> bool [layout_numel(FULL, ...)], on custom_mask's device: the FULL layout,
    which is FlashInfer's (a view of the buffer when it is already FULL and bool; CUDA-graph padding dropped)."""
    if layout is MaskLayout.DRAFT_ONLY:
        return flatten_masks(dense_verify_masks(custom_mask, prefix_lens, n_draft, layout))
    return _flat(custom_mask, prefix_lens, n_draft, layout)[:layout_numel(layout, prefix_lens, n_draft)].to(torch.bool)


def _flat(custom_mask: torch.Tensor, prefix_lens: Sequence[int], n_draft: Rows, layout: MaskLayout) -> torch.Tensor:
    """custom_mask as one flat tensor, after checking it holds what the batch reads."""
    need = layout_numel(layout, prefix_lens, n_draft)
    flat = custom_mask.reshape(-1)
    if flat.numel() < need:
        raise ValueError(f"custom_mask has {flat.numel()} elements; layout {layout.value} with prefix lengths "
                         f"{list(prefix_lens)} and {n_draft} verify rows needs {need}")
    return flat
