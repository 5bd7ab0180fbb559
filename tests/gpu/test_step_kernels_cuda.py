"""The step's Triton kernels (sgl_dspark.step_kernels) compiled on CUDA: each equals its torch twin on the literal
example and on random packed steps (tests/kernel_cases.py) with the caching allocator's memory poisoned first (an
element a kernel leaves unwritten shows), the accept stage and the whole step (the real drafter, a table target on the
GPU) give torch's verdicts and plain decoding's output with them, greedy acceptance through them makes no host sync,
and `choose_ops` times both on the device and serves what it picked."""

import dataclasses

import pytest
import torch
from kernel_cases import check_accept_stage, check_decode, check_literal, check_random
from step_harness import GREEDY, decode, plain_outputs

from sgl_dspark.step import accept_on_device
from sgl_dspark.step_ops import OPS, choose_ops, triton_ops

pytestmark = pytest.mark.gpu
CUDA = torch.device("cuda")


def poison_cached_memory() -> None:
    """Fill a block of the caching allocator with -1 bytes and give it back: the next allocations reuse it."""
    block = torch.full((64 << 20,), -1, dtype=torch.int8, device=CUDA)
    del block


def test_the_kernels_equal_their_torch_twins_on_cuda():
    ops = triton_ops()
    poison_cached_memory()
    check_literal(ops, CUDA)
    poison_cached_memory()
    check_random(ops, CUDA, 200)
    check_accept_stage(ops, CUDA, 24)


def test_the_step_with_the_kernels_decodes_what_plain_decoding_does():
    check_decode(triton_ops(), "cuda")


def test_greedy_acceptance_through_the_kernels_never_syncs_with_the_host():
    ops, checked = triton_ops(), []
    kinds = ((GREEDY, None),) * 3

    def no_sync(step, reqs, logits, sampler):
        rows = dataclasses.replace(step.rows, **{f.name: getattr(step.rows, f.name).cuda()
                                                 for f in dataclasses.fields(step.rows) if f.name != "width"})
        torch.cuda.synchronize()
        torch.cuda.set_sync_debug_mode("error")
        try:
            out = accept_on_device(dataclasses.replace(step, rows=rows), reqs, logits, sampler, torch.Generator(),
                                   step.rows.width, ops)
        finally:
            torch.cuda.set_sync_debug_mode("default")
        checked.append(out.accept_lens.device.type)

    run = decode({"lookup": True}, "tree", device="cuda", kinds=kinds, on_step=no_sync, ops=ops)
    assert run.outputs == plain_outputs(kinds) and checked and set(checked) == {"cuda"}


def test_the_ops_are_chosen_by_timing_on_the_device():
    ops, timings = choose_ops(CUDA, 24)  # the kernels built for every width up to 24
    assert [t.op for t in timings] == list(OPS) and ops.names == tuple(t.chosen for t in timings)
    check_random(ops, CUDA, 20)
