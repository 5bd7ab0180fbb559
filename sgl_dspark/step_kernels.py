"""The step's Triton kernels, one program per request: the greedy match walk (`matched_path`), the accepted path's
rows (`path_rows`) and the tree's verify mask and positions (`verify_layout`). Each computes exactly what its torch
twin computes (acceptance.matched_path, acceptance.path_rows, layout.verify_forward_input), its oracle in tests
(tests/unit/test_step_kernels.py through Triton's interpreter on the CPU, tests/gpu/test_step_kernels_cuda.py on
CUDA); `sgl_dspark.step_ops` picks, per op, whichever measures faster on the device. Imports Triton: import it
lazily, only where a device runs Triton. Must not import SGLang.
"""

import torch
import triton
import triton.language as tl

from sgl_dspark.layout import AcceptRows, VerifyForwardInput, VerifyRows


@triton.jit(do_not_specialize=["w"])  # one build per block size, whatever the width
def _match_walk(tokens, parents, sizes, choices, on_path, w, W_BLOCK: tl.constexpr):
    """Request b's walk from the root: at each node, its first child (in index order) carrying the node's choice."""
    b = tl.program_id(0).to(tl.int64)
    node = tl.arange(0, W_BLOCK)
    inside = node < w
    real = node < tl.load(sizes + b)
    tok = tl.load(tokens + b * w + node, mask=inside, other=-1)
    par = tl.load(parents + b * w + node, mask=inside, other=-2)
    path = node == 0
    cur = tl.zeros((), dtype=tl.int32)
    for _ in range(1, w):  # a node not found leaves cur where it was: later rounds find nothing either
        want = tl.load(choices + b * w + cur)
        hit = real & (par == cur) & (tok == want)
        child = tl.min(tl.where(hit, node, W_BLOCK), axis=0)
        path = path | (node == child)
        cur = tl.where(child < W_BLOCK, child, cur)
    tl.store(on_path + b * w + node, path, mask=inside)


@triton.jit(do_not_specialize=["w", "stride"])
def _path_rows(tokens, on_path, choices, accept_index, emitted, accept_lens, w, stride, W_BLOCK: tl.constexpr,
               S_BLOCK: tl.constexpr):
    """Request b's kept rows (root first, ascending), its emitted tokens (the path's drafts, then the bonus: the
    choice at the deepest kept node) and tau."""
    b = tl.program_id(0).to(tl.int64)
    node = tl.arange(0, W_BLOCK)
    inside = node < w
    on = (tl.load(on_path + b * w + node, mask=inside, other=0) != 0) & inside
    tok = tl.load(tokens + b * w + node, mask=inside, other=0)
    rank = tl.cumsum(on.to(tl.int32), axis=0) - 1  # a kept node's place on the path
    kept = tl.sum(on.to(tl.int32), axis=0)
    last = tl.max(tl.where(on, node, 0), axis=0)
    tl.store(accept_index + b * w + rank, b * w + node, mask=on)
    tl.store(accept_index + b * w + node, tl.full((W_BLOCK,), -1, tl.int64), mask=inside & (node >= kept))
    tl.store(emitted + b * stride + rank - 1, tok, mask=on & (rank >= 1))
    col = tl.arange(0, S_BLOCK)
    bonus = tl.load(choices + b * w + last)
    tl.store(emitted + b * stride + col, tl.where(col == kept - 1, bonus, 0).to(tl.int64),
             mask=(col >= kept - 1) & (col < stride))
    tl.store(accept_lens + b, kept)


@triton.jit(do_not_specialize=["w"])
def _verify_layout(parents, sizes, seq_lens, mask_starts, row_starts, mask, positions, w, PREFIX: tl.constexpr,
                   W_BLOCK: tl.constexpr, P_BLOCK: tl.constexpr):
    """Request b's rows of the flattened verify mask ([n, seq_len + n] with PREFIX, else [n, n]: row i True at i
    and its ancestors) and their positions (seq_len + depth)."""
    b = tl.program_id(0).to(tl.int64)
    node = tl.arange(0, W_BLOCK)
    n = tl.load(sizes + b)
    seq_len = tl.load(seq_lens + b)
    row = node < n
    anc = node[:, None] == node[None, :]  # [i, j]: j is i or an ancestor of i
    up = node.to(tl.int64)
    for _ in range(1, w):
        up = tl.load(parents + b * w + up, mask=row & (up >= 0), other=-1)
        anc = anc | (up[:, None] == node[None, :])
    tl.store(positions + tl.load(row_starts + b) + node, seq_len + tl.sum(anc.to(tl.int64), axis=1) - 1, mask=row)
    prefix = seq_len if PREFIX else 0
    cols = prefix + n
    start = tl.load(mask_starts + b)
    block = row[:, None] & (node[None, :] < n)
    tl.store(mask + start + node[:, None] * cols + prefix + node[None, :], anc, mask=block)
    if PREFIX:
        col = tl.arange(0, P_BLOCK)
        ones = tl.full((W_BLOCK, P_BLOCK), 1, tl.int1)
        for c in range(0, prefix, P_BLOCK):
            tl.store(mask + start + node[:, None] * cols + c + col[None, :], ones,
                     mask=row[:, None] & (c + col[None, :] < prefix))


def matched_path(tokens: torch.Tensor, parents: torch.Tensor, ancestors: torch.Tensor, sizes: torch.Tensor,
                 choices: torch.Tensor) -> torch.Tensor:
    """acceptance.matched_path in one launch (`ancestors` unused: the walk follows `parents`) -> on_path [bs, w]."""
    bs, w = tokens.shape
    on_path = torch.empty(bs, w, dtype=torch.bool, device=tokens.device)
    _match_walk[(bs,)](tokens.contiguous(), parents.contiguous(), sizes.to(tokens.device), choices.contiguous(),
                       on_path, w, W_BLOCK=triton.next_power_of_2(w))
    return on_path


def path_rows(tokens: torch.Tensor, on_path: torch.Tensor, choices: torch.Tensor, stride: int) -> AcceptRows:
    """acceptance.path_rows in one launch."""
    bs, w = tokens.shape
    device = tokens.device
    accept_index = torch.empty(bs, w, dtype=torch.long, device=device)
    emitted = torch.empty(bs, stride, dtype=torch.long, device=device)
    accept_lens = torch.empty(bs, dtype=torch.int32, device=device)
    _path_rows[(bs,)](tokens.contiguous(), on_path.contiguous(), choices.contiguous(), accept_index,
                      emitted, accept_lens, w, stride, W_BLOCK=triton.next_power_of_2(w),
                      S_BLOCK=triton.next_power_of_2(stride))
    return AcceptRows(accept_index, emitted, accept_lens)


def verify_forward_input(rows: VerifyRows, seq_lens: list[int], prefix_columns: bool,
                         device: torch.device) -> VerifyForwardInput:
    """layout.verify_forward_input with the mask and positions made on `device` (one launch; the tree's parents,
    sizes and lengths go there in one host-to-device copy)."""
    counts, lens = rows.sizes, torch.tensor(seq_lens, dtype=torch.long)  # host tensors
    areas = counts * (counts + lens * prefix_columns)  # each request's mask entries
    bs, w = rows.parents.shape
    meta = torch.cat([rows.parents.flatten(), counts, lens, areas.cumsum(0) - areas, counts.cumsum(0) - counts])
    parents, sizes, lens, mask_starts, row_starts = meta.to(device).split([bs * w, bs, bs, bs, bs])
    mask = torch.empty(int(areas.sum()), dtype=torch.bool, device=device)
    positions = torch.empty(int(counts.sum()), dtype=torch.long, device=device)
    _verify_layout[(bs,)](parents, sizes, lens, mask_starts, row_starts, mask, positions, w, PREFIX=prefix_columns,
                          W_BLOCK=triton.next_power_of_2(w), P_BLOCK=128)
    real = rows.real
    return VerifyForwardInput(rows.tokens[real], positions, mask, tuple(counts.tolist()), rows.width, real)
