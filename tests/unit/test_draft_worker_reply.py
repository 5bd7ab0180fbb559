"""A Proposed reply is trusted for nothing: every framing fault (counts, sizes, references, shapes, tree structure)
and every bad number (token ids, confidences, probabilities) becomes a one-line DraftReplyInvalid, never a crash."""

import msgspec
import pytest
import torch

from sgl_dspark.draft_worker.client import DraftReplyInvalid, DraftWorkerUnavailable
from sgl_dspark.draft_worker.messages import Proposed, TensorRef
from sgl_dspark.draft_worker.reply import ReplyLimits, unpack, within
from sgl_dspark.draft_worker.shm import GrowingArena

VOCAB = 10
LIMITS = ReplyLimits(sampled=(False, True), max_tree_size=4, vocab=VOCAB)  # request 1 samples


@pytest.fixture()
def arena(tmp_path):
    arena = GrowingArena(str(tmp_path), 4096, "rep")
    yield arena
    arena.close()


def write(arena, tokens=(7, 1, 2, 9, 3), parents=(-1, 0, 0, -1, 0), confidence=(1.0, 0.9, 0.2, 1.0, 0.5),
          sizes=(3, 2), probs=None) -> Proposed:
    """Request 0: a 3-node tree (greedy); request 1: a chain of 2 (sampled, with a draft_probs row per node)."""
    probs = torch.full((2, VOCAB), 0.1) if probs is None else probs
    refs = arena.put_all([torch.tensor(tokens), torch.tensor(parents), torch.tensor(confidence, dtype=torch.float32),
                          probs])
    return Proposed(sizes, (False, True), *refs, drafted_total=3)


def test_a_valid_reply_unpacks_into_copies(arena):
    trees = unpack(write(arena), arena, LIMITS)
    assert [t.tokens.tolist() for t in trees] == [[7, 1, 2], [9, 3]]
    assert [t.parents.tolist() for t in trees] == [[-1, 0, 0], [-1, 0]]
    assert trees[0].draft_probs is None and trees[1].draft_probs.shape == (2, VOCAB)
    write(arena, tokens=(0, 0, 0, 0, 0))  # the arena is overwritten by the next step: the trees are copies
    assert trees[0].tokens.tolist() == [7, 1, 2]


def shift(ref: TensorRef, **fields) -> TensorRef:
    return msgspec.structs.replace(ref, **fields)


GARBLED = {  # name: (how the reply is spoiled, what the message says)
    "tree count": (lambda r: msgspec.structs.replace(r, sizes=(5,), has_probs=(True,)), "1 trees"),
    "empty tree": (lambda r: msgspec.structs.replace(r, sizes=(0, 5)), "tree 0 has 0 nodes"),
    "tree too big": (lambda r: msgspec.structs.replace(r, sizes=(5, 0)), "tree 0 has 5 nodes (allowed 1..4)"),
    "sampled, no probs": (lambda r: msgspec.structs.replace(r, has_probs=(False, False), draft_probs=None),
                          "sampled requests [1]"),
    "probs flag lies": (lambda r: msgspec.structs.replace(r, has_probs=(True, True)), "draft_probs is [2, 10]"),
    "probs missing": (lambda r: msgspec.structs.replace(r, draft_probs=None), "contradicts has_probs"),
    "shape": (lambda r: msgspec.structs.replace(r, tokens=shift(r.tokens, shape=(4,))), "tokens is [4]"),
    "dtype": (lambda r: msgspec.structs.replace(r, confidence=shift(r.confidence, dtype="float16")), "float16"),
    "outside arena": (lambda r: msgspec.structs.replace(r, parents=shift(r.parents, offset=1 << 40)), "lies outside"),
    "other arena": (lambda r: msgspec.structs.replace(r, tokens=shift(r.tokens, arena="/etc/passwd")),
                    "is not this arena"),
    "probs width": (lambda r: msgspec.structs.replace(r, draft_probs=shift(r.draft_probs, shape=(2, 9))),
                    "draft_probs is [2, 9]"),
}


@pytest.mark.parametrize("name", GARBLED)
def test_garbled_framing_is_refused(arena, name):
    spoil, says = GARBLED[name]
    with pytest.raises(DraftReplyInvalid) as caught:
        unpack(spoil(write(arena)), arena, LIMITS)
    assert caught.value.garbled and caught.value.cause == "invalid_reply"
    assert says in str(caught.value) and "\n" not in str(caught.value)


@pytest.mark.parametrize("fields, says", [
    (dict(parents=(-1, 0, 2, -1, 0)), "parents must be -1 for the root and < own index"),  # node 2 its own parent
    (dict(parents=(-1, 0, -3, -1, 0)), "negative parent"),
    (dict(parents=(0, 0, 0, -1, 0)), "tree 0"),
], ids=["self parent", "negative parent", "root with a parent"])
def test_a_tree_that_is_no_tree_is_refused(arena, fields, says):
    with pytest.raises(DraftReplyInvalid, match=says) as caught:
        unpack(write(arena, **fields), arena, LIMITS)
    assert caught.value.garbled


NAN = float("nan")


@pytest.mark.parametrize("fields, says", [
    (dict(tokens=(7, 1, 2, 9, VOCAB)), "token ids outside"),
    (dict(tokens=(7, -1, 2, 9, 3)), "token ids outside"),
    (dict(confidence=(1.0, NAN, 0.2, 1.0, 0.5)), "confidences"),
    (dict(confidence=(1.0, 1.5, 0.2, 1.0, 0.5)), "confidences"),
    (dict(confidence=(1.0, 0.9, 0.2, 0.7, 0.5)), "roots 1"),
    (dict(probs=torch.full((2, VOCAB), -0.1)), "draft_probs"),
    (dict(probs=torch.full((2, VOCAB), float("inf"))), "draft_probs"),
], ids=["token too big", "negative token", "nan confidence", "confidence > 1", "root confidence", "negative probs",
        "infinite probs"])
def test_bad_numbers_are_refused_without_calling_the_reply_garbled(arena, fields, says):
    with pytest.raises(DraftReplyInvalid, match=says) as caught:
        unpack(write(arena, **fields), arena, LIMITS)
    assert not caught.value.garbled and isinstance(caught.value, DraftWorkerUnavailable)


def test_within_is_false_for_nan_and_true_for_empty():
    assert within(torch.tensor([0.0, 1.0]), 0, 1) and within(torch.zeros(0), 0, 1)
    assert not within(torch.tensor([0.5, NAN]), 0, 1) and not within(torch.tensor([2]), 0, 1)
