"""The decode step (sgl_dspark.step) driven end to end with a fake forward and a real drafter (tests/step_harness.py):
greedy and seeded requests decode exactly what plain decoding of the same synthetic target gives, with chains, trees,
lookup chains and draft-side faults (the step then verifies the anchor alone and counts the fault)."""

import pytest
from step_harness import decode, plain_outputs


@pytest.mark.parametrize("preset, knobs", [("chain", {"lookup": False}), ("chain", {"lookup": True}),
                                           ("tree", {"lookup": True}),
                                           ("chain", {"scheduler": "lagged", "lookup": True, "min_verify": 1})],
                         ids=["chain", "chain-lookup", "tree-lookup", "lagged-lookup"])
def test_the_step_decodes_what_plain_decoding_does(preset, knobs):
    run = decode(knobs, preset)
    assert run.outputs == plain_outputs()
    assert run.accepted_drafts > 0 and not run.faults
    if knobs.get("lookup"):
        assert run.lookup_tokens > 0
    if preset == "tree":
        assert run.branching > 0


def test_draft_side_faults_degrade_to_plain_decoding_and_are_counted():
    run = decode({"lookup": True}, fail_every=2)
    assert run.outputs == plain_outputs()
    assert run.faults and set(run.faults) == {"dead"} and run.accepted_drafts > 0
