"""Tensor parallelism on a CPU host: the two places where SGLang 0.5.23's CPU TP stops before serving.

- Every rank dies creating its process groups: `init_model_parallel_group` leaves `use_pynccl` on for CPU, and
  `PyNcclCommunicator` asserts a CUDA device ("Expected a cuda device, but got: cpu"). CPU_NO_PYNCCL passes
  use_pynccl=False on a CPU build when the caller left it unset; the CPU all-reduce then runs on the gloo device
  group (SGLang's own CPU branch in `GroupCoordinator.all_reduce`; its shared-memory kernel needs the compiled
  sgl_kernel, which a CPU-only install lacks).
- Start-up stops when there are more ranks than NUMA nodes and SGLANG_CPU_OMP_THREADS_BIND is unset ("the total
  number of ranks ... should be smaller than or equal to number of numa node"). CPU_THREADS_BINDING then sets the
  variable from this process's core list, split into one contiguous share per rank (`core_shares`), as SGLang's
  message suggests doing by hand. A variable the user set is kept.

Neither changes anything for one rank, on a GPU, or where SGLang already runs (as many ranks as NUMA nodes).
"""

import os
from collections.abc import Sequence

from scheduler_patch.patches import Patch

PARALLEL_STATE = "sglang.srt.distributed.parallel_state"
NUMA_UTILS = "sglang.srt.utils.numa_utils"
BIND_ENV = "SGLANG_CPU_OMP_THREADS_BIND"


def core_shares(cores: Sequence[int], ranks: int) -> list[str]:
    """One contiguous share of `cores` per rank, in SGLang's bind syntax (the first shares one core larger when they
    do not divide evenly; with fewer cores than ranks, rank i gets core i % len(cores)).

    >>> core_shares([0, 1], 2), core_shares(range(8), 3), core_shares([4], 2)
    (['0', '1'], ['0,1,2', '3,4,5', '6,7'], ['4', '4'])
    """
    cores = sorted(cores)
    if len(cores) < ranks:
        return [str(cores[i % len(cores)]) for i in range(ranks)]
    size, extra = divmod(len(cores), ranks)
    shares, start = [], 0
    for rank in range(ranks):
        end = start + size + (rank < extra)
        shares.append(",".join(map(str, cores[start:end])))
        start = end
    return shares


def _no_pynccl_on_cpu(original, *args, **kwargs):
    import inspect

    from sglang.srt.distributed import parallel_state

    if parallel_state._is_cpu:
        bound = inspect.signature(original).bind(*args, **kwargs)
        if bound.arguments.get("use_pynccl") is None:
            bound.arguments["use_pynccl"] = False
        return original(*bound.args, **bound.kwargs)
    return original(*args, **kwargs)


def _pynccl_hint_is_a_parameter() -> str | None:
    from sglang.srt.distributed import parallel_state

    if not hasattr(parallel_state, "_is_cpu"):
        return f"{PARALLEL_STATE}._is_cpu is gone"
    return None


def _bind_from_the_core_list(original, *, numa_index: int, world_size: int):
    from sglang.srt.utils import numa_utils

    if BIND_ENV not in os.environ and world_size > len(numa_utils.get_cpu_ids_by_node()):
        os.environ[BIND_ENV] = "|".join(core_shares(sorted(os.sched_getaffinity(0)), world_size))
    return original(numa_index=numa_index, world_size=world_size)


def _binding_reads_the_variable() -> str | None:
    import inspect

    from sglang.srt.utils import numa_utils

    source = inspect.getsource(numa_utils.init_threads_binding)
    if BIND_ENV not in source or not hasattr(numa_utils, "get_cpu_ids_by_node"):
        return f"{NUMA_UTILS}.init_threads_binding no longer reads {BIND_ENV} against get_cpu_ids_by_node"
    return None


CPU_NO_PYNCCL = Patch("dspark.cpu_no_pynccl", f"{PARALLEL_STATE}.init_model_parallel_group", "function",
                      ("group_ranks", "local_rank", "backend", "use_pynccl", "use_custom_allreduce",
                       "use_message_queue_broadcaster", "group_name", "use_mscclpp", "use_torch_symm_mem_allreduce",
                       "recovered_rank", "rank_offset", "max_world_size"),
                      _no_pynccl_on_cpu, requires=_pynccl_hint_is_a_parameter)
CPU_THREADS_BINDING = Patch("dspark.cpu_threads_binding", f"{NUMA_UTILS}.init_threads_binding", "function",
                            ("numa_index", "world_size"), _bind_from_the_core_list,
                            requires=_binding_reads_the_variable)
PATCHES = (CPU_NO_PYNCCL, CPU_THREADS_BINDING)
