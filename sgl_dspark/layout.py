"""Batch layout of one verify step: trees packed into fixed-width verify rows, the ragged verify batch the target's
forward runs on (each request's real rows only, its mask flattened as SGLang's custom mask), the forward's outputs
put back into the fixed width, and the accepted paths unpacked into SGLang's accept layout.

Every request gets `width` rows (its tree, then padding nodes hanging off the root that are never accepted); the
tree mask is [bs, width, width] (prefix columns implied). The verify forward runs on the real rows alone (no row of
padding costs a forward), and acceptance, commit and logprobs read its outputs in the fixed width (`padded`).
Pure torch; no SGLang imports.
"""

from dataclasses import dataclass
from functools import cached_property

import torch

from sgl_dspark.tree import DraftTree, ancestor_mask, position_ids
from sgl_dspark.verify import VerifyResult


@dataclass(frozen=True)
class VerifyRows:
    tokens: torch.Tensor  # [bs * width] int64, node 0 of each request is its anchor
    positions: torch.Tensor  # [bs * width] int64
    mask: torch.Tensor  # [bs, width, width] bool: row i may attend to verify row j
    sizes: torch.Tensor  # [bs] int64 real nodes per request (the rest is padding)
    width: int
    parents: torch.Tensor  # [bs, width] int64 parent node (-1 at the root; padding nodes hang off the root)

    @cached_property
    def real(self) -> torch.Tensor:
        """[sum(sizes)] int64: the flat rows of the real nodes (request after request), the rows the forward runs.
        Example: sizes [2, 1], width 3 -> [0, 1, 3]."""
        return (torch.arange(self.width)[None, :] < self.sizes[:, None]).flatten().nonzero().squeeze(1)


@dataclass(frozen=True)
class VerifyForwardInput:
    """What one step's verify forward runs on (scheduler_patch/runtime/verify_mode.py puts it on SGLang's batch):
    each request's real rows only, request after request."""

    tokens: torch.Tensor  # [R] int64 verify rows, R = sum(sizes)
    positions: torch.Tensor  # [R] int64
    mask: torch.Tensor  # flattened bool, request after request: [n_b, n_b] each, or [n_b, seq_len + n_b] with the
    # prefix columns (all True) first
    sizes: tuple[int, ...]  # n_b: rows of request b
    width: int  # the step's fixed width (rows per request in acceptance and commit; KV slots reserved past it)
    real: torch.Tensor  # [R] int64 each row's flat row in the fixed width (VerifyRows.real)


@dataclass(frozen=True)
class AcceptRows:
    accept_index: torch.Tensor  # [bs, width] int64 flat verify row of each kept node (root first), -1 padded
    tokens: torch.Tensor  # [bs, stride] int64 emitted tokens (accepted drafts then bonus), 0 padded
    accept_lens: torch.Tensor  # [bs] int32 tau per request (bonus included)

    def to_host(self) -> "AcceptRows":
        """The same rows on the CPU, in one device-to-host transfer (itself when already there)."""
        if self.tokens.device.type == "cpu":
            return self
        width, stride = self.accept_index.shape[1], self.tokens.shape[1]
        packed = torch.cat([self.accept_index, self.tokens, self.accept_lens[:, None].long()], 1).cpu()
        return AcceptRows(packed[:, :width], packed[:, width:width + stride], packed[:, -1].to(torch.int32))


def pad_tree(tree: DraftTree, width: int) -> tuple[torch.Tensor, torch.Tensor]:
    """-> tokens [width], parents [width]: padding nodes repeat the anchor and hang off the root."""
    pad = width - tree.size
    if pad < 0:
        raise ValueError(f"tree of {tree.size} nodes does not fit a verify width of {width}")
    tokens = torch.cat([tree.tokens, tree.tokens[:1].expand(pad)])
    parents = torch.cat([tree.parents, torch.zeros(pad, dtype=tree.parents.dtype)])
    return tokens, parents


def pack_trees(trees: list[DraftTree], seq_lens: list[int], width: int | None = None) -> VerifyRows:
    """Trees (one per request) + each request's cached length -> the verify rows."""
    width = width or max(t.size for t in trees)
    tokens, positions, masks, parents = [], [], [], []
    for tree, seq_len in zip(trees, seq_lens):
        tok, par = pad_tree(tree, width)
        tokens.append(tok)
        parents.append(par)
        positions.append(position_ids(par, seq_len))
        masks.append(ancestor_mask(par))
    sizes = torch.tensor([t.size for t in trees], dtype=torch.long)
    return VerifyRows(torch.cat(tokens), torch.cat(positions), torch.stack(masks), sizes, width, torch.stack(parents))


def verify_forward_input(rows: VerifyRows, seq_lens: list[int], prefix_columns: bool) -> VerifyForwardInput:
    """The packed rows as the verify forward takes them: each request's real rows, its mask cut to them;
    `prefix_columns`: the attention backend wants each mask row to cover the request's cached prefix too (GPUs),
    else the draft block only (CPU).

    Example: one chain [5, 6] after 3 cached tokens: mask [1, 0, 1, 1] without prefix columns,
    [1, 1, 1, 1, 0, 1, 1, 1, 1, 1] with them."""
    sizes = tuple(int(n) for n in rows.sizes.tolist())
    parts = [m[:n, :n] for m, n in zip(rows.mask, sizes)]
    if prefix_columns:
        parts = [torch.cat([torch.ones(m.shape[0], n, dtype=torch.bool), m], 1) for m, n in zip(parts, seq_lens)]
    real = rows.real
    return VerifyForwardInput(rows.tokens[real], rows.positions[real], torch.cat([m.flatten() for m in parts]), sizes,
                              rows.width, real)


def padded(values: torch.Tensor, real: torch.Tensor, rows: int) -> torch.Tensor:
    """values [R, ...] of the real rows -> [rows, ...] in the fixed width, zeros in the padding rows (which no
    acceptance rule reads: every rule masks nodes past a request's size), on values' device.
    Example: values [[1.], [2.], [3.]], real [0, 1, 3], rows 4 -> [[1.], [2.], [0.], [3.]]."""
    if values.shape[0] == rows:
        return values
    out = values.new_zeros((rows, *values.shape[1:]))
    return out.index_copy_(0, real.to(values.device), values)


def accept_rows(results: list[VerifyResult], width: int, stride: int) -> AcceptRows:
    """Verify results -> the rows to keep (root + accepted path) and the tokens each request emits."""
    bs = len(results)
    accepted = AcceptRows(torch.full((bs, width), -1, dtype=torch.long), torch.zeros((bs, stride), dtype=torch.long),
                          torch.zeros(bs, dtype=torch.int32))
    for b, result in enumerate(results):
        write_path(accepted, b, result, width)
    return accepted


def write_path(accepted: AcceptRows, b: int, result: VerifyResult, width: int) -> None:
    """Request b's rows of `accepted` (in place) hold `result`."""
    kept = torch.cat([torch.zeros(1, dtype=torch.long), result.accepted_nodes.long()])
    device = accepted.tokens.device
    accepted.accept_index[b] = -1
    accepted.accept_index[b, :kept.numel()] = (b * width + kept).to(device)
    accepted.tokens[b] = 0
    accepted.tokens[b, :result.tau] = result.emitted_tokens.to(device)
    accepted.accept_lens[b] = result.tau


def verify_results(accepted: AcceptRows, width: int) -> list[VerifyResult]:
    """Host rows -> each request's VerifyResult (the inverse of `accept_rows`)."""
    out = []
    rows = zip(accepted.accept_index.tolist(), accepted.tokens.tolist(), accepted.accept_lens.tolist())
    for b, (index, tokens, tau) in enumerate(rows):
        nodes = [i - b * width for i in index[1:tau]]
        out.append(VerifyResult(torch.tensor(nodes, dtype=torch.long), torch.tensor(tokens[:tau - 1], dtype=torch.long),
                                tokens[tau - 1], nodes[-1] if nodes else 0))
    return out


def kv_moves(accepted: AcceptRows, width: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(dst [M], src [M]) flat verify rows whose KV must move so that each request's kept rows (root + accepted path)
    lead its verify window; rows already in place are left out, so a chain's commit moves nothing.
    Example: width 4, one request keeping rows [0, 2] -> dst [1], src [2]; keeping [0, 1] -> nothing."""
    bs = accepted.accept_index.shape[0]
    kept = accepted.accept_index >= 0
    dst = (torch.arange(bs)[:, None] * width + torch.arange(accepted.accept_index.shape[1])[None, :])[kept]
    src = accepted.accept_index[kept]
    moved = dst != src
    return dst[moved], src[moved]
