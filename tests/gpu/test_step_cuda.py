"""The decode step on CUDA (tests/step_harness.py: a table target whose verify logits live on the GPU, the real
drafter): output identical to plain decoding, sampled requests drawing as on the CPU, and a greedy batch's
acceptance runs without a host sync (CUDA's sync debug mode set to error around it); the verdict then crosses to the
host once."""

import dataclasses

import pytest
import torch
from step_harness import GREEDY, KINDS, decode, drafter, plain_outputs

from sgl_dspark.sampling import SamplingParams
from sgl_dspark.step import accept_on_device

pytestmark = pytest.mark.gpu
ALL_GREEDY = ((GREEDY, None),) * 3
SAMPLED = ((GREEDY, None), (SamplingParams(temperature=0.8), None), (SamplingParams(temperature=1.0, top_k=5), None))


@pytest.mark.parametrize("preset, knobs", [("chain", {"lookup": True}), ("tree", {"lookup": True})])
def test_the_step_on_cuda_decodes_what_plain_decoding_does(preset, knobs):
    run = decode(knobs, preset, device="cuda")
    assert run.outputs == plain_outputs(KINDS) and run.accepted_drafts > 0


def test_greedy_acceptance_on_cuda_never_syncs_with_the_host():
    checked = []

    def no_sync(step, reqs, logits, sampler):
        rows = dataclasses.replace(step.rows, **{f.name: getattr(step.rows, f.name).cuda()
                                                 for f in dataclasses.fields(step.rows) if f.name != "width"})
        on_device = dataclasses.replace(step, rows=rows)
        torch.cuda.synchronize()
        torch.cuda.set_sync_debug_mode("error")
        try:
            out = accept_on_device(on_device, reqs, logits, sampler, torch.Generator(), stride=step.rows.width)
        finally:
            torch.cuda.set_sync_debug_mode("default")
        checked.append(out.accept_lens.device.type)

    run = decode({"lookup": True}, "tree", device="cuda", kinds=ALL_GREEDY, on_step=no_sync)
    assert run.outputs == plain_outputs(ALL_GREEDY) and checked and set(checked) == {"cuda"}


def test_sampled_requests_on_cuda_draw_what_they_draw_on_the_cpu():
    """Sampled chains (batched speculative sampling) and trees (the per-request verifier) with the verify logits on
    CUDA take the same coins from the same stream as on the CPU, so the outputs match (a float32 softmax differing in
    the last bit could flip a coin at ~1e-7 per draw)."""
    cpu = decode({"lookup": True}, "chain", kinds=SAMPLED)
    gpu = decode({"lookup": True}, "chain", device="cuda", kinds=SAMPLED)
    assert gpu.outputs == cpu.outputs and gpu.accepted_drafts > 0


@pytest.mark.parametrize("preset", ["chain", "tree"])
def test_the_drafter_on_cuda_decodes_what_plain_decoding_does(preset):
    """The drafter on the target's device, borrowing the target's tables there (as the server's in-process drafter
    runs on a GPU): greedy and seeded requests give plain decoding's output."""
    run = decode({"lookup": True}, preset, device="cuda", drafter_on=drafter("cuda"))
    assert run.outputs == plain_outputs(KINDS) and run.accepted_drafts > 0


def test_sampled_draft_rows_stay_on_cuda():
    """With the drafter on CUDA a sampled request's draft-probability rows are made there and its chain is accepted
    there (no host copy of [width, V] rows); the drafts themselves come from the drafter's CUDA stream."""
    devices = []

    def where(step, reqs, logits, sampler):
        devices.extend(g.tree.draft_probs.device.type for g, r in zip(step.trees, reqs) if not r.sampling.is_greedy)

    run = decode({"lookup": True}, "chain", device="cuda", kinds=SAMPLED, on_step=where, drafter_on=drafter("cuda"))
    assert set(devices) == {"cuda"} and run.accepted_drafts > 0
