"""KV-cache pool ops: slot moves across all layers and req_to_token writes.

Semantics follow SGLang's own kernels for the same ops:
``copy_all_layer_kv_cache_tiled`` (sglang/kernels/ops/kvcache/cache_move.py)
and ``assign_req_to_token_pool`` (sglang/srt/mem_cache/allocation.py).
"""

from __future__ import annotations

import ctypes

import torch

from ._common import flat, ragged


def _host_rows(address: int, num_rows: int, row_bytes: int) -> torch.Tensor:
    """A ``[num_rows, row_bytes]`` uint8 tensor aliasing host memory at ``address``."""
    if address == 0:
        raise ValueError("sgl_kernel CPU stand-in: null buffer pointer in data_ptrs")
    raw = (ctypes.c_uint8 * (num_rows * row_bytes)).from_address(address)
    return torch.frombuffer(raw, dtype=torch.uint8).view(num_rows, row_bytes)


def copy_all_layer_kv_cache_cpu(
    data_ptrs: torch.Tensor,
    strides: torch.Tensor,
    tgt_loc: torch.Tensor,
    src_loc: torch.Tensor,
) -> None:
    """Copy slot rows ``src_loc[i] -> tgt_loc[i]`` in every buffer, in place.

    data_ptrs: [num_buffers] uint64, host address of slot 0 of each buffer
        (``buf.data_ptr()`` of every per-layer K/V pool).
    strides:   [num_buffers] int64, bytes per slot of each buffer
        (``buf.stride(0) * itemsize``); the whole slot is copied.
    tgt_loc, src_loc: [n] integer slot indices (SGLang passes the first
        ``num_locs`` entries).

    All source rows are read before any target row is written, as in the
    Triton kernel, so overlapping src/tgt sets are safe. Host memory only.
    """
    tgt = tgt_loc.reshape(-1).to(torch.int64)
    src = src_loc.reshape(-1).to(torch.int64)
    if tgt.numel() != src.numel():
        raise ValueError(
            f"sgl_kernel CPU stand-in: tgt_loc has {tgt.numel()} entries, "
            f"src_loc has {src.numel()}"
        )
    if tgt.numel() == 0:
        return
    if data_ptrs.device.type != "cpu" or tgt.device.type != "cpu":
        raise ValueError("sgl_kernel CPU stand-in: copy_all_layer_kv_cache_cpu is host-only")
    lo = int(torch.minimum(tgt.min(), src.min()))
    if lo < 0:
        raise IndexError(f"sgl_kernel CPU stand-in: negative KV slot index {lo}")
    num_rows = int(torch.maximum(tgt.max(), src.max())) + 1
    for address, row_bytes in zip(data_ptrs.tolist(), strides.tolist()):
        if row_bytes <= 0:
            continue
        rows = _host_rows(int(address), num_rows, int(row_bytes))
        rows[tgt] = rows[src]


def assign_req_to_token_pool_cpu(
    req_pool_indices: torch.Tensor,
    req_to_token: torch.Tensor,
    start_offset: torch.Tensor,
    end_offset: torch.Tensor,
    out_cache_loc: torch.Tensor,
    pool_len: int,
) -> None:
    """Write freshly allocated KV slots into the request-to-token table, in place.

    req_pool_indices: [bs] int, row of each request in ``req_to_token``.
    req_to_token:     [num_rows, pool_len] int32 (contiguous), updated.
    start_offset, end_offset: [bs] int, column range written per request.
    out_cache_loc:    [sum(end - start)] int64, the slots, packed request by request.
    pool_len:         row stride of ``req_to_token`` (SGLang passes ``shape[1]``).

    ``req_to_token[req_pool_indices[i], start[i]:end[i]] = out_cache_loc[o_i : o_i + len_i]``
    with ``o_i = sum_{j<i} (end[j] - start[j])``; values are cast to the table dtype.
    """
    table = flat(req_to_token, "req_to_token")
    seg, col, out = ragged(start_offset, end_offset)
    if seg.numel() == 0:
        return
    rows = req_pool_indices.reshape(-1).to(torch.int64)[seg]
    values = out_cache_loc.reshape(-1)[out]
    table[rows * pool_len + col] = values.to(table.dtype)
