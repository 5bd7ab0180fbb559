"""What a name this stand-in does not implement resolves to.

Two outcomes, chosen per name (both name the symbol in the message):

* ``AttributeError`` (so ``from sgl_kernel import X`` raises ImportError) for
  every name SGLang 0.5.23 *probes*, i.e. imports inside ``try/except
  ImportError`` and falls back when absent (it has no ``hasattr`` probes on
  ``sgl_kernel`` itself), e.g.
  ``sglang/srt/models/inkling_common/norm.py`` does
  ``try: from sgl_kernel import rmsnorm / except ImportError: rmsnorm = None``
  and uses ``F.rms_norm`` only when it is None. A callable stub there would
  take the kernel path and then fail. The same holds for the compiled
  package's submodule names (``from sgl_kernel import kvcacheio`` must fall
  through to the real submodule import, which then fails cleanly), for
  private/dunder names (introspection), and for anything in ``_PROBED``.
* Otherwise a callable that raises ``NotImplementedError`` when called, so a
  module that imports a kernel it only uses on a path CPU serving never takes
  still imports, and the path that does take it fails loudly and by name.

No op is ever registered under ``torch.ops.sgl_kernel``: SGLang decides
``cpu_has_amx_support()`` by ``hasattr(torch.ops.sgl_kernel,
"convert_weight_packed")`` (sglang/srt/utils/common.py) and must keep seeing
False here, which keeps every ``torch.ops.sgl_kernel.*_cpu`` call site off.
"""

from __future__ import annotations

from collections.abc import Callable

_PREFIX = "sgl_kernel CPU stand-in"

# Every name SGLang 0.5.23 imports from ``sgl_kernel`` only inside
# ``try/except ImportError`` (AST scan of the installed sglang). Only
# ``rmsnorm`` is probed on a path CPU serving reaches; the others sit under
# XPU/MUSA branches and are listed so they never resolve to a stub either.
# ``merge_state_v2`` is probed in sarvam_moe.py (CUDA branch) but imported
# unguarded by flashattention_backend.py, so it stays a stub.
_PROBED = frozenset(
    {
        "awq_dequantize",  # srt/hardware_backend/gpu/quantization/awq_kernels.py (XPU)
        "fused_qk_rope_with_cos_sin_cache_inplace",  # srt/layers/rotary_embedding/base.py (XPU)
        "multimodal_rotary_embedding",  # srt/layers/rotary_embedding/mrope.py (XPU)
        "rmsnorm",  # srt/models/inkling_common/norm.py (unconditional try)
        "top_k_renorm_prob",  # kernels/ops/sampling/renorm.py (MUSA)
        "top_p_renorm_prob",  # kernels/ops/sampling/renorm.py (MUSA)
        "transfer_cache_dsv4_mla",  # srt/mem_cache/memory_pool_host.py (XPU)
        # kernels/ops/speculative/verify_sampling.py (MUSA)
        "tree_speculative_sampling_target_only",
    }
)

# Submodules of the compiled sgl_kernel package that this stand-in lacks.
_SUBMODULES = frozenset(
    {
        "allreduce", "alltoall", "attention", "common_ops", "cpu", "cutlass_moe",
        "elementwise", "flash_attn", "flash_mla", "flashmla", "fused_moe", "gemm",
        "gptq_marlin", "grammar", "hadamard", "infllm_v2", "kda", "kvcacheio",
        "load_utils", "mamba", "marlin", "mem_cache", "memory", "metal", "moe",
        "musa", "quantization", "radix_tree", "rotary_embedding", "sampling",
        "scalar_type", "sparse_flash_attn", "spatial", "testing", "top_k", "utils",
        "version",
    }
)


def _not_implemented(qualname: str) -> Callable:
    def stub(*args, **kwargs):
        raise NotImplementedError(f"{_PREFIX}: {qualname} is not implemented")

    stub.__name__ = stub.__qualname__ = qualname.rsplit(".", 1)[-1]
    stub.__doc__ = f"Placeholder: {qualname} has no pure-torch implementation here."
    return stub


def module_getattr(module_name: str) -> Callable[[str], Callable]:
    """A PEP 562 ``__getattr__`` for ``module_name`` with the policy above."""

    def __getattr__(name: str) -> Callable:
        qualname = f"{module_name}.{name}"
        if name.startswith("_") or name in _PROBED or name in _SUBMODULES:
            raise AttributeError(f"{_PREFIX}: {qualname} is not implemented")
        return _not_implemented(qualname)

    return __getattr__
