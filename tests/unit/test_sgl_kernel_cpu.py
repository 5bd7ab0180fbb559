"""Tests for the pure-torch ``sgl_kernel`` CPU stand-in (sgl_kernel_cpu/).

Two layers:
* hand-built cases with the expected outputs written out, in this process;
* SGLang's own references on random inputs, in one subprocess (see
  ``_REFERENCE_SCRIPT``): SGLang's Triton kernels for the same ops run under
  the Triton interpreter, its torch/host references (``move_kv_cache_native``,
  ``ngram_worker._derive_tree_links``), and SGLang's CPU call sites
  (``*_func`` wrappers), which with SGLANG_USE_CPU_ENGINE=1 call this package,
  so the call signatures are checked too. A subprocess because
  TRITON_INTERPRET must be set before triton is first imported, and so the
  CPU-engine switch does not leak into other tests.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

_PKG_ROOT = Path(__file__).resolve().parents[2] / "sgl_kernel_cpu"

try:
    import sgl_kernel
except ImportError:  # not pip-installed: use the in-tree copy
    sys.path.insert(0, str(_PKG_ROOT))
    import sgl_kernel

if not Path(sgl_kernel.__file__).resolve().is_relative_to(_PKG_ROOT):
    pytest.skip(
        f"a compiled sgl_kernel is installed ({sgl_kernel.__file__}); the CPU "
        "stand-in must not be installed next to it",
        allow_module_level=True,
    )

from sgl_kernel.speculative import reconstruct_indices_from_tree_mask  # noqa: E402

I32, I64 = torch.int32, torch.int64
T, F = True, False


def t(values, dtype=I64):
    return torch.tensor(values, dtype=dtype)


# --------------------------------------------------------------------------
# Module surface
# --------------------------------------------------------------------------

SGLANG_CPU_IMPORTS = [
    "copy_all_layer_kv_cache_cpu",
    "assign_req_to_token_pool_cpu",
    "assign_draft_cache_locs_contiguous_cpu",
    "assign_extend_cache_locs_cpu",
    "build_tree_kernel_efficient_cpu",
    "fill_accept_out_cache_loc_cpu",
    "fill_bonus_tokens_cpu",
    "verify_tree_greedy_cpu",
    "rotate_input_ids_cpu",
]


@pytest.mark.parametrize("name", SGLANG_CPU_IMPORTS)
def test_sglang_cpu_imports_are_real_functions(name):
    fn = getattr(sgl_kernel, name)
    assert fn.__module__ in ("sgl_kernel.kvcache", "sgl_kernel.cache_locs", "sgl_kernel.speculative")
    assert fn.__doc__ and name in sgl_kernel.__dict__  # defined, not served by __getattr__


def test_speculative_submodule_and_version():
    assert sgl_kernel.__version__ == "0.0.1"
    assert sgl_kernel.speculative.reconstruct_indices_from_tree_mask is (
        sgl_kernel.reconstruct_indices_from_tree_mask
    )
    assert set(sgl_kernel.__all__) >= set(SGLANG_CPU_IMPORTS)


def test_unimplemented_name_is_a_loud_stub():
    from sgl_kernel import silu_and_mul  # imported unguarded on some non-CUDA paths

    with pytest.raises(NotImplementedError, match=r"sgl_kernel\.silu_and_mul is not implemented"):
        silu_and_mul(torch.zeros(2, 4))
    with pytest.raises(NotImplementedError, match="segment_packbits"):
        sgl_kernel.speculative.segment_packbits()


@pytest.mark.parametrize("name", ["rmsnorm", "tree_speculative_sampling_target_only"])
def test_probed_names_raise_import_error(name):
    # inkling_common/norm.py: try: from sgl_kernel import rmsnorm / except ImportError
    with pytest.raises(ImportError):
        exec(f"from sgl_kernel import {name}", {})
    with pytest.raises(AttributeError, match=f"{name} is not implemented"):
        getattr(sgl_kernel, name)
    assert not hasattr(sgl_kernel, "__wrapped__")


def test_missing_submodules_fail_as_imports():
    for stmt in ("from sgl_kernel import kvcacheio", "import sgl_kernel.mamba",
                 "from sgl_kernel.scalar_type import ScalarType"):
        with pytest.raises(ImportError):
            exec(stmt, {})


def test_no_torch_ops_registered():
    # SGLang's cpu_has_amx_support() probes this; it must stay False.
    assert not hasattr(torch.ops.sgl_kernel, "convert_weight_packed")


# --------------------------------------------------------------------------
# KV cache / req_to_token
# --------------------------------------------------------------------------


def test_copy_all_layer_kv_cache_overlapping_rows():
    a = torch.arange(12, dtype=I32).view(4, 3)
    b = (torch.arange(8, dtype=torch.int16) + 100).view(4, 2)
    ptrs = t([a.data_ptr(), b.data_ptr()], torch.uint64)
    strides = t([a.stride(0) * 4, b.stride(0) * 2])
    # row 0 <- row 3 and row 3 <- row 1: every read sees the old rows.
    sgl_kernel.copy_all_layer_kv_cache_cpu(ptrs, strides, t([0, 3]), t([3, 1]))
    assert a.tolist() == [[9, 10, 11], [3, 4, 5], [6, 7, 8], [3, 4, 5]]
    assert b.tolist() == [[106, 107], [102, 103], [104, 105], [102, 103]]
    sgl_kernel.copy_all_layer_kv_cache_cpu(ptrs, strides, t([]), t([]))
    with pytest.raises(ValueError):
        sgl_kernel.copy_all_layer_kv_cache_cpu(ptrs, strides, t([0]), t([1, 2]))


@pytest.mark.parametrize("offset_dtype", [I32, I64])
def test_assign_req_to_token_pool(offset_dtype):
    table = torch.zeros(3, 6, dtype=I32)
    sgl_kernel.assign_req_to_token_pool_cpu(
        t([2, 0]), table, t([1, 4], offset_dtype), t([4, 6], offset_dtype),
        t([10, 11, 12, 20, 21]), 6,
    )
    assert table.tolist() == [
        [0, 0, 0, 0, 20, 21],
        [0, 0, 0, 0, 0, 0],
        [0, 10, 11, 12, 0, 0],
    ]


# --------------------------------------------------------------------------
# Speculative cache-slot bookkeeping
# --------------------------------------------------------------------------

TABLE = (torch.arange(16, dtype=I32) + 100).view(2, 8)


def test_assign_draft_cache_locs_contiguous():
    out = torch.full((7,), -1, dtype=I64)
    sgl_kernel.assign_draft_cache_locs_contiguous_cpu(t([1, 0]), TABLE, t([2, 5]), out, 8, 1, 3)
    assert out.tolist() == [110, 111, 112, 105, 106, 107, -1]
    out = torch.full((4,), -1, dtype=I64)  # topk=2, num_steps=1
    sgl_kernel.assign_draft_cache_locs_contiguous_cpu(t([0, 1]), TABLE, t([0, 6]), out, 8, 2, 1)
    assert out.tolist() == [100, 101, 114, 115]


def test_assign_extend_cache_locs():
    out = torch.full((5,), -1, dtype=I64)
    sgl_kernel.assign_extend_cache_locs_cpu(t([0, 1]), TABLE, t([1, 6]), t([3, 8]), out, 8)
    assert out.tolist() == [101, 102, 114, 115, -1]


def test_fill_accept_out_cache_loc():
    accept = t([[0, 2, -1], [3, -1, -1]], I32)
    loc = t([50, 51, 52, 53, 54, 55])
    out = torch.zeros(6, dtype=I64)
    sgl_kernel.fill_accept_out_cache_loc_cpu(accept, loc, out)  # SGLang 0.5.23 passes no size
    assert out.tolist() == [50, 52, 53, 0, 0, 0]
    out = torch.zeros(6, dtype=I64)
    sgl_kernel.fill_accept_out_cache_loc_cpu(accept, loc, out, 3)
    assert out.tolist() == [50, 52, 0, 0, 0, 0]


def test_fill_bonus_tokens():
    out = torch.zeros(2, dtype=I32)
    sgl_kernel.fill_bonus_tokens_cpu(t([[7, 8, 9], [4, 5, 6]], I32), t([2, 3], I32), out, 3)
    assert out.tolist() == [8, 6]


def test_rotate_input_ids():
    ids = t([1, 2, 3, 4, 5, 6])
    sgl_kernel.rotate_input_ids_cpu(ids, t([0, 3]), t([3, 2]), t([90, 91]))
    assert ids.tolist() == [2, 3, 90, 5, 91, 6]
    ids = t([1, 2, 3, 4, 5, 6])
    sgl_kernel.rotate_input_ids_cpu(ids, t([0, 3]), t([3, 2]), t([90, 91]), t([1, 4]))
    assert ids.tolist() == [2, 90, 3, 5, 91, 6]
    ids = t([1, 2, 3])
    sgl_kernel.rotate_input_ids_cpu(ids, t([0, 1]), t([0, 2]), t([90, 91]))
    assert ids.tolist() == [1, 3, 91]


# --------------------------------------------------------------------------
# Draft trees. Two requests, topk=2, spec_steps=2, n=4 draft tokens:
#   request 0 picks candidates [0, 1, 3]: root -> 1, 2 and 1 -> 3
#   request 1 picks candidates [1, 4, 5]: root -> 1 and 1 -> 2, 3
# --------------------------------------------------------------------------

PARENTS = t([[-1, 0, 1], [-1, 0, 1]])
SELECTED = t([[0, 1, 3], [1, 4, 5]])
SEQ_LENS = t([2, 1])
ROWS = [  # tree_mask rows: token i attends to root + draft ancestors incl. itself
    [[T, F, F, F], [T, T, F, F], [T, F, T, F], [T, T, F, T]],
    [[T, F, F, F], [T, T, F, F], [T, T, T, F], [T, T, F, T]],
]
POSITIONS = [2, 3, 3, 4, 1, 2, 3, 3]
RETRIEVE = [
    [[0, 1, 2, 3], [4, 5, 6, 7]],  # retrive_index
    [[1, 3, -1, -1], [1, 2, -1, -1]],  # retrive_next_token
    [[-1, 2, -1, -1], [-1, -1, 3, -1]],  # retrive_next_sibling
]


def _build(mode, mask, parents=PARENTS, selected=SELECTED, seq=SEQ_LENS, topk=2, depth=2):
    bs, n = selected.shape[0], selected.shape[1] + 1
    positions = torch.empty(bs * n, dtype=I64)
    retrieve = torch.full((3, bs, n), -1, dtype=I64)
    sgl_kernel.build_tree_kernel_efficient_cpu(
        parents, selected, seq, mask, positions, *retrieve, topk, depth, n, mode
    )
    return positions.tolist(), retrieve.tolist()


def test_build_tree_qlen_only():
    mask = torch.ones(2 * 4 * 4, dtype=torch.bool)
    positions, retrieve = _build(1, mask)
    assert positions == POSITIONS and retrieve == RETRIEVE
    assert mask.view(2, 4, 4).tolist() == ROWS


def test_build_tree_full_mask():
    mask = torch.ones(3 * 4 + 2 * 4 * 4, dtype=torch.bool)  # sum(seq)*n + bs*n*n
    positions, retrieve = _build(0, mask)
    assert positions == POSITIONS and retrieve == RETRIEVE
    req0 = mask[:24].view(4, 6).tolist()  # rows of seq_len 2 + n columns
    req1 = mask[24:].view(4, 5).tolist()
    assert req0 == [[T, T] + row for row in ROWS[0]]
    assert req1 == [[T] + row for row in ROWS[1]]


def test_build_tree_bitpacked():
    mask = torch.full((8,), 0xF0, dtype=torch.uint8)  # byte 0 is assigned, not OR-ed
    positions, retrieve = _build(2, mask)
    assert positions == POSITIONS and retrieve == RETRIEVE
    assert mask.tolist() == [0b0001, 0b0011, 0b0101, 0b1011, 0b0001, 0b0011, 0b0111, 0b1011]


def test_build_tree_chain_two_byte_rows():
    # topk=1, 11 steps: a 12-token chain; rows need 2 bytes (uint16 mask).
    parents = t([[-1] + list(range(10))])
    selected = t([list(range(11))])
    mask = torch.zeros(12, dtype=torch.uint16)
    positions, retrieve = _build(2, mask, parents, selected, t([7]), topk=1, depth=11)
    assert positions == [7 + i for i in range(12)]
    assert retrieve == [[list(range(12))], [list(range(1, 12)) + [-1]], [[-1] * 12]]
    assert mask.to(I64).tolist() == [(1 << (i + 1)) - 1 for i in range(12)]


def test_build_tree_single_step_has_empty_parent_list():
    # spec_steps=1: organize_draft_results passes a [bs, 0] parent_list.
    mask = torch.ones(9, dtype=torch.bool)
    positions, retrieve = _build(1, mask, t([[]]), t([[0, 1]]), t([4]), topk=2, depth=1)
    assert positions == [4, 5, 5]
    assert retrieve == [[[0, 1, 2]], [[1, -1, -1]], [[-1, 2, -1]]]
    assert mask.view(3, 3).tolist() == [[T, F, F], [T, T, F], [T, F, T]]


def test_verify_tree_greedy():
    predicts = torch.zeros(8, dtype=I32)
    accept = torch.full((2, 3), -1, dtype=I32)
    num = torch.empty(2, dtype=I32)
    retrieve = t(RETRIEVE)
    sgl_kernel.verify_tree_greedy_cpu(
        predicts, accept, num,
        candidates=t([[10, 11, 12, 13], [10, 11, 12, 13]]),
        retrive_index=retrieve[0], retrive_next_token=retrieve[1],
        retrive_next_sibling=retrieve[2],
        target_predict=t([[12, 0, 99, 0], [11, 12, 55, 77]]),
    )
    # request 0: root's target 12 matches sibling node 2, whose target 99 ends it;
    # request 1: 11 matches node 1, 12 matches node 2 (node 1's first child).
    assert accept.tolist() == [[0, 2, -1], [4, 5, 6]]
    assert num.tolist() == [1, 2]
    assert predicts.tolist() == [12, 0, 99, 0, 11, 12, 55, 0]


def test_reconstruct_indices_from_tree_mask():
    mask = torch.tensor(ROWS, dtype=torch.bool).view(-1)
    positions = torch.empty(8, dtype=I64)
    retrieve = torch.empty((3, 2, 4), dtype=I64)
    reconstruct_indices_from_tree_mask(mask, t([2, 1]), positions, *retrieve, 2, 4)
    assert positions.tolist() == POSITIONS
    assert retrieve.tolist() == RETRIEVE
    reconstruct_indices_from_tree_mask(mask, t([]), positions, *retrieve, 0, 4)  # no-op


# --------------------------------------------------------------------------
# SGLang's own references, random inputs (one subprocess for all of them)
# --------------------------------------------------------------------------

_REFERENCE_SCRIPT = r'''
import json, traceback
import torch
import sgl_kernel
from sglang.kernels.ops.kvcache import cache_move
from sglang.kernels.ops.speculative import (
    cache_locs, eagle, multi_layer_eagle, reconstruct_tree, spec_tree,
)
from sglang.srt.mem_cache import allocation
from sglang.srt.mem_cache.memory_pool import move_kv_cache_native
from sglang.srt.speculative.eagle_utils import organize_draft_results
from sglang.srt.speculative.ngram_worker import _derive_tree_links
from sglang.srt.utils import is_cpu

g = torch.Generator().manual_seed(1234)
results = {"is_cpu": is_cpu()}


def randint(lo, hi, shape, dtype=torch.int64):
    return torch.randint(lo, hi, shape, generator=g, dtype=torch.int64).to(dtype)


def pow2(x):
    return 1 << (x - 1).bit_length()


def check(name):
    def deco(fn):
        try:
            for trial in range(3):
                fn(trial)
            results[name] = "ok"
        except Exception:
            results[name] = traceback.format_exc(limit=4)
    return deco


def same(a, b, what):
    assert a.dtype == b.dtype and torch.equal(a, b), f"{what}:\n{a}\n!=\n{b}"


def ragged_case(bs, rows, pool_len):
    start = randint(0, pool_len // 2, (bs,))
    end = start + randint(0, pool_len // 2, (bs,))
    return torch.randperm(rows, generator=g)[:bs], start, end


@check("assign_req_to_token_pool_cpu")
def _(trial):
    bs, rows, pool_len = 4 + trial, 9, 24
    rpi, start, end = ragged_case(bs, rows, pool_len)
    loc = randint(0, 10**6, (int((end - start).sum()),))
    ref = randint(0, 99, (rows, pool_len), torch.int32)
    got = ref.clone()
    allocation.assign_req_to_token_pool[(bs,)](rpi, ref, start, end, loc, pool_len, pow2(bs))
    allocation.assign_req_to_token_pool_func(rpi, got, start, end, loc, bs)
    same(got, ref, "req_to_token")


@check("assign_draft_cache_locs_contiguous_cpu")
def _(trial):
    bs, rows, pool_len, topk, steps = 3 + trial, 7, 40, 1 + trial, 3
    rpi = torch.randperm(rows, generator=g)[:bs]
    seq = randint(0, pool_len - topk * steps, (bs,))
    table = randint(0, 10**6, (rows, pool_len), torch.int32)
    ref = torch.full((bs * topk * steps,), -7, dtype=torch.int64)
    got = ref.clone()
    cache_locs.assign_draft_cache_locs_contiguous[(bs,)](
        rpi, table, seq, ref, pool_len, topk, steps)
    cache_locs.assign_draft_cache_locs_contiguous_func(rpi, table, seq, got, topk, steps)
    same(got, ref, "out_cache_loc")


@check("assign_extend_cache_locs_cpu")
def _(trial):
    bs, rows, pool_len, n = 3 + trial, 8, 30, 3 + trial
    rpi, start, end = ragged_case(bs, rows, pool_len)
    table = randint(0, 10**6, (rows, pool_len), torch.int32)
    ref = torch.full((int((end - start).sum()),), -7, dtype=torch.int64)
    got = ref.clone()
    cache_locs.assign_extend_cache_locs[(bs,)](rpi, table, start, end, ref, pool_len, pow2(bs))
    sgl_kernel.assign_extend_cache_locs_cpu(rpi, table, start, end, got, pool_len)
    same(got, ref, "ragged out_cache_loc")
    # uniform-width call site (NGRAM / EAGLE verify): end = start + n
    ref = torch.empty(bs * n, dtype=torch.int64)
    cache_locs.assign_extend_cache_locs[(bs,)](
        rpi, table, start, start + n, ref, pool_len, pow2(bs))
    got = cache_locs.assign_extend_cache_locs_func(rpi, table, start, start + n, bs, n, "cpu")
    same(got, ref, "uniform out_cache_loc")
    # fill_front_out_cache_loc_func: int32 counts, window.int() as the table
    window = randint(0, 10**6, (bs, 6))
    num_front = randint(1, 7, (bs,), torch.int32)
    ref = torch.zeros(bs * 6, dtype=torch.int64)
    got = ref.clone()
    cache_locs.assign_extend_cache_locs[(bs,)](
        torch.arange(bs), window.int(), torch.zeros_like(num_front), num_front, ref, 6, pow2(bs))
    cache_locs.fill_front_out_cache_loc_func(num_front, window.view(-1), got)
    same(got, ref, "front_out_cache_loc")


@check("fill_bonus_tokens_cpu")
def _(trial):
    bs, stride = 4 + trial, 3 + trial
    tokens = randint(0, 32000, (bs, stride), torch.int32)
    lens = randint(1, stride + 1, (bs,), torch.int32)
    ref = torch.zeros(bs, dtype=torch.int32)
    got = ref.clone()
    eagle.fill_bonus_tokens[(bs,)](tokens, lens, ref, stride)
    eagle.fill_bonus_tokens_func(tokens, lens, got, stride, bs)
    same(got, ref, "bonus_tokens")


@check("fill_accept_out_cache_loc_cpu")
def _(trial):
    bs, steps, n = 3 + trial, 4, 6
    accept = torch.full((bs, steps), -1, dtype=torch.int32)
    for b in range(bs):
        k = int(randint(1, steps + 1, (1,)))
        accept[b, :k] = b * n + torch.randperm(n, generator=g)[:k].to(torch.int32)
    loc = randint(0, 10**6, (bs * n,))
    size = accept.numel()
    ref = torch.zeros(size, dtype=torch.int64)
    got = ref.clone()
    eagle.fill_accept_out_cache_loc[(size,)](accept, loc, ref, pow2(size))
    eagle.fill_accept_out_cache_loc_func(accept, loc, got, size)
    same(got, ref, "accept_out_cache_loc")


@check("rotate_input_ids_cpu")
def _(trial):
    bs = 3 + trial
    lens = randint(0, 6, (bs,))
    starts = torch.cumsum(lens, 0) - lens
    ids = randint(0, 32000, (int(lens.sum()) + 2,))
    new = randint(0, 32000, (bs,))
    select = starts + (lens - 2).clamp_min(0) if trial == 2 else None
    ref = ids.clone()
    multi_layer_eagle.rotate_input_ids_kernel[(bs,)](ref, starts, lens, new, select, BLOCK_SIZE=4)
    got = multi_layer_eagle.rotate_input_ids(ids.clone(), starts, lens, new, select)
    same(got, ref, "input_ids")


def draft_tree(bs, topk, steps, num_draft):
    # the draft loop's bookkeeping (spec_utils.select_top_k_tokens), then SGLang's organizer
    scores = torch.rand((bs, topk), generator=g)
    score_list, token_list = [scores.unsqueeze(1)], [randint(0, 32000, (bs, topk))]
    parents_list = [torch.arange(-1, topk).expand(bs, -1)]
    for i in range(1, steps):
        expand = scores.unsqueeze(2) * torch.rand((bs, topk, topk), generator=g)
        scores, cs_index = torch.topk(expand.flatten(1), topk, dim=-1)
        score_list.append(expand)
        token_list.append(randint(0, 32000, (bs, topk * topk)))
        parents_list.append(cs_index + (topk * topk * (i - 1) + topk))
    return organize_draft_results(score_list, token_list, parents_list, num_draft)


def tree_case(trial, bs, mode):
    topk, steps = [1, 2, 4][trial], [3, 3, 4][trial]
    n = min(topk * steps, 8) if topk > 1 else steps + 1
    seq = randint(1, 6, (bs,))
    parent_list, sel, draft_tokens = draft_tree(bs, topk, steps, n)
    size = int(seq.sum()) * n + n * n * bs if mode == 0 else bs * n * n
    bufs = (torch.ones(size, dtype=torch.bool), torch.empty(bs * n, dtype=torch.int64),
            torch.full((3, bs, n), -1, dtype=torch.int64))
    return topk, steps, n, seq, parent_list, sel, draft_tokens, bufs


@check("build_tree_kernel_efficient_cpu")
def _(trial):
    for mode in (0, 1):
        bs = 2 + trial
        topk, steps, n, seq, parent_list, sel, _, (mask, pos, ret) = tree_case(trial, bs, mode)
        r_mask, r_pos, r_ret = mask.clone(), pos.clone(), ret.clone()
        mode_ = spec_tree.TreeMaskMode(mode)
        spec_tree.sgl_build_tree_kernel_triton(
            parent_list, sel, seq, r_mask, r_pos, *r_ret, topk, steps, n, mode_)
        spec_tree.build_tree_kernel_efficient_func(
            parent_list, sel, seq, mask, pos, *ret, topk, steps, n, mode_)
        same(mask, r_mask, f"tree_mask mode={mode}")
        same(pos, r_pos, f"positions mode={mode}")
        same(ret, r_ret, f"retrive_* mode={mode}")
        if mode == 1:  # links == the tree NGRAM's host helper derives from the same mask
            nt, ns = _derive_tree_links(mask.view(bs, n, n).numpy(), bs, n)
            same(ret[1], nt, "next_token vs _derive_tree_links")
            same(ret[2], ns, "next_sibling vs _derive_tree_links")


@check("verify_tree_greedy_cpu")
def _(trial):
    bs = 3
    topk, steps, n, seq, parent_list, sel, draft_tokens, (mask, pos, ret) = tree_case(trial, bs, 1)
    spec_tree.build_tree_kernel_efficient_func(
        parent_list, sel, seq, mask, pos, *ret, topk, steps, n, spec_tree.TreeMaskMode.QLEN_ONLY)
    candidates = torch.cat([randint(0, 8, (bs, 1)), draft_tokens % 8], dim=1)
    target = randint(0, 8, (bs, n))
    for b in range(bs):  # agree with the drafts along random paths
        for i in range(n):
            child = int(ret[1][b, i])
            if child != -1 and float(torch.rand((), generator=g)) < 0.7:
                target[b, i] = candidates[b, child]
    outs = []
    for impl in ("triton", "cpu"):
        predicts = torch.zeros(bs * n, dtype=torch.int32)
        accept = torch.full((bs, steps + 1), -1, dtype=torch.int32)
        num = torch.empty(bs, dtype=torch.int32)
        if impl == "triton":
            spec_tree.verify_tree_greedy_triton(predicts, accept, num, candidates, *ret, target)
        else:
            spec_tree.verify_tree_greedy_func(
                predicts=predicts, accept_index=accept, accept_token_num=num,
                candidates=candidates, retrieve_index=ret[0], retrieve_next_token=ret[1],
                retrieve_next_sibling=ret[2], target_predict=target, topk=topk)
        outs.append((predicts, accept, num))
    for got, ref, what in zip(outs[1], outs[0], ("predicts", "accept_index", "accept_token_num")):
        same(got, ref, what)


@check("reconstruct_indices_from_tree_mask")
def _(trial):
    bs, n = 2 + trial, [4, 7, 12][trial]
    mask = torch.zeros(bs, n, n, dtype=torch.bool)
    for b in range(bs):
        parent = [-1, 0] + [int(randint(0, i, (1,))) for i in range(2, n)]
        for i in range(n):
            j = i
            while j >= 0:
                mask[b, i, j] = True
                j = parent[j]
    seq = randint(0, 50, (bs,))
    outs = []
    for fn in (reconstruct_tree.reconstruct_indices_from_tree_mask_triton,
               reconstruct_tree.reconstruct_indices_from_tree_mask_func):
        pos = torch.empty(bs * n, dtype=torch.int64)
        ret = torch.empty((3, bs, n), dtype=torch.int64)
        fn(mask.view(-1), seq, pos, *ret, bs, n)
        outs.append((pos, ret))
    same(outs[1][0], outs[0][0], "positions")
    same(outs[1][1], outs[0][1], "retrive_*")
    nt, ns = _derive_tree_links(mask.numpy(), bs, n)
    same(outs[1][1][1], nt, "next_token vs _derive_tree_links")
    same(outs[1][1][2], ns, "next_sibling vs _derive_tree_links")


@check("copy_all_layer_kv_cache_cpu")
def _(trial):
    layers, slots = 3, 16
    dtype = [torch.bfloat16, torch.float32, torch.float8_e4m3fn][trial]
    k = [torch.randn(slots, 2, 4, generator=g).to(dtype) for _ in range(layers)]
    v = [torch.randn(slots, 2, 3, generator=g).to(dtype) for _ in range(layers)]
    perm = torch.randperm(slots, generator=g)
    tgt, src = perm[:5], torch.cat([perm[3:5], randint(0, slots, (3,))])  # overlapping
    rk, rv = [x.clone() for x in k], [x.clone() for x in v]
    move_kv_cache_native(rk, rv, tgt, src)
    bufs = k + v
    ptrs = torch.tensor([x.data_ptr() for x in bufs], dtype=torch.uint64)
    strides = torch.tensor([x.stride(0) * x.dtype.itemsize for x in bufs])
    cache_move.copy_all_layer_kv_cache_func(ptrs, strides, tgt, src, 5, 8, {})
    for got, ref in zip(bufs, rk + rv):
        same(got.view(torch.uint8), ref.view(torch.uint8), "kv buffer")


print("RESULTS " + json.dumps(results), flush=True)
'''

REFERENCE_CHECKS = [
    "assign_req_to_token_pool_cpu",
    "assign_draft_cache_locs_contiguous_cpu",
    "assign_extend_cache_locs_cpu",
    "fill_bonus_tokens_cpu",
    "fill_accept_out_cache_loc_cpu",
    "rotate_input_ids_cpu",
    "build_tree_kernel_efficient_cpu",
    "verify_tree_greedy_cpu",
    "reconstruct_indices_from_tree_mask",
    "copy_all_layer_kv_cache_cpu",
]


@pytest.fixture(scope="module")
def sglang_reference(tmp_path_factory):
    script = tmp_path_factory.mktemp("sgl_kernel_cpu") / "reference.py"
    script.write_text(_REFERENCE_SCRIPT)
    env = dict(os.environ)
    env.update(TRITON_INTERPRET="1", SGLANG_USE_CPU_ENGINE="1", CUDA_VISIBLE_DEVICES="")
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(_PKG_ROOT), env.get("PYTHONPATH")]))
    proc = subprocess.run(
        [sys.executable, str(script)], env=env, capture_output=True, text=True, timeout=300
    )
    lines = [ln for ln in proc.stdout.splitlines() if ln.startswith("RESULTS ")]
    assert proc.returncode == 0 and lines, f"reference run failed:\n{proc.stderr[-4000:]}"
    return json.loads(lines[-1][len("RESULTS "):])


def test_reference_ran_sglang_cpu_path(sglang_reference):
    # With is_cpu() true, SGLang's *_func wrappers above called this package.
    assert sglang_reference["is_cpu"] is True


@pytest.mark.parametrize("name", REFERENCE_CHECKS)
def test_matches_sglang_reference(sglang_reference, name):
    assert sglang_reference[name] == "ok", sglang_reference[name]
