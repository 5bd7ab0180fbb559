"""Linear layers on CPU through oneDNN GEMM on weights packed once at start-up: the drafter's in the draft worker
here, and the pure kernel the seam puts under the target's layers inside SGLang (scheduler_patch/target_gemm.py).

Why: a verify forward runs 2-16 rows per request, and on CPU the fp32 sgemm that `F.linear` reaches costs 1.7-3x
its one-row gemv for 4-12 rows, so verifying a draft looked expensive; oneDNN on pre-packed weights stays within
~1.6x from 1 to 16 rows (`python benchmarks/gemm.py`). Owns the packing and the packed product; imports no SGLang;
must not change which rows are computed (only the GEMM kernel, whose rounding differs from MKL's like gemm from gemv).
"""

import ctypes
import itertools
from collections.abc import Sequence
from dataclasses import dataclass

import torch
from torch import nn
from torch.nn import functional as F

from sgl_dspark.cost import StepCostTable, from_measurements, profile

KERNEL_ROWS = (1, 4, 16)  # row counts `time_kernels` times by default (a decode step of 1, 4, 16 requests)
# oneDNN (and ideep above it) keep one kernel per (row count, weight shape), so the heap grows with the row counts a
# server meets (prompt lengths, verify widths), and the products' varying sizes fragment it further:
# `python -m benchmarks.kernel_memory`. `packed_linear` calls the kernel on at most this many rows, which bounds
# both; above 64 rows an fp32 product is compute-bound, so splitting a larger one costs little.
MAX_KERNEL_ROWS = 128
# Each kernel oneDNN builds holds memory growing with its row count: a server meeting every count up to 128 (verify
# rows at load, prompt chunks) holds ~300 MB of them for the default model (`python -m benchmarks.kernel_memory`).
# Above PAD_ABOVE rows a call is padded with zero rows to a multiple of PAD_TO, so only 12 counts above it are ever
# built; calls of up to PAD_ABOVE rows (decode steps at concurrency 1 and 4) run as they are.
PAD_ABOVE = 32
PAD_TO = 8
# The packed layouts `packed_rows` recognises: blocks of one of ROW_BLOCKS rows, stored column group by column group,
# a group being one of COLUMN_GROUPS consecutive columns of one row (float32: 64 rows, groups of 1; bfloat16: 32
# rows, pairs).
ROW_BLOCKS = (64, 32, 16, 8)
COLUMN_GROUPS = (1, 2, 4)
CHECK_ROWS = 4096  # rows compared at a time when `packed_rows` checks a layout against the weight


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
    """x [..., in] @ packed^T (+ bias) -> [..., out], at most MAX_KERNEL_ROWS rows per kernel call (row_splits), each
    call's rows padded to `row_bucket`."""
    flat = x.reshape(-1, x.shape[-1])

    def kernel(rows: torch.Tensor) -> torch.Tensor:
        return torch.ops.mkldnn._linear_pointwise(rows, packed, bias, "none", [], "")

    def padded(rows: torch.Tensor) -> torch.Tensor:
        n = rows.shape[0]
        full = row_bucket(n)
        return kernel(rows) if full == n else kernel(torch.cat([rows, rows.new_zeros(full - n, rows.shape[1])]))[:n]

    if flat.shape[0] <= MAX_KERNEL_ROWS:
        out = padded(flat)
    else:
        out = torch.cat([padded(part) for part in flat.split(row_splits(flat.shape[0]))])
    return out.reshape(*x.shape[:-1], out.shape[-1])


def row_bucket(rows: int) -> int:
    """The rows a kernel call of `rows` rows runs on: up to PAD_ABOVE as they are, above them padded with zero rows
    to a multiple of PAD_TO (the rows' own products do not change: `packed_linear` returns those)."""
    return rows if rows <= PAD_ABOVE else -(-rows // PAD_TO) * PAD_TO


def row_splits(rows: int) -> list[int]:
    """rows -> the fewest parts of at most MAX_KERNEL_ROWS rows, as equal as can be (each more than half the cap,
    so none pays a weight read of its own for a few rows). Example (cap 128): 129 -> [65, 64]; 300 -> [100] * 3."""
    parts = -(-rows // MAX_KERNEL_ROWS)
    return [rows // parts + (i < rows % parts) for i in range(parts)]


@dataclass(frozen=True)
class PackedRows:
    """A weight's rows read from its packed copy: a tied embedding needs no table of its own beside its packed LM
    head. `table[ids]` is `weight[ids]` (the same values: a copy of those rows only); `packed_rows` makes one only
    where the view reproduces the weight exactly."""

    blocks: torch.Tensor  # [padded rows / block, in / group, block, group]: a view of the packed tensor's memory
    rows: int  # the weight's rows (the packed copy may pad them to whole blocks)
    packed: torch.Tensor  # the packed tensor, which owns the memory the view reads

    @property
    def shape(self) -> torch.Size:
        return torch.Size((self.rows, self.blocks.shape[1] * self.blocks.shape[3]))

    @property
    def dtype(self) -> torch.dtype:
        return self.blocks.dtype

    @property
    def device(self) -> torch.device:
        return self.blocks.device

    def __getitem__(self, ids: torch.Tensor) -> torch.Tensor:
        """ids [...] (int64) -> rows [..., in]."""
        block = self.blocks.shape[2]
        return self.blocks[ids // block, :, ids % block].reshape(*ids.shape, self.shape[1])


def packed_rows(weight: torch.Tensor, packed: torch.Tensor) -> PackedRows | None:
    """weight [out, in] and its `pack`ed copy -> its rows read from the copy, or None where the packed layout is not
    one of those recognised (ROW_BLOCKS x COLUMN_GROUPS) or the view differs from the weight in any element."""
    if not (packed.is_mkldnn and packed.dtype == weight.dtype and weight.dim() == 2):
        return None
    nbytes, (rows, cols) = torch.ops.mkldnn._nbytes(packed), weight.shape
    memory = (ctypes.c_char * nbytes).from_address(torch.ops.mkldnn.data_ptr(packed))
    flat = torch.frombuffer(memory, dtype=weight.dtype)
    padded = flat.numel() // cols
    if padded < rows:
        return None
    for block, group in itertools.product(ROW_BLOCKS, COLUMN_GROUPS):
        if flat.numel() % (cols * block) or cols % group:
            continue
        table = PackedRows(flat.view(padded // block, cols // group, block, group), rows, packed)
        if all(torch.equal(table[torch.arange(start, min(start + CHECK_ROWS, rows))],
                           weight[start:start + CHECK_ROWS]) for start in range(0, rows, CHECK_ROWS)):
            return table
    return None


@dataclass(frozen=True)
class KernelTimes:
    """One pass over a model's linear weights on plain SGLang's kernel (`F.linear`: MKL's sgemm/gemv on CPU) and on
    the packed one, by row count (medians, made non-decreasing; linear between and beyond the counts timed)."""

    plain: StepCostTable
    packed: StepCostTable

    def saved(self, rows: int) -> float:
        """Seconds the packed kernel saves a forward of `rows` rows against plain's (negative: it costs more)."""
        return self.plain.cost(rows) - self.packed.cost(rows)

    def scaled(self, factor: float) -> "KernelTimes":
        """The times of a pass over `factor` times as many weights (a memory-bound pass scales with its bytes)."""
        return KernelTimes(*(from_measurements(t.tokens, [s * factor for s in t.seconds])
                             for t in (self.plain, self.packed)))

    def describe(self) -> str:
        """One line: 'rows 1/4/16: plain 49.1/81.8/95.0 ms, packed 41.5/45.6/50.2 ms'."""
        ms = [f"{'/'.join(f'{s * 1000:.1f}' for s in t.seconds)} ms" for t in (self.plain, self.packed)]
        return f"rows {'/'.join(map(str, self.plain.tokens))}: plain {ms[0]}, packed {ms[1]}"


def time_kernels(pairs: Sequence[tuple[torch.Tensor, torch.Tensor]], rows: Sequence[int] = KERNEL_ROWS,
                 repeats: int = 3) -> KernelTimes:
    """pairs (weight [out, in], its packed copy) -> the time of one pass over all of them (as a forward reads them,
    from memory) with each kernel, at each row count: `repeats` timed passes after one warm-up, the median."""
    inputs = {(n, w.shape[1]): torch.randn(n, w.shape[1], dtype=w.dtype) for n in rows for w, _ in pairs}

    def plain(n: int) -> None:
        for w, _ in pairs:
            F.linear(inputs[n, w.shape[1]], w)

    def packed(n: int) -> None:
        for w, p in pairs:
            packed_linear(inputs[n, w.shape[1]], p)

    with torch.inference_mode():
        return KernelTimes(profile(plain, rows, repeats), profile(packed, rows, repeats))


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
