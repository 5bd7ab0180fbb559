"""The FlashInfer tree-verify backend ("dspark_flashinfer"): SGLang's FlashInfer backend whose eager TARGET_VERIFY
runs `attention_backends.flashinfer_tree` on the verify batch's tree masks.

Owns the eager TARGET_VERIFY path only (`TreeVerify`): one plan per verify batch in `init_forward_metadata`, KV
written and read as SGLang's FlashInfer backend does (per-layer write locations and scales, reads through the
runner's KV index translator). Prefill, decode and CUDA-graph capture/replay (verify included) stay
FlashInferAttnBackend's, which reads SGLang's FULL mask layout itself. What neither can do exactly is refused at
start-up (`attention_backends.layers`). Imported only when the backend is built.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING

import torch
from sglang.srt.layers.attention.flashinfer_backend import FlashInferAttnBackend
from sglang.srt.layers.radix_attention import AttentionType, RadixAttention
from sglang.srt.mem_cache.memory_pool import KVWriteLoc
from sglang.srt.model_executor.cuda_graph_config import Backend, Phase, check_cuda_graph_backend

from attention_backends.csr import TreeCSR, table_slots, verify_csr
from attention_backends.flashinfer_tree import new_wrapper, plan_tree_attention, run_tree_attention
from attention_backends.layers import LayerSpec, PlanDims, RunnerFacts, check_runner, plan_dims
from attention_backends.mask import MaskLayout, full_layout, spec_row_counts
from attention_backends.reference import sglang_mask_layout

if TYPE_CHECKING:
    from sglang.srt.model_executor.forward_batch_info import ForwardBatch
    from sglang.srt.model_executor.model_runner import ModelRunner


def layer_spec(layer: RadixAttention) -> LayerSpec:
    return LayerSpec(
        q_heads=layer.tp_q_head_num, kv_heads=layer.tp_k_head_num, head_dim_qk=layer.qk_head_dim,
        head_dim_vo=layer.v_head_dim, scaling=float(layer.scaling), logit_cap=float(layer.logit_cap or 0.0),
        sliding_window=layer.sliding_window_size,
        self_attention=not layer.is_cross_attention and layer.attn_type != AttentionType.ENCODER_ONLY,
        capping_method=layer.logit_capping_method,
    )  # fmt: skip


def model_dims(model: torch.nn.Module) -> PlanDims:
    """The plan every verify forward of `model` shares (VerifyRefusal when its layers cannot share one)."""
    return plan_dims([layer_spec(m) for m in model.modules() if isinstance(m, RadixAttention)])


class TreeVerify:
    """One TARGET_VERIFY forward on FlashInfer: `plan` once from the batch, then `forward` per layer."""

    def __init__(self, wrapper, dims: PlanDims, *, pool, translator, q_dtype: torch.dtype, kv_dtype: torch.dtype,
                 write_scales: Callable[[RadixAttention], tuple], mask_layout: MaskLayout):
        self.wrapper, self.dims, self.pool, self.translator = wrapper, dims, pool, translator
        self.q_dtype, self.kv_dtype, self.write_scales, self.mask_layout = q_dtype, kv_dtype, write_scales, mask_layout

    def csr(self, forward_batch: ForwardBatch) -> TreeCSR:
        """The batch's page table and mask. In TARGET_VERIFY seq_lens excludes the n_b verify rows, which the worker
        has already laid out after each prefix, so request b reads the first seq_len_b + n_b ids of its row."""
        spec_info = forward_batch.spec_info
        seq_lens = forward_batch.seq_lens_cpu
        if seq_lens is None:  # no host copy on this batch: read it back once, here
            seq_lens = forward_batch.seq_lens.cpu()
        prefix_lens = [int(x) for x in seq_lens.tolist()]
        counts = spec_row_counts(spec_info, len(prefix_lens))
        table = self.translator.read_source(forward_batch.kv_loc_plan, req_pool_indices=forward_batch.req_pool_indices,
                                            bs=len(prefix_lens))
        slots = table_slots(table, [p + n for p, n in zip(prefix_lens, counts)], self.translator.page_size)
        return verify_csr(prefix_lens, counts, slots, full_layout(spec_info.custom_mask, prefix_lens, counts,
                                                                  self.mask_layout))

    def plan(self, forward_batch: ForwardBatch) -> None:
        plan_tree_attention(self.wrapper, self.csr(forward_batch), self.dims, q_dtype=self.q_dtype,
                            kv_dtype=self.kv_dtype)

    def forward(self, q, k, v, layer: RadixAttention, forward_batch: ForwardBatch, save_kv_cache=True):
        """Write the layer's verify-row KV where SGLang's FlashInfer backend writes it, then attend on the plan."""
        if save_kv_cache and k is not None and v is not None:
            self.pool.set_kv_buffer(layer, KVWriteLoc.for_layer(forward_batch, layer), k, v, *self.write_scales(layer))
        k_cache, v_cache = self.pool.get_kv_buffer(layer.layer_id)
        o = run_tree_attention(self.wrapper, q.contiguous().view(-1, layer.tp_q_head_num, layer.qk_head_dim),
                               k_cache, v_cache, k_scale=layer.k_scale_float, v_scale=layer.v_scale_float)
        return o.view(-1, layer.tp_q_head_num * layer.v_head_dim)


class FlashInferTreeAttnBackend(FlashInferAttnBackend):
    """FlashInfer; eager TARGET_VERIFY planned from the batch's tree masks (one plan per forward)."""

    def __init__(self, model_runner: ModelRunner, mask_layout: MaskLayout | None = None):
        super().__init__(model_runner, init_new_workspace=model_runner.init_new_workspace)
        dims = model_dims(model_runner.model)
        translator = self.kv_index_translator
        check_runner(RunnerFacts(
            reads_untranslated=translator.needs_read_translate and not translator.reads_are_translated,
            dequant_workspace=self.prefill_uses_dequant_workspace or self.is_nvfp4_kvcache,
            verify_graphs=not check_cuda_graph_backend(Phase.DECODE, Backend.DISABLED),
        ), dims)  # fmt: skip
        self.tree = TreeVerify(
            new_wrapper(self.workspace_buffer), dims, pool=self.token_to_kv_pool, translator=translator,
            q_dtype=model_runner.dtype, kv_dtype=self.flashinfer_kv_cache_dtype, write_scales=self._kv_write_scales,
            mask_layout=mask_layout if mask_layout is not None else sglang_mask_layout(),
        )  # fmt: skip
        self.verifying = False

    def init_forward_metadata(self, forward_batch: ForwardBatch):
        self.verifying = forward_batch.forward_mode.is_target_verify()
        if not self.verifying:
            return super().init_forward_metadata(forward_batch)
        self.forward_metadata = None  # no parent plan this forward: a stray reader fails instead of reusing one
        self.tree.plan(forward_batch)

    def init_forward_metadata_out_graph(self, forward_batch: ForwardBatch, in_capture: bool = False):
        self.verifying = False  # graphs capture and replay FlashInferAttnBackend's own verify plan
        return super().init_forward_metadata_out_graph(forward_batch, in_capture)

    def forward_extend(self, q, k, v, layer: RadixAttention, forward_batch: ForwardBatch, save_kv_cache=True):
        if not (self.verifying and forward_batch.forward_mode.is_target_verify()):
            return super().forward_extend(q, k, v, layer, forward_batch, save_kv_cache)
        return self.tree.forward(q, k, v, layer, forward_batch, save_kv_cache)
