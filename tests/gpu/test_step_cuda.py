"""The decode step on CUDA (tests/step_harness.py: a table target whose verify logits live on the GPU, the real
drafter): output identical to plain decoding, sampled requests drawing as on the CPU, and a greedy batch's
acceptance runs without a host sync (CUDA's sync debug mode set to error around it); the verdict then crosses to the
host once."""

import dataclasses

import pytest
import torch
from law_stats import chi_square_pvalue
from step_harness import GREEDY, KINDS, PROMPTS, decode, drafter, plain_outputs
from torch_target import LlamaTarget, law_of_two

from sgl_dspark.sampling import SamplerBatch, SamplingParams, target_probs
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


@pytest.mark.parametrize("preset", ["chain", "tree"])
def test_the_step_on_cuda_decodes_a_llama_shaped_targets_plain_output(preset):
    """A Llama-shaped torch target on CUDA (head_dim 64, 9:3 grouped-query attention, a KV cache per request, the
    tree mask with prefix columns as the GPU backend reads it) and the drafter on CUDA: greedy and seeded requests
    give the target's own plain decoding."""
    target = LlamaTarget(device="cuda")
    run = decode({"lookup": True}, preset, target=target, drafter_on=target.drafter("cuda"))
    assert run.outputs == plain_outputs(KINDS, LlamaTarget(device="cuda")) and run.accepted_drafts > 0


def test_sampled_output_on_cuda_follows_the_llama_shaped_targets_law():
    """64 sampled requests of one prompt a run, 24 runs (verifier streams seeded apart), every drafted token verified
    (budget off): the first two tokens' joint distribution against the target's exact law, chi-square; the same
    draws must fail against the law of another target (the check can see a wrong law)."""
    params = SamplingParams(temperature=1.0)
    sampler = SamplerBatch.of([params])
    target = LlamaTarget(device="cuda")
    drafter_on, prompt = target.drafter("cuda"), PROMPTS[0]
    pairs, accepted = [], 0
    for seed in range(24):
        run = decode({"lookup": True, "budget": "off"}, "chain", kinds=((params, None),) * 64,
                     target=LlamaTarget(device="cuda"), drafter_on=drafter_on, prompts=(prompt,) * 64, tokens=2,
                     seed=seed)
        pairs += [o[0] * target.vocab + o[1] for o in run.outputs]
        accepted += run.accepted_drafts
    samples = torch.tensor(pairs)
    law = law_of_two(target, prompt, lambda logits: target_probs(logits, params, sampler))
    other = law_of_two(LlamaTarget(device="cuda", seed=1), prompt, lambda logits: target_probs(logits, params, sampler))
    assert accepted > 0 and chi_square_pvalue(samples, law.flatten()) > 1e-3
    assert chi_square_pvalue(samples, other.flatten()) < 1e-6
