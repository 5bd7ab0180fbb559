"""Batched acceptance: every request's accepted path and emitted tokens in one pass of tensor ops over the step's
verify rows, on the logits' device, with no loop over requests and no host sync.

Owns two rules, each the batched form of a per-request walk in `sgl_dspark.verify` (their oracle, tested draw for
draw): the match rule (greedy and seeded requests: a node is accepted when every node on its path from the root,
itself included, carries its parent's choice and no elder sibling carries it too, the first matching child in index
order, as `verify_choices` walks it), and speculative sampling (`verify_sampling` fed with the same coins): of chains
in one pass, of trees (lookup siblings: recursive rejection over a node's children) depth by depth. Pure torch;
must not import SGLang or run the target.
"""

import torch

from sgl_dspark.layout import AcceptRows
from sgl_dspark.verify import normalized, residual


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
    return path_rows(tokens, matched_path(tokens, parents, ancestors, sizes, choices), choices, stride)


def matched_path(tokens: torch.Tensor, parents: torch.Tensor, ancestors: torch.Tensor, sizes: torch.Tensor,
                 choices: torch.Tensor) -> torch.Tensor:
    """As `match_paths` -> on_path [bs, w] bool: the root and the accepted nodes."""
    w = tokens.shape[1]
    node = torch.arange(w, device=tokens.device)
    real = node[None, :] < sizes.to(tokens.device)[:, None]
    match = real & (tokens == choices.gather(1, parents.clamp_min(0)))  # [bs, w]: carries its parent's choice
    match[:, 0] = True
    elder = (parents[:, :, None] == parents[:, None, :]) & (node[None, None, :] < node[None, :, None])  # [bs, i, j]
    first = match & ~(elder & match[:, None, :]).any(-1)  # [bs, w]: the first matching child of its parent
    return (first[:, None, :] | ~ancestors).all(-1)  # [bs, w]: every node from the root to it is a first match


def sample_chains(tokens: torch.Tensor, sizes: torch.Tensor, probs: torch.Tensor, draft_probs: torch.Tensor,
                  coins: torch.Tensor, bonus_coins: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Speculative sampling of k chains at once (the chain case of `sgl_dspark.verify.verify_sampling`, same rule).

    tokens [k, w] (node 0 the anchor), sizes [k] real nodes, probs [k, w, V] the target's distribution after each
    node, draft_probs [k, w, V] the distribution each node's token was drawn from (row 0 unused), coins [k, w] and
    bonus_coins [k] independent U(0, 1) draws (float64) -> (on_path [k, w] bool, bonus [k] int64).
    Node i is accepted when every node before it was and coins[i] * q_i(x_i) < p_{i-1}(x_i); after the first
    rejection, at node i, the bonus is drawn from normalize(max(0, p_{i-1} - q_i)), else from the last node's p; the
    draw is the inverse CDF at bonus_coins. Rows are renormalised in float64, as the per-request verifier does.
    Example: p after the root (.5, .5), chain [a, 0] with q = (1, 0), coin .7: .7 * 1 < .5 fails, node 1 is
    rejected, the residual is (0, 1) and the bonus is token 1 whatever its coin.
    """
    w = tokens.shape[1]
    p, q = normalized(probs), normalized(draft_probs)
    drafted = tokens[:, 1:, None]
    p_x = p[:, :-1].gather(-1, drafted)[..., 0]  # [k, w - 1]: p after node i - 1 at node i's token
    q_x = q[:, 1:].gather(-1, drafted)[..., 0]
    real = torch.arange(1, w, device=tokens.device)[None, :] < sizes.to(tokens.device)[:, None]
    ok = real & (q_x > 0) & (coins[:, 1:] * q_x < p_x)
    kept = ok.long().cumprod(1)  # [k, w - 1]: accepted, with every node before it
    on_path = torch.cat([torch.ones(kept.shape[0], 1, dtype=torch.long, device=kept.device), kept], 1).bool()
    last = kept.sum(1)  # [k] the last accepted node (0: the root)
    rows = torch.arange(tokens.shape[0], device=tokens.device)
    after = p[rows, last]  # [k, V]
    rejected = (last + 1 < sizes.to(tokens.device))[:, None]  # a real node after the last accepted was tried
    law = torch.where(rejected, residual(after, q[rows, (last + 1).clamp_max(w - 1)]), after)
    return on_path, inverse_cdf(law, bonus_coins)


def sample_trees(tokens: torch.Tensor, parents: torch.Tensor, sizes: torch.Tensor, probs: torch.Tensor,
                 draft_probs: torch.Tensor, coins: torch.Tensor, bonus_coins: torch.Tensor, depth: int,
                 fanout: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Speculative sampling of k trees at once (`sgl_dspark.verify.verify_sampling`, same rule: at each node on the
    path its children are tried in index order, child c accepted when coin * q_c(x_c) < p(x_c), p replaced by
    normalize(max(0, p - q_c)) after each rejection; the bonus is drawn from the p left when no child is accepted).

    tokens, parents [k, w] (-1 at the root; padding nodes are not real: sizes [k]), probs [k, w, V] the target's
    distribution after each node, draft_probs [k, w, V] each node's draft distribution (one-hot for a deterministic
    candidate), coins [k, w] (a request's i-th acceptance test reads coins[:, i + 1], as a chain's node i + 1 does
    in `sample_chains`), bonus_coins [k]; depth, fanout: bounds on the real nodes' depth and children per node (the
    loop counts, known on the host) -> (on_path [k, w] bool, bonus [k] int64). Loops over depth and sibling rank,
    never over requests, and reads nothing back to the host.
    Example: p after the root (.5, .5), children [a (token 0, q one-hot), b (token 1, q one-hot)], coin .7 for a:
    .7 < .5 fails, p becomes (0, 1), b is accepted whatever its coin (u * 1 < 1).
    """
    k, w = tokens.shape
    device = tokens.device
    p_all, q_all = normalized(probs), normalized(draft_probs)
    rows, node = torch.arange(k, device=device), torch.arange(w, device=device)
    real = node[None, :] < sizes.to(device)[:, None]
    on_path = node[None, :].expand(k, w) == 0
    cur = torch.zeros(k, dtype=torch.long, device=device)
    live = torch.ones(k, dtype=torch.bool, device=device)  # the walk goes on (its last test accepted a child)
    tests = torch.zeros(k, dtype=torch.long, device=device)  # acceptance tests made so far, per request
    p = p_all[:, 0]
    for _ in range(depth):
        kids = real & live[:, None] & (parents == cur[:, None])  # [k, w] the current node's children
        rank = kids.long().cumsum(1) - 1
        child = torch.full((k,), -1, dtype=torch.long, device=device)
        for r in range(fanout):
            at = kids & (rank == r)
            tried = at.any(1) & (child < 0)
            c = at.long().argmax(1)  # [k] the r-th child (0 where there is none)
            q = q_all[rows, c]
            x = tokens[rows, c][:, None]
            q_x = q.gather(1, x)[:, 0]
            ok = tried & (q_x > 0) & (coins.gather(1, (tests + 1).clamp_max(w - 1)[:, None])[:, 0] * q_x
                                      < p.gather(1, x)[:, 0])
            child = torch.where(ok, c, child)
            p = torch.where((tried & ~ok)[:, None], residual(p, q), p)
            tests = tests + tried.long()
        live = child >= 0
        cur = torch.where(live, child, cur)
        on_path = on_path | ((node[None, :] == cur[:, None]) & live[:, None])
        p = torch.where(live[:, None], p_all[rows, cur], p)
    return on_path, inverse_cdf(p, bonus_coins)


def inverse_cdf(law: torch.Tensor, coins: torch.Tensor) -> torch.Tensor:
    """law [k, V] (rows summing to 1), coins [k] in [0, 1) -> [k] int64: the first token whose cumulative mass
    exceeds coin * total (never a token of mass 0). Example: law [[.2, 0, .8]], coin .5 -> [2]."""
    cdf = law.cumsum(-1)
    return torch.searchsorted(cdf, (coins[:, None] * cdf[:, -1:]).contiguous(), right=True)[:, 0].clamp_max(
        law.shape[-1] - 1)


def path_rows(tokens: torch.Tensor, on_path: torch.Tensor, choices: torch.Tensor, stride: int) -> AcceptRows:
    """tokens [bs, w], on_path [bs, w] bool (root True; ancestors before descendants), choices [bs, w] (the bonus
    is the choice at the last node on the path) -> AcceptRows."""
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
