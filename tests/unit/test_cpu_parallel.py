"""CPU tensor parallelism's patches (scheduler_patch/cpu_parallel.py): the binding's core shares, and both patches
applied in every process whatever DSPARK implementation is chosen (plain SGLang's TP needs them too)."""

import pytest

from scheduler_patch import cpu_parallel, plugin


@pytest.mark.parametrize("cores, ranks, shares", [
    ([0, 1], 2, ["0", "1"]),
    (range(8), 3, ["0,1,2", "3,4,5", "6,7"]),
    ([6, 4, 5, 7], 2, ["4,5", "6,7"]),
    ([4], 2, ["4", "4"]),
    (range(4), 1, ["0,1,2,3"]),
])
def test_each_rank_gets_a_contiguous_share_of_the_cores(cores, ranks, shares):
    assert cpu_parallel.core_shares(cores, ranks) == shares


@pytest.mark.parametrize("impl", ["plugin", "builtin"])
def test_the_cpu_parallel_patches_load_with_either_implementation(impl):
    assert all(any(p is q for q in plugin.patches_for(impl)) for p in cpu_parallel.PATCHES)
