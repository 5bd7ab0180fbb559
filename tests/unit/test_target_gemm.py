"""The target's layers on oneDNN packed weights inside SGLang (scheduler_patch/target_gemm.py): SGLang's own
products up to GEMM rounding, only plain float linear layers and the LM head packed, everything else untouched, the
head's table read from its packed copy where asked (SGLang's lookups and the drafter's the same), and the patches
idempotent and undoable."""

import platform

import pytest
import torch
from sglang.srt.layers.logits_processor import LogitsProcessor
from sglang.srt.layers.quantization.unquant import UnquantizedEmbeddingMethod, UnquantizedLinearMethod
from torch import nn
from torch.nn import functional as F

from sgl_dspark.packed_gemm import onednn_available

from scheduler_patch import target_gemm
from scheduler_patch.patches import undo_all
from scheduler_patch.runtime.setup import precision_note, release_freed_memory, target_weights
from scheduler_patch.target_gemm import PACKED, ROWS, PackReport, pack_target

pytestmark = pytest.mark.skipif(not onednn_available(), reason="this torch build has no oneDNN")


class Layer(nn.Module):
    """What pack_target reads of an SGLang layer: its quant method and its weight [out, in]."""

    def __init__(self, method, out: int, seed: int, dtype=torch.float32, width: int = 48):
        super().__init__()
        self.quant_method = method
        weight = torch.randn(out, width, generator=torch.Generator().manual_seed(seed)).to(dtype)
        self.weight = nn.Parameter(weight, requires_grad=False)


@pytest.fixture
def model():
    layers = nn.ModuleDict({"linear": Layer(UnquantizedLinearMethod(), 96, 0),
                            "head": Layer(UnquantizedEmbeddingMethod(), 80, 1),
                            "embed": Layer(UnquantizedEmbeddingMethod(), 80, 2),
                            "f64": Layer(UnquantizedLinearMethod(), 96, 3, torch.float64)})
    yield layers
    undo_all(target_gemm.PATCHES)


def test_packed_layers_compute_sglangs_products(model):
    x = torch.randn(5, 48, generator=torch.Generator().manual_seed(9))
    want_linear, want_head = x @ model.linear.weight.T, x @ model.head.weight.T
    report = pack_target(model, model.head)
    assert report == PackReport(layers=2, freed_bytes=96 * 48 * 4, added_bytes=80 * 48 * 4)
    assert model.linear.weight.numel() == 0 and model.head.weight.shape == (80, 48)  # the head keeps its table
    torch.testing.assert_close(model.linear.quant_method.apply(model.linear, x), want_linear, rtol=1e-5, atol=1e-5)
    logits = LogitsProcessor._compute_lm_head(None, x, model.head)  # the packed head needs no processor state
    torch.testing.assert_close(logits, want_head, rtol=1e-5, atol=1e-5)


def test_the_heads_table_read_from_its_packed_copy_looks_up_sglangs_rows():
    """With rows_from_copy the tied head releases its table: SGLang's embedding lookup, its logits and the drafter's
    borrowed tables are what they were with the table (lookups bit for bit)."""
    model = nn.ModuleDict({"linear": Layer(UnquantizedLinearMethod(), 96, 0, width=64),
                           "head": Layer(UnquantizedEmbeddingMethod(), 1000, 1, width=64)})
    try:
        table, ids = model.head.weight.clone(), torch.randint(0, 1000, (7,), generator=torch.Generator().manual_seed(3))
        x = torch.randn(5, 64, generator=torch.Generator().manual_seed(9))
        report = pack_target(model, model.head, rows_from_copy=True)
        assert report == PackReport(layers=2, freed_bytes=96 * 64 * 4, added_bytes=0, shared_bytes=1000 * 64 * 4)
        assert model.head.weight.numel() == 0 and ROWS in vars(model.head)
        assert torch.equal(model.head.quant_method.embedding(model.head, ids), F.embedding(ids, table))
        torch.testing.assert_close(LogitsProcessor._compute_lm_head(None, x, model.head), x @ table.T,
                                   rtol=1e-5, atol=1e-5)
        target = nn.Module()  # the drafter borrows them through target_weights (the model's embed_tokens, lm_head)
        target.model, target.lm_head = nn.Module(), model.head
        target.model.embed_tokens = model.head
        weights = target_weights(target, 1000)
        assert weights.embed is weights.lm_head is vars(model.head)[ROWS]
        assert torch.equal(weights.embed[ids], table[ids])
    finally:
        undo_all(target_gemm.PATCHES)


def test_timed_packing_times_both_kernels_then_drops_the_originals(model, monkeypatch):
    """With row counts to time, both kernels are timed on the packed layers' weights (scaled to all of them when only
    the first TIMED_BYTES are timed), and the originals are dropped afterwards as without timing."""
    monkeypatch.setattr(target_gemm, "TIMED_BYTES", 1)  # the first layer alone is timed: scaled by all / its bytes
    report = pack_target(model, model.head, time_rows=(1, 4))
    assert report.layers == 2 and report.kernels is not None
    assert report.kernels.plain.tokens == (1, 4) == report.kernels.packed.tokens
    assert all(s > 0 for s in report.kernels.plain.seconds + report.kernels.packed.seconds)
    assert model.linear.weight.numel() == 0 and model.head.weight.shape == (80, 48)
    assert pack_target(nn.ModuleDict({"linear": Layer(UnquantizedLinearMethod(), 96, 0)}), None).kernels is None


def test_only_plain_float_linear_layers_and_the_head_are_packed(model):
    pack_target(model, model.head)
    assert PACKED not in vars(model.embed) and PACKED not in vars(model.f64)  # a lookup table; not fp32/bf16
    x = torch.randn(3, 48, dtype=torch.float64)
    assert torch.equal(model.f64.quant_method.apply(model.f64, x), F.linear(x, model.f64.weight))


def test_the_patches_apply_once_and_undo_to_sglangs_originals(model):
    def current():
        return [vars(UnquantizedLinearMethod)["apply"], vars(LogitsProcessor)["_compute_lm_head"],
                vars(UnquantizedEmbeddingMethod)["embedding"]]

    originals = current()
    pack_target(model, model.head)
    pack_target(nn.Module(), None)  # a second model: the patches are already in place
    assert all(p.applied for p in target_gemm.PATCHES) and len(target_gemm.PATCHES) == 3
    undo_all(target_gemm.PATCHES)
    assert current() == originals


@pytest.mark.skipif(platform.libc_ver()[0] != "glibc", reason="malloc_trim is glibc's")
def test_start_up_hands_the_heaps_free_pages_back():
    """What packing leaves behind (originals freed between tensors still held) stays in the C heap until the worker's
    start-up trim returns it."""
    release_freed_memory()
    held = [torch.ones(16 * 1024) for _ in range(4096)]  # 64 KB each, from the heap: 256 MB
    kept = held[::8]  # the rest freed: holes between the kept ones
    del held
    returned = release_freed_memory()
    assert len(kept) == 512 and returned > 100 * 2**20


def test_a_half_precision_target_is_named_at_start_up_with_what_it_means_for_greedy_output():
    """SGLang's --dtype auto serves a float32 checkpoint in float16; the start-up log says so (float32: nothing)."""
    assert precision_note(torch.float32) is None
    for dtype, name in ((torch.float16, "float16"), (torch.bfloat16, "bfloat16")):
        note = precision_note(dtype)
        assert f"runs in {name}" in note and "--dtype float32" in note

