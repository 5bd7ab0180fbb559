"""Batch layout of one verify step: trees packed into SGLang's fixed-width verify rows, the verify batch those
rows make (the mask flattened as SGLang's custom mask), and the accepted paths unpacked into its accept layout.

Every request gets `width` rows (its tree, then padding nodes hanging off the root that are never
accepted); the tree mask is [bs, width, width] (prefix columns implied). Pure torch; no SGLang imports.
"""

from dataclasses import dataclass

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


@dataclass(frozen=True)
class VerifyForwardInput:
    """What one step's verify forward runs on (scheduler_patch/runtime/verify_mode.py puts it on SGLang's batch)."""

    tokens: torch.Tensor  # [bs * width] int64 verify rows, request after request
    positions: torch.Tensor  # [bs * width] int64
    mask: torch.Tensor  # flattened bool, request after request: [width, width] each, or [width, seq_len + width]
    # with the prefix columns (all True) first
    width: int


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
    """The packed rows as the verify forward takes them; `prefix_columns`: the attention backend wants each mask row
    to cover the request's cached prefix too (GPUs), else the draft block only (CPU).

    Example: one chain [5, 6] after 3 cached tokens, width 2: mask [1, 0, 1, 1] without prefix columns,
    [1, 1, 1, 1, 0, 1, 1, 1, 1, 1] with them."""
    if not prefix_columns:
        return VerifyForwardInput(rows.tokens, rows.positions, rows.mask.flatten(), rows.width)
    parts = [torch.cat([torch.ones(rows.width, n, dtype=torch.bool), m], 1).flatten()
             for m, n in zip(rows.mask, seq_lens)]
    return VerifyForwardInput(rows.tokens, rows.positions, torch.cat(parts), rows.width)


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
