"""Linear layers on CPU through oneDNN GEMM on weights packed once at start-up: the drafter's in the draft worker
here, and the pure kernel the seam puts under the target's layers inside SGLang (scheduler_patch/target_gemm.py).

Why: a verify forward runs 2-16 rows per request, and on CPU the fp32 sgemm that `F.linear` reaches costs 1.7-3x
its one-row gemv for 4-12 rows, so verifying a draft looked expensive; oneDNN on pre-packed weights stays within
~1.6x from 1 to 16 rows (`python benchmarks/gemm.py`). Owns the packing and the packed product; imports no SGLang;
must not change which rows are computed (only the GEMM kernel, whose rounding differs from MKL's like gemm from gemv).
"""

import torch
from torch import nn


def onednn_available() -> bool:
    return torch.backends.mkldnn.is_available() and hasattr(torch.ops.mkldnn, "_linear_pointwise")


def cpu_bf16_fast() -> bool:
    """Whether oneDNN has native bf16 GEMM here (AVX512-BF16 / AMX), where a bf16 drafter reads half the bytes."""
    return onednn_available() and bool(torch.ops.mkldnn._is_mkldnn_bf16_supported())


def pack(weight: torch.Tensor, batch_size: int | None = None) -> torch.Tensor:
    """weight [out, in] float -> the same matrix in oneDNN's blocked layout (an opaque tensor), laid out for
    `batch_size` rows (None: for no particular count)."""
    return torch.ops.mkldnn._reorder_linear_weight(weight.detach(), batch_size)


def packed_linear(x: torch.Tensor, packed: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """x [..., in] @ packed^T (+ bias) -> [..., out]."""
    flat = x.reshape(-1, x.shape[-1])
    out = torch.ops.mkldnn._linear_pointwise(flat, packed, bias, "none", [], "")
    return out.reshape(*x.shape[:-1], out.shape[-1])


class PackedLinear(nn.Module):
    """An inference-only nn.Linear on packed weights (the original weight is dropped)."""

    MIN_OUT = 64  # narrower layers (the confidence head's single output) gain nothing

    def __init__(self, linear: nn.Linear):
        super().__init__()
        self.in_features, self.out_features = linear.in_features, linear.out_features
        self.packed = pack(linear.weight)
        self.bias = None if linear.bias is None else linear.bias.detach()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return packed_linear(x, self.packed, self.bias)


def pack_drafter(drafter: nn.Module) -> int:
    """Every nn.Linear of the drafter (CPU float, at least MIN_OUT wide) -> PackedLinear, and its LM-head rows
    projection on packed rows. Inference only: packed layers have no gradient. Returns the layers packed."""
    count = 0
    for parent in list(drafter.modules()):
        for name, child in list(parent.named_children()):
            if (type(child) is nn.Linear and child.out_features >= PackedLinear.MIN_OUT
                    and is_float_cpu(child.weight)):
                setattr(parent, name, PackedLinear(child))
                count += 1
    rows = drafter.lm_rows
    if is_float_cpu(rows):
        packed = pack(rows)
        drafter.set_lm_projection(lambda hidden: packed_linear(hidden, packed))
        count += 1
    return count


def is_float_cpu(weight) -> bool:
    return (isinstance(weight, torch.Tensor) and weight.device.type == "cpu" and weight.dim() == 2
            and weight.dtype in (torch.float32, torch.bfloat16))
