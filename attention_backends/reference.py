"""The torch reference attention backend ("dspark_torch"): SGLang's torch_native plus ForwardMode.TARGET_VERIFY.

Owns the SGLang-facing shell only: it reads the verify batch off SGLang's ForwardBatch once per forward
(`paged_tree_batch`) and runs `paged_tree_attention` per layer. Prefill and decode stay torch_native's.
Must not change how other forward modes run; DRAFT_EXTEND_V2 (EAGLE's draft model) is not supported.
"""

from __future__ import annotations

from dataclasses import replace
from typing import TYPE_CHECKING

import torch
from sglang.srt.layers.attention.torch_native_backend import TorchNativeAttnBackend
from sglang.srt.layers.radix_attention import AttentionType
from sglang.srt.mem_cache.memory_pool import KVWriteLoc
from sglang.srt.speculative.eagle_utils import TreeMaskMode, default_tree_mask_mode

from attention_backends.mask import MaskLayout, dense_verify_masks, spec_row_counts
from attention_backends.paged import PagedTreeBatch, paged_tree_attention
from attention_backends.window import layer_window, windowed_masks

if TYPE_CHECKING:
    from sglang.srt.layers.radix_attention import RadixAttention
    from sglang.srt.model_executor.forward_batch_info import ForwardBatch
    from sglang.srt.model_executor.model_runner import ModelRunner

_LAYOUT_OF_MODE = {TreeMaskMode.QLEN_ONLY: MaskLayout.DRAFT_ONLY, TreeMaskMode.FULL_MASK: MaskLayout.FULL}


def sglang_mask_layout() -> MaskLayout:
    """The layout SGLang's NGRAM/EAGLE workers write `custom_mask` in on this platform (QLEN_ONLY on CPU)."""
    mode = default_tree_mask_mode()
    if mode not in _LAYOUT_OF_MODE:
        raise RuntimeError(f"sglang.srt.speculative.eagle_utils.default_tree_mask_mode() returned {mode!r}; "
                           f"the dspark attention backends read only {sorted(m.name for m in _LAYOUT_OF_MODE)}")
    return _LAYOUT_OF_MODE[mode]


def paged_tree_batch(forward_batch: ForwardBatch, req_to_token: torch.Tensor, layout: MaskLayout) -> PagedTreeBatch:
    """A TARGET_VERIFY ForwardBatch -> its PagedTreeBatch (page size 1: pages are token slots).

    In TARGET_VERIFY, seq_lens excludes the n_b verify rows and the worker has already laid the rows out in
    req_to_token[req, seq_len:seq_len + n_b] (out_cache_loc), so each request's keys are
    req_to_token[req, :seq_len + n_b].
    """
    spec_info = forward_batch.spec_info
    seq_lens = forward_batch.seq_lens_cpu if forward_batch.seq_lens_cpu is not None else forward_batch.seq_lens
    prefix_lens = [int(x) for x in seq_lens.tolist()]
    counts = spec_row_counts(spec_info, len(prefix_lens))
    rows = forward_batch.req_pool_indices.tolist()
    slots = [req_to_token[row, :prefix_len + n] for row, prefix_len, n in zip(rows, prefix_lens, counts)]
    masks = dense_verify_masks(spec_info.custom_mask, prefix_lens, counts, layout)
    return PagedTreeBatch.from_token_slots(slots, [m.to(req_to_token.device) for m in masks])


class TreeTorchNativeAttnBackend(TorchNativeAttnBackend):
    """torch_native, with TARGET_VERIFY run as per-request SDPA over prefix + verify rows under the tree mask."""

    def __init__(self, model_runner: ModelRunner, mask_layout: MaskLayout | None = None):
        super().__init__(model_runner)
        self.mask_layout = mask_layout if mask_layout is not None else sglang_mask_layout()
        self.verify: PagedTreeBatch | None = None
        self.windowed: dict[int, PagedTreeBatch] = {}  # this forward's verify batch per sliding window

    def init_forward_metadata(self, forward_batch: ForwardBatch):
        super().init_forward_metadata(forward_batch)
        self.verify, self.windowed = None, {}
        if forward_batch.forward_mode.is_target_verify():
            self.verify = paged_tree_batch(forward_batch, self.req_to_token_pool.req_to_token, self.mask_layout)

    def forward_extend(self, q, k, v, layer: RadixAttention, forward_batch: ForwardBatch, save_kv_cache=True):
        if not forward_batch.forward_mode.is_target_verify():
            return super().forward_extend(q, k, v, layer, forward_batch, save_kv_cache)
        check_verify_layer(layer)
        if save_kv_cache and k is not None and v is not None:
            self.token_to_kv_pool.set_kv_buffer(
                layer, KVWriteLoc(forward_batch.out_cache_loc, self.swa_out_cache_loc), k, v)
        o = q.new_empty((q.shape[0], layer.tp_q_head_num * layer.v_head_dim))
        paged_tree_attention(
            q.view(-1, layer.tp_q_head_num, layer.qk_head_dim),
            self.token_to_kv_pool.get_key_buffer(layer.layer_id),
            self.token_to_kv_pool.get_value_buffer(layer.layer_id),
            self.verify_for(layer), layer.scaling, out=o.view(-1, layer.tp_q_head_num, layer.v_head_dim),
        )  # fmt: skip
        return o

    def verify_for(self, layer: RadixAttention) -> PagedTreeBatch:
        """The verify batch, its masks narrowed to the layer's sliding window (built once per window and forward)."""
        window = layer_window(layer.sliding_window_size)
        if window is None:
            return self.verify
        if window not in self.windowed:
            prefix_lens = [kv - q for kv, q in zip(self.verify.kv_lens, self.verify.q_lens)]
            self.windowed[window] = replace(self.verify, masks=windowed_masks(self.verify.masks, prefix_lens, window))
        return self.windowed[window]


def check_verify_layer(layer: RadixAttention) -> None:
    """Tree verification is self-attention over the full cache; refuse what it would silently get wrong."""
    if layer.is_cross_attention or layer.attn_type == AttentionType.ENCODER_ONLY:
        raise NotImplementedError("dspark_torch: TARGET_VERIFY supports causal self-attention layers only")
    if layer.logit_cap and layer.logit_cap > 0:
        raise NotImplementedError("dspark_torch: TARGET_VERIFY does not support logit soft-capping")
