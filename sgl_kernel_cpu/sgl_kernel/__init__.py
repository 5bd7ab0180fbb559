"""CPU stand-in for SGLang's compiled sgl_kernel: pure-torch ops for SGLANG_USE_CPU_ENGINE=1 hosts.
Never install it where a CUDA/ROCm/XPU sgl_kernel (sglang-kernel wheel) exists: it would shadow it.
Unimplemented names raise NotImplementedError when called, AttributeError where SGLang probes.
"""

from __future__ import annotations

from . import speculative
from ._stub import module_getattr
from .cache_locs import (
    assign_draft_cache_locs_contiguous_cpu,
    assign_extend_cache_locs_cpu,
    fill_accept_out_cache_loc_cpu,
    fill_bonus_tokens_cpu,
    rotate_input_ids_cpu,
)
from .kvcache import assign_req_to_token_pool_cpu, copy_all_layer_kv_cache_cpu
from .speculative import (
    build_tree_kernel_efficient_cpu,
    reconstruct_indices_from_tree_mask,
    verify_tree_greedy_cpu,
)

__version__ = "0.0.1"

__all__ = [
    "assign_draft_cache_locs_contiguous_cpu",
    "assign_extend_cache_locs_cpu",
    "assign_req_to_token_pool_cpu",
    "build_tree_kernel_efficient_cpu",
    "copy_all_layer_kv_cache_cpu",
    "fill_accept_out_cache_loc_cpu",
    "fill_bonus_tokens_cpu",
    "reconstruct_indices_from_tree_mask",
    "rotate_input_ids_cpu",
    "speculative",
    "verify_tree_greedy_cpu",
]

__getattr__ = module_getattr(__name__)
