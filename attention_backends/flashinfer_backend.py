"""The FlashInfer tree-verify backend ("dspark_flashinfer"): SGLang's FlashInfer backend whose eager
TARGET_VERIFY runs `attention_backends.flashinfer_tree` on the same verify batch as the torch reference.

Owns the eager TARGET_VERIFY path only. Prefill, decode and CUDA-graph capture/replay (verify included) stay
FlashInferAttnBackend's, which reads SGLang's FULL mask layout itself. Imported only when the backend is built
(it imports SGLang's FlashInfer module, which needs flashinfer on a GPU).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from sglang.srt.layers.attention.flashinfer_backend import FlashInferAttnBackend
from sglang.srt.mem_cache.memory_pool import KVWriteLoc

from attention_backends.flashinfer_tree import new_wrapper, plan_tree_attention, run_tree_attention
from attention_backends.mask import MaskLayout
from attention_backends.paged import PagedTreeBatch
from attention_backends.reference import check_verify_layer, sglang_mask_layout, verify_batch

if TYPE_CHECKING:
    from sglang.srt.layers.radix_attention import RadixAttention
    from sglang.srt.model_executor.forward_batch_info import ForwardBatch
    from sglang.srt.model_executor.model_runner import ModelRunner


class FlashInferTreeAttnBackend(FlashInferAttnBackend):
    """FlashInfer; eager TARGET_VERIFY planned from dense per-request tree masks (one plan per forward)."""

    def __init__(self, model_runner: ModelRunner, mask_layout: MaskLayout | None = None):
        super().__init__(model_runner, init_new_workspace=model_runner.init_new_workspace)
        self.mask_layout = mask_layout if mask_layout is not None else sglang_mask_layout()
        self.tree_wrapper = new_wrapper(self.workspace_buffer)
        self.verify: PagedTreeBatch | None = None
        self.verify_planned = False

    def init_forward_metadata(self, forward_batch: ForwardBatch):
        self.verify, self.verify_planned = None, False
        if not forward_batch.forward_mode.is_target_verify():
            return super().init_forward_metadata(forward_batch)
        self.verify = verify_batch(forward_batch, self.req_to_token_pool.req_to_token, self.mask_layout)

    def init_forward_metadata_out_graph(self, forward_batch: ForwardBatch, in_capture: bool = False):
        self.verify, self.verify_planned = None, False  # graphs replay FlashInferAttnBackend's own verify plan
        return super().init_forward_metadata_out_graph(forward_batch, in_capture)

    def forward_extend(self, q, k, v, layer: RadixAttention, forward_batch: ForwardBatch, save_kv_cache=True):
        if self.verify is None or not forward_batch.forward_mode.is_target_verify():
            return super().forward_extend(q, k, v, layer, forward_batch, save_kv_cache)
        check_verify_layer(layer)
        if save_kv_cache and k is not None and v is not None:
            self.token_to_kv_pool.set_kv_buffer(layer, KVWriteLoc(forward_batch.out_cache_loc), k, v)
        k_cache, v_cache = self.token_to_kv_pool.get_kv_buffer(layer.layer_id)
        if not self.verify_planned:  # dims come off the first layer; every layer shares them
            plan_tree_attention(self.tree_wrapper, self.verify, num_qo_heads=layer.tp_q_head_num,
                                num_kv_heads=layer.tp_k_head_num, head_dim=layer.head_dim, q_dtype=q.dtype,
                                kv_dtype=k_cache.dtype, scale=layer.scaling)
            self.verify_planned = True
        o = run_tree_attention(self.tree_wrapper, q.view(-1, layer.tp_q_head_num, layer.head_dim), k_cache, v_cache)
        return o.view(-1, layer.tp_q_head_num * layer.head_dim)
