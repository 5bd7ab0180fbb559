"""The decode step (sgl_dspark.step) driven end to end with a fake forward and a real drafter (tests/step_harness.py):
greedy and seeded requests decode exactly what plain decoding of the same synthetic target gives, with chains, trees,
lookup chains and draft-side faults (the step then verifies the anchor alone and counts the fault); and against a
small Llama-shaped torch target with a KV cache (tests/torch_target.py), whose verify reads the step's tree mask."""

import pickle

import pytest
import torch
from step_harness import GREEDY, KINDS, PROMPTS, SEEDED, TOKENS, decode, plain_outputs
from torch_target import LlamaTarget

from sgl_dspark.layout import AcceptRows
from sgl_dspark.step import DecodeStep, commit_record


@pytest.mark.parametrize("preset, knobs", [("chain", {"lookup": False}), ("chain", {"lookup": True}),
                                           ("tree", {"lookup": True}),
                                           ("chain", {"budget": "lagged", "lookup": True, "min_verify": 1})],
                         ids=["chain", "chain-lookup", "tree-lookup", "lagged-lookup"])
def test_the_step_decodes_what_plain_decoding_does(preset, knobs):
    run = decode(knobs, preset)
    assert run.outputs == plain_outputs()
    assert run.accepted_drafts > 0 and not run.faults
    # the drafter's context grows by the committed rows only: after the first draft (every prompt row), each step
    # copies out of the pool just what the step before it committed
    assert run.copied[0] == sum(len(p) - 1 for p in PROMPTS) and run.copied[1:] == run.committed[:-1]
    if knobs.get("lookup"):
        assert run.lookup_tokens > 0
    if preset == "tree":
        assert run.branching > 0


def test_the_suffix_caches_chains_from_an_earlier_request_are_verified_like_any_draft():
    """The cache holds what an earlier run of the same requests produced (prompt and output), so its chains are right
    from the first step; the output is still plain decoding's, and the chains are what got accepted."""
    plain = plain_outputs()
    earlier = [(*prompt, *output) for prompt, output in zip(PROMPTS, plain)]
    run = decode({"lookup": True, "suffix_cache_tokens": 1024}, "chain", earlier=earlier)
    assert run.outputs == plain and not run.faults
    assert run.suffix_tokens > TOKENS  # more than one accepted per request on average
    without = decode({"lookup": True}, "chain")
    assert without.suffix_tokens == 0 and run.steps < without.steps


def test_a_tp_rank_that_does_not_plan_decodes_the_planning_ranks_steps_into_the_same_tokens():
    """Tensor parallelism (scheduler_patch/runtime/tensor_parallel.py): rank 0 plans each step (gate -> pack) and the
    others receive its DecodeStep pickled; from the same logits and the verifier's stream seeded alike, a rank that
    never drafts (no drafter calls, no lookup state) accepts the same tokens, unseeded sampled requests included,
    and rank 0 decodes as one rank alone does."""
    kinds = ((GREEDY, None), (SEEDED, None), (SEEDED, 1234))  # greedy, the verifier's stream, a seeded request
    sent: list[bytes] = []

    def leader(make):
        step = make()
        sent.append(pickle.dumps(step))  # as broadcast_pyobj sends it
        return step

    lead = decode({"lookup": True}, "tree", kinds=kinds, seed=5, shared=leader)
    received = iter(sent)
    follow = decode({"lookup": True}, "tree", kinds=kinds, seed=5, shared=lambda make: pickle.loads(next(received)),
                    plans=False)
    alone = decode({"lookup": True}, "tree", kinds=kinds, seed=5)
    assert follow.outputs == lead.outputs == alone.outputs and next(received, None) is None
    assert lead.outputs[0] == plain_outputs()[0] and lead.accepted_drafts > 0 and lead.branching > 0


def test_draft_side_faults_degrade_to_plain_decoding_and_are_counted():
    run = decode({"lookup": True}, fail_every=2)
    assert run.outputs == plain_outputs()
    assert run.faults and set(run.faults) == {"dead"} and run.accepted_drafts > 0


def test_the_step_against_a_llama_shaped_target_decodes_its_plain_output():
    """The tree's mask (prefix columns first), positions and the commit's kept rows all matter here: an all-True mask
    or keeping the first rows instead of the accepted path changes the output."""
    target = LlamaTarget()
    run = decode({"lookup": True}, "tree", target=target, drafter_on=target.drafter())
    assert run.outputs == plain_outputs(KINDS, LlamaTarget())
    assert run.accepted_drafts > 0 and run.branching > 0


def test_the_commit_record_keeps_each_requests_root_and_accepted_path_at_the_front():
    accepted = AcceptRows(torch.tensor([[0, 2, -1, -1], [4, 5, 6, -1]]), torch.zeros(2, 4, dtype=torch.long),
                          torch.tensor([2, 3], dtype=torch.int32))
    commit = commit_record(DecodeStep([], [], [], None, [10, 20]), accepted)
    assert commit.kept.tolist() == [0, 2, 4, 5, 6] and commit.front.tolist() == [0, 1, 4, 5, 6]
    assert commit.positions.tolist() == [10, 11, 20, 21, 22]
    assert commit.move_dst.tolist() == [1] and commit.move_src.tolist() == [2]  # the chain's rows are in place
