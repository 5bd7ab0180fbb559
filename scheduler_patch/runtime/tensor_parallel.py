"""DSPARK under SGLang's tensor parallelism: one verify plan per step, made on TP rank 0 and broadcast.

Every rank runs the target's verify forward on the same rows, so every rank must hold one plan: the gate's
decisions, the drafts, the lookup grafts, the verify budget's choice and the packed rows. Those depend on
measured step times (the budget's online refit, the gate) and on the drafter's float arithmetic, which ranks do
not share, so the plan is made on rank 0 alone and sent to the others as one pickled DecodeStep over the TP
group's CPU (gloo) group, as SGLang's builtin DSPARK broadcasts its decisions from rank 0. What follows the forward
is derived identically on every rank from what they share: the logits (gathered whole on every rank by SGLang's
logits processor), the broadcast step and the verifier's random stream (seeded alike from --random-seed and drawn
alike), so every rank accepts the same tokens and commits the same KV.

Also: the drafter borrows the target's embedding and LM head, which TP splits by vocabulary; it gets them whole.
"""

import time
from collections.abc import Callable

import torch

from sgl_dspark.step import DecodeStep


class RankZeroPlan:
    """shared(make): make() on TP rank 0, its step broadcast to the other ranks (StepParts.shared)."""

    def __init__(self, group):
        self.group = group  # SGLang's GroupCoordinator of the TP group
        self.leader = group.rank_in_group == 0
        self.seconds = 0.0  # time spent in broadcasts (this rank's side), for the step split

    def __call__(self, make: Callable[[], DecodeStep]) -> DecodeStep:
        from sglang.srt.utils import broadcast_pyobj

        step = make() if self.leader else None
        start = time.perf_counter()
        [step] = broadcast_pyobj([step] if self.leader else [], self.group.rank, self.group.cpu_group,
                                 src=self.group.ranks[0])
        self.seconds += time.perf_counter() - start
        return step


def tp_group():
    """SGLang's TP group when the target runs on several ranks, else None."""
    from sglang.srt.runtime_context import get_parallel

    if int(get_parallel().tp_size) <= 1:
        return None
    from sglang.srt.distributed import get_tp_group

    return get_tp_group()


def whole_vocab(weight: torch.Tensor, vocab: int, group) -> torch.Tensor:
    """A vocabulary-parallel table [vocab / ranks (padded), hidden] -> the whole table [vocab, hidden] on every
    rank (the shards are consecutive row ranges; the padding rows sit past `vocab`)."""
    if group is None or weight.shape[0] >= vocab:
        return weight
    return group.all_gather(weight.contiguous(), dim=0)[:vocab]
