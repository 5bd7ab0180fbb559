"""The decode step reads its verify forward's outputs back to the host once: the verdict (each request's accepted
rows, tokens and length), in one transfer; and never reads the requests' KV slot ids (device data in SGLang) back,
not even for the drafter's context (its buffers grow by length). Counted on the CPU with tests/host_reads.py (every
host read of a tensor derived from the forward's outputs or the slot rows), through the step harness
(tests/step_harness.py: the real drafter and step, a fake forward): greedy, sampled and seeded requests, chains and
trees with lookup chains. On a GPU, tests/gpu/test_step_cuda.py holds acceptance to the same with CUDA's sync debug
mode."""

import pytest
import step_harness
import torch
from host_reads import HostReads
from step_harness import GREEDY, KINDS, decode, plain_outputs

from sgl_dspark.drafter import Proposer
from sgl_dspark.layout import AcceptRows
from sgl_dspark.sampling import SamplingParams
from sgl_dspark.step import decode_step

SAMPLED = ((GREEDY, None), (SamplingParams(temperature=0.8), None), (SamplingParams(temperature=1.0, top_k=5), None))


@pytest.fixture
def counted(monkeypatch):
    """Per decode step: the host reads of device data (a Counter by call) and the verdict's transfers. On the
    device: each request's KV slot row (SGLang's req_to_token lives there) from the step's start, the forward's
    outputs from the forward on. The drafting model's own work is not counted here (its trees cross to the host:
    the drafter's transfer); what the drafter's context store does with the slots is."""
    counter, steps = HostReads(), []

    def to_host(rows: AcceptRows) -> AcceptRows:  # as on a GPU: the verdict crosses once, into new host tensors
        steps[-1]["transfers"] += 1
        with counter.paused():
            return AcceptRows(rows.accept_index.clone(), rows.tokens.clone(), rows.accept_lens.clone())

    def drafting(self, inp):
        with counter.paused():
            return propose(self, inp)

    def step(parts, reqs, forward, *args, **kwargs):
        def on_device(s):
            with counter.paused():
                verified = forward(s)
            counter.track(verified.logits, verified.hidden)
            return verified

        steps.append({"transfers": 0})
        counter.reset()
        counter.track(*(r.slots for r in reqs))
        counter.active = True
        try:
            return decode_step(parts, reqs, on_device, *args, **kwargs)
        finally:
            counter.active = False
            steps[-1]["reads"] = dict(counter.reads)
            counter.reads.clear()

    propose = Proposer.propose
    monkeypatch.setattr(step_harness, "decode_step", step)
    monkeypatch.setattr(AcceptRows, "to_host", to_host)
    monkeypatch.setattr(Proposer, "propose", drafting)
    with counter:
        yield steps


@pytest.mark.parametrize("preset", ["chain", "tree"])
@pytest.mark.parametrize("kinds", [KINDS, SAMPLED], ids=["greedy-seeded", "greedy-sampled"])
def test_a_step_reads_its_forwards_outputs_back_once(counted, preset, kinds):
    run = decode({"lookup": True}, preset, kinds=kinds)
    if kinds is KINDS:
        assert run.outputs == plain_outputs(kinds)
    assert run.accepted_drafts > 0 and len(counted) == run.steps
    assert [s["transfers"] for s in counted] == [1] * run.steps
    assert [s["reads"] for s in counted] == [{}] * run.steps


def test_the_counter_sees_host_reads_of_device_data_only():
    logits, host = torch.randn(4, 6), torch.arange(4)
    with HostReads() as counter:
        counter.track(logits)
        counter.active = True
        derived = logits.softmax(-1)[host] * 2  # derived from the device data: tracked
        derived.argmax(-1).tolist()
        if derived.gt(0).any():
            derived[derived > 0.5] = 0.0  # a boolean mask index
        int(host.sum())  # the host's own tensors: not counted
        host.tolist()
    assert counter.reads == {"tolist": 1, "__bool__": 1, "__setitem__": 1}
