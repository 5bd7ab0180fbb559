"""Batched acceptance: every request's accepted path in one pass of tensor ops over the step's verify rows, on the
logits' device, with no loop over requests and no host sync.

Owns the match rule of greedy verification for a whole step: a node is accepted when every node on its path from the
root (itself included) carries its parent's choice and no elder sibling carries it too (the first matching child in
index order, as `sgl_dspark.verify.verify_choices` walks it; that per-request walk is this module's oracle). Pure
torch; must not import SGLang or run the target.
"""

import torch

from sgl_dspark.layout import AcceptRows


def match_paths(tokens: torch.Tensor, parents: torch.Tensor, ancestors: torch.Tensor, sizes: torch.Tensor,
                choices: torch.Tensor, stride: int) -> AcceptRows:
    """Every request's accepted path and emitted tokens, given the target's token after each node.

    tokens [bs, w] int64 verify rows (node 0 the anchor), parents [bs, w] int64 (-1 at the root; padding nodes hang
    off the root), ancestors [bs, w, w] bool (row i True at i and its ancestors), sizes [bs] real nodes per request,
    choices [bs, w] int64 the target's token after each node -> AcceptRows (accept_index as flat rows b * w + node).

    Example: one request, tokens [5, 6, 7, 8], parents [-1, 0, 0, 1], choices [7, 8, 2, 3]: node 1 (6) is not the
    root's choice 7, node 2 (7) is; node 2's choice 2 is the bonus -> accept_index [[0, 2, -1, -1]],
    tokens [[7, 2, 0, ...]], accept_lens [2].
    """
    bs, w = tokens.shape
    device = tokens.device
    node = torch.arange(w, device=device)
    real = node[None, :] < sizes.to(device)[:, None]
    match = real & (tokens == choices.gather(1, parents.clamp_min(0)))  # [bs, w]: carries its parent's choice
    match[:, 0] = True
    elder = (parents[:, :, None] == parents[:, None, :]) & (node[None, None, :] < node[None, :, None])  # [bs, i, j]
    first = match & ~(elder & match[:, None, :]).any(-1)  # [bs, w]: the first matching child of its parent
    on_path = (first[:, None, :] | ~ancestors).all(-1)  # [bs, w]: every node from the root to it is a first match
    return _rows(tokens, on_path, choices, stride)


def _rows(tokens: torch.Tensor, on_path: torch.Tensor, choices: torch.Tensor, stride: int) -> AcceptRows:
    """tokens [bs, w], on_path [bs, w] bool (root True; ancestors before descendants) -> AcceptRows."""
    bs, w = tokens.shape
    device = tokens.device
    node = torch.arange(w, device=device)
    kept = on_path.sum(1)  # [bs] root + accepted nodes = tau (the bonus replaces the root in the count)
    path = torch.where(on_path, node, w + node).sort(1).values  # [bs, w]: kept nodes ascending, then > w
    in_path = node[None, :] < kept[:, None]
    flat = torch.arange(bs, device=device)[:, None] * w + path
    accept_index = torch.where(in_path, flat, torch.full_like(flat, -1))
    last = path.gather(1, (kept - 1)[:, None])  # [bs, 1] the deepest accepted node
    drafts = tokens.gather(1, torch.cat([path[:, 1:], path[:, :1]], 1).clamp_max(w - 1))  # [bs, w] accepted tokens
    emitted = torch.zeros(bs, stride, dtype=torch.long, device=device)
    emitted[:, :w - 1] = torch.where(node[None, 1:] < kept[:, None], drafts[:, :w - 1], 0)
    emitted.scatter_(1, (kept - 1)[:, None], choices.gather(1, last))  # the bonus after the last accepted token
    return AcceptRows(accept_index, emitted, kept.to(torch.int32))
