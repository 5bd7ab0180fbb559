"""The dspark_flashinfer SGLang shell on CPU: one plan per verify batch (planned with the most query heads, the
value head size and the soft cap), KV written at SGLang's write locations with the layer's scales into SGLang's own
CPU pool, per-layer KV scales handed to run(), the routing between our eager verify and FlashInfer's own paths,
and the start-up refusal. FlashInfer is replaced by a recorder that attends over what FlashInfer would read."""

from functools import partial
from types import SimpleNamespace

import pytest
import torch

from attention_backends.csr import TreeCSR
from attention_backends.layers import VerifyRefusal
from attention_backends.mask import MaskLayout, flatten_masks, with_prefix
from attention_backends.oracle import dense_attention
from sgl_dspark.layout import pack_trees
from sgl_dspark.tree import DraftTree
from test_flashinfer_layout import flashinfer_reads

KV_HEADS, DIM, SCALE, CAP = 2, 8, 0.3, 5.0


class RecordingWrapper:
    """FlashInfer's paged-prefill wrapper as the shell calls it: plan() is recorded, run() attends with the dense
    oracle over what FlashInfer would read from the plan (mask and key slots) and the dequantized cache."""

    def __init__(self):
        self.plans, self.runs = [], []

    def plan(self, qo_indptr, kv_indptr, kv_indices, kv_last_page_len, num_qo_heads, num_kv_heads, head_dim_qk,
             page_size, *, custom_mask, **kwargs):
        csr = TreeCSR(qo_indptr, kv_indptr, kv_indices, kv_last_page_len, custom_mask, page_size)
        self.plans.append(SimpleNamespace(csr=csr, heads=(num_qo_heads, num_kv_heads), head_dim_qk=head_dim_qk,
                                          **kwargs))

    def run(self, q, kv_cache, *, k_scale=None, v_scale=None, out=None):
        plan = self.plans[-1]
        self.runs.append((q.shape[1], k_scale, v_scale))
        masks, slots = flashinfer_reads(plan.csr)
        rows = plan.csr.qo_indptr.tolist()
        k_cache, v_cache = (c.float() * (s or 1.0) for c, s in zip(kv_cache, (k_scale, v_scale)))
        return torch.cat([dense_attention(q[rows[b]:rows[b + 1]].float(), k_cache[s], v_cache[s], m,
                                          plan.sm_scale, plan.logits_soft_cap)
                          for b, (m, s) in enumerate(zip(masks, slots))])


def radix_layer(layer_id: int, q_heads: int, k_scale: float, v_scale: float):
    from sglang.srt.layers.radix_attention import RadixAttention

    layer = RadixAttention(q_heads, DIM, SCALE, KV_HEADS, layer_id=layer_id, logit_cap=CAP)
    layer.k_scale, layer.v_scale = torch.tensor(k_scale), torch.tensor(v_scale)
    layer.k_scale_float, layer.v_scale_float = k_scale, v_scale
    return layer


def tree(parents: list[int]) -> DraftTree:
    n = len(parents)
    return DraftTree(torch.arange(n), torch.tensor(parents), torch.ones(n))


@pytest.fixture
def verify_setup():
    """Two requests (prefix 3 and 5, trees of 3 and 1 nodes padded to width 3) on SGLang's CPU pools with an FP8
    cache, a two-layer model (8 and 4 query heads, KV scales per layer), and the TreeVerify the shell builds."""
    from sglang.srt.layers.attention.flashinfer_backend import FlashInferAttnBackend
    from sglang.srt.mem_cache.allocator import TokenToKVPoolAllocator
    from sglang.srt.mem_cache.kv_index_translator import KVIndexTranslator
    from sglang.srt.mem_cache.memory_pool import KVWriteLoc, MHATokenToKVPool, ReqToTokenPool
    from sglang.srt.model_executor.forward_batch_info import ForwardMode
    from sglang.srt.speculative.ngram_info import NgramVerifyInput

    from attention_backends.flashinfer_backend import TreeVerify, model_dims

    gen = torch.Generator().manual_seed(5)
    pool = MHATokenToKVPool(size=64, page_size=1, dtype=torch.float8_e4m3fn, head_num=KV_HEADS, head_dim=DIM,
                            layer_num=2, device="cpu", enable_memory_saver=False)
    req_to_token = ReqToTokenPool(size=3, max_context_len=16, device="cpu", enable_memory_saver=False).req_to_token
    allocator = TokenToKVPoolAllocator(64, torch.float8_e4m3fn, "cpu", pool, need_sort=False)
    translator = KVIndexTranslator(req_to_token=req_to_token, token_to_kv_pool_allocator=allocator,
                                   token_to_kv_pool=pool, page_size=1, device="cpu")
    model = torch.nn.ModuleList([radix_layer(0, 8, 0.5, 2.0), radix_layer(1, 4, 0.25, 1.5)])
    seq_lens, pool_rows = [3, 5], [2, 0]
    rows = pack_trees([tree([-1, 0, 1]), tree([-1])], seq_lens)
    width = rows.width
    for row, p in zip(pool_rows, seq_lens):
        req_to_token[row, :p + width] = allocator.alloc(p + width).to(req_to_token.dtype)
    prefix = [req_to_token[row, :p].long() for row, p in zip(pool_rows, seq_lens)]
    for layer in model:  # the cached prefix, stored as SGLang stores it (divided by the layer's scales)
        loc = torch.cat(prefix)
        k, v = (torch.randn(loc.numel(), KV_HEADS, DIM, generator=gen) for _ in range(2))
        pool.set_kv_buffer(layer, KVWriteLoc(loc), k, v, layer.k_scale, layer.v_scale)
    out_cache_loc = torch.cat([req_to_token[row, p:p + width] for row, p in zip(pool_rows, seq_lens)]).long()
    custom_mask = flatten_masks([with_prefix(m, p) for m, p in zip(rows.mask, seq_lens)])  # the worker's GPU layout
    batch = SimpleNamespace(
        forward_mode=ForwardMode.TARGET_VERIFY, seq_lens=torch.tensor(seq_lens), seq_lens_cpu=torch.tensor(seq_lens),
        req_pool_indices=torch.tensor(pool_rows), out_cache_loc=out_cache_loc, out_cache_loc_is_physical=False,
        encoder_out_cache_loc=None, kv_loc_plan=None,
        spec_info=NgramVerifyInput(draft_token=rows.tokens, custom_mask=custom_mask, positions=rows.positions,
                                   draft_token_num=width),
    )  # fmt: skip
    wrapper = RecordingWrapper()
    write_scales = partial(FlashInferAttnBackend._kv_write_scales,
                           SimpleNamespace(kv_cache_quant_method=pool.get_kv_cache_quant_method()))
    verify = TreeVerify(wrapper, model_dims(model), pool=pool, translator=translator, q_dtype=torch.bfloat16,
                        kv_dtype=torch.float8_e4m3fn, write_scales=write_scales, mask_layout=MaskLayout.FULL)
    return SimpleNamespace(verify=verify, wrapper=wrapper, batch=batch, model=model, pool=pool, rows=rows,
                           seq_lens=seq_lens, prefix=prefix, out_cache_loc=out_cache_loc, gen=gen)


def test_one_plan_per_verify_batch_with_the_shared_dims(verify_setup):
    s = verify_setup
    s.verify.plan(s.batch)
    (plan,) = s.wrapper.plans
    assert plan.heads == (8, KV_HEADS) and plan.head_dim_qk == DIM and plan.head_dim_vo == DIM
    assert plan.sm_scale == SCALE and plan.logits_soft_cap == CAP
    assert plan.q_data_type == torch.bfloat16 and plan.kv_data_type == torch.float8_e4m3fn
    assert plan.csr.page_size == 1 and plan.csr.qo_indptr.tolist() == [0, 3, 6]
    assert plan.csr.kv_indptr.tolist() == [0, 6, 14]


def test_verify_layers_write_scaled_kv_and_match_the_oracle(verify_setup):
    s = verify_setup
    n, bs = s.rows.width, len(s.seq_lens)
    s.verify.plan(s.batch)
    for layer in s.model:
        q = torch.randn(bs * n, layer.tp_q_head_num * DIM, generator=s.gen)
        k, v = (torch.randn(bs * n, KV_HEADS, DIM, generator=s.gen) for _ in range(2))  # as RadixAttention views them
        k_new, v_new = k.clone(), v.clone()  # set_kv_buffer scales k and v in place
        got = s.verify.forward(q, k, v, layer, s.batch)

        k_cache, v_cache = (c.float() for c in s.pool.get_kv_buffer(layer.layer_id))
        stored_k, stored_v = k_cache[s.out_cache_loc], v_cache[s.out_cache_loc]
        torch.testing.assert_close(stored_k * layer.k_scale_float, k_new, atol=1e-2, rtol=0.07)  # FP8 rounding
        torch.testing.assert_close(stored_v * layer.v_scale_float, v_new, atol=1e-2, rtol=0.07)
        for b, (p, loc) in enumerate(zip(s.seq_lens, s.prefix)):
            rows = slice(b * n, (b + 1) * n)
            keys = torch.cat([k_cache[loc], stored_k[rows]]) * layer.k_scale_float
            values = torch.cat([v_cache[loc], stored_v[rows]]) * layer.v_scale_float
            want = dense_attention(q[rows].view(n, -1, DIM), keys, values, with_prefix(s.rows.mask[b], p), SCALE, CAP)
            torch.testing.assert_close(got[rows].view(n, -1, DIM), want, atol=1e-5, rtol=1e-5)
    assert len(s.wrapper.plans) == 1  # both layers ran on the one plan
    assert s.wrapper.runs == [(8, 0.5, 2.0), (4, 0.25, 1.5)]


def test_save_kv_cache_false_writes_nothing(verify_setup):
    s = verify_setup
    layer = s.model[0]
    before = s.pool.get_kv_buffer(0)[0].clone()
    s.verify.plan(s.batch)
    q = torch.randn(6, 8 * DIM, generator=s.gen)
    s.verify.forward(q, torch.ones(6, KV_HEADS, DIM), torch.ones(6, KV_HEADS, DIM), layer, s.batch,
                     save_kv_cache=False)
    assert torch.equal(s.pool.get_kv_buffer(0)[0].view(torch.uint8), before.view(torch.uint8))


def test_eager_verify_runs_the_tree_and_graphs_run_flashinfers_own_plan(monkeypatch):
    from sglang.srt.layers.attention.flashinfer_backend import FlashInferAttnBackend
    from sglang.srt.model_executor.forward_batch_info import ForwardMode

    from attention_backends.flashinfer_backend import FlashInferTreeAttnBackend

    calls = []
    monkeypatch.setattr(FlashInferAttnBackend, "init_forward_metadata", lambda self, fb: calls.append("init"))
    monkeypatch.setattr(FlashInferAttnBackend, "init_forward_metadata_out_graph",
                        lambda self, fb, in_capture=False: calls.append("graph"))
    monkeypatch.setattr(FlashInferAttnBackend, "forward_extend", lambda self, *args: "flashinfer")
    backend = FlashInferTreeAttnBackend.__new__(FlashInferTreeAttnBackend)  # FlashInfer itself needs a GPU
    backend.tree = SimpleNamespace(plan=lambda fb: calls.append("plan"), forward=lambda *args: "tree")
    backend.verifying = False
    verify, extend = (SimpleNamespace(forward_mode=mode) for mode in (ForwardMode.TARGET_VERIFY, ForwardMode.EXTEND))

    backend.init_forward_metadata(verify)
    assert calls == ["plan"] and backend.forward_metadata is None
    assert backend.forward_extend(None, None, None, None, verify) == "tree"
    backend.init_forward_metadata_out_graph(verify, in_capture=True)
    assert calls == ["plan", "graph"]
    assert backend.forward_extend(None, None, None, None, verify) == "flashinfer"
    backend.init_forward_metadata(extend)
    assert calls == ["plan", "graph", "init"]
    assert backend.forward_extend(None, None, None, None, extend) == "flashinfer"


def test_refusal_is_a_one_line_startup_error(monkeypatch):
    from attention_backends import flashinfer_backend
    from scheduler_patch.backends import create_flashinfer_backend
    from scheduler_patch.errors import StartupError

    def refuse(self, runner):
        raise VerifyRefusal("dspark_flashinfer: sliding-window layers (window 4096) are not supported")

    monkeypatch.setattr(flashinfer_backend.FlashInferTreeAttnBackend, "__init__", refuse)
    with pytest.raises(StartupError, match="^dspark_flashinfer: sliding-window"):
        create_flashinfer_backend(SimpleNamespace())
