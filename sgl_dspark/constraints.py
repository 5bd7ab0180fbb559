"""What plain decoding does to a request's logits before sampling, done for every verify row of a draft tree.

Plain SGLang transforms a request's logits in this order (SamplingBatchInfo.apply_logits_bias, then the sampler):
additive penalties (frequency, presence, min_new_tokens' stop-token mask), the repetition penalty (scaling), the
grammar's vocabulary mask, the logit bias. Each depends on the tokens generated so far. A verify row predicts the
token after its tree node, so it must see the request's output plus the draft tokens on the path from the root to
that node (the root, the anchor, is already the last output token): `PathCounts` gives each row those counts
and its output length, `grammar_masks` walks the tree with the request's grammar (advance along the path, roll
back), and `additive_rows` / `scaling_rows` / `bias_row` build the tensors. Pure torch; the grammar is duck-typed
(accept_token, rollback, is_terminated, fill_vocab_mask: SGLang's BaseGrammarObject); must not import SGLang.

Bit-exactness with plain: SGLang accumulates the frequency penalty by adding the float32 penalty once per
occurrence, so `_repeated_sums` rebuilds those float32 sums the same way.
"""

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from sgl_dspark.tree import DraftTree, ancestor_mask, depths


@dataclass(frozen=True)
class Penalties:
    """A request's penalty knobs (SGLang's SamplingParams fields of the same names) and its stop tokens."""

    frequency: float = 0.0
    presence: float = 0.0
    repetition: float = 1.0
    min_new_tokens: int = 0
    stop_ids: tuple[int, ...] = ()  # masked while fewer than min_new_tokens tokens were generated

    @property
    def additive(self) -> bool:
        return self.frequency != 0.0 or self.presence != 0.0 or self.min_new_tokens > 0

    @property
    def scaling(self) -> bool:
        return self.repetition != 1.0

    @property
    def active(self) -> bool:
        return self.additive or self.scaling


@dataclass(frozen=True)
class PathCounts:
    """Per verify row of one tree: how often each token occurs in the output it continues, and that output's length."""

    counts: torch.Tensor  # [n, V] int64
    lengths: torch.Tensor  # [n] int64: output tokens before the token the row predicts

    @staticmethod
    def of(tree: DraftTree, output_ids: Sequence[int], vocab: int) -> "PathCounts":
        """The request has generated `output_ids` (its last one is the tree's root); row i continues them with the
        draft tokens of node i's ancestors below the root and node i itself.

        Example: output [5, 7], tree tokens [7, 5, 9] with parents [-1, 0, 0] -> counts of token 5: [1, 2, 1];
        lengths [2, 3, 3]."""
        base = torch.bincount(torch.as_tensor(list(output_ids), dtype=torch.long), minlength=vocab)[:vocab]
        on_path = ancestor_mask(tree.parents).long()
        on_path[:, 0] = 0  # the root is the last output token, counted in base
        counts = base.expand(tree.size, vocab).clone()
        counts.index_put_((torch.arange(tree.size).repeat_interleave(tree.size), tree.tokens.repeat(tree.size)),
                          on_path.flatten(), accumulate=True)
        return PathCounts(counts, depths(tree.parents) + len(output_ids))


def _repeated_sums(value: float, most: int) -> torch.Tensor:
    """[most + 1] float32: entry k is `value` added k times in float32, as SGLang's scatter_add accumulates it."""
    sums = np.zeros(most + 1, dtype=np.float32)
    np.add.accumulate(np.full(most, value, dtype=np.float32), out=sums[1:])
    return torch.from_numpy(sums)


def additive_rows(p: Penalties, rows: PathCounts) -> torch.Tensor:
    """[n, V] float32 added to the logits: -(frequency sum + presence) of each seen token, -inf on the stop tokens
    of rows whose output is still shorter than min_new_tokens."""
    counts = rows.counts
    out = -_repeated_sums(p.frequency, int(counts.max()))[counts]
    if p.presence != 0.0:
        out -= torch.where(counts > 0, torch.tensor(p.presence, dtype=torch.float32), torch.tensor(0.0))
    if p.min_new_tokens > 0 and p.stop_ids:
        short = (rows.lengths < p.min_new_tokens).nonzero().flatten()
        stops = torch.tensor(sorted(p.stop_ids), dtype=torch.long)
        stops = stops[stops < counts.shape[1]]
        out[short[:, None], stops[None, :]] = float("-inf")
    return out


def scaling_rows(p: Penalties, rows: PathCounts) -> torch.Tensor:
    """[n, V] float32 repetition factors: the penalty on every token seen, 1 elsewhere (applied as SGLang's
    apply_scaling_penalties: negative logits multiplied, others divided)."""
    return torch.where(rows.counts > 0, torch.tensor(p.repetition, dtype=torch.float32), torch.tensor(1.0))


def apply_scaling(logits: torch.Tensor, factors: torch.Tensor) -> None:
    """In place, the repetition penalty's rule (SGLang penaltylib.repetition_penalty)."""
    logits[:] = torch.where(logits < 0, logits * factors, logits / factors)


def bias_row(logit_bias: dict[str, float] | None, vocab: int) -> torch.Tensor | None:
    """[V] float32 from a request's logit_bias ({token id as text: bias}; the last of equal ids wins), or None."""
    if not logit_bias:
        return None
    row = torch.zeros(vocab, dtype=torch.float32)
    for key, value in {int(k): v for k, v in logit_bias.items()}.items():
        row[key] = float(value)
    return row


def allowed(mask_row: torch.Tensor, token: int) -> bool:
    """Whether a packed vocabulary bitmask row (32 tokens per int32, xgrammar's layout) allows `token`."""
    return bool((int(mask_row[token // 32]) >> (token % 32)) & 1)


def grammar_masks(grammar: Any, tree: DraftTree, masks: torch.Tensor) -> None:
    """Fill each row of `masks` ([n, words] int32, preset to allow everything) with the grammar's vocabulary mask
    after the path to that node. The grammar's state is the request's (after its last output token, the root) and
    is restored on return. A node whose token its parent's mask forbids is never accepted (the target's masked row
    gives it probability 0), so its subtree keeps the allow-all rows; so do rows after the grammar terminated."""
    kids: list[list[int]] = [[] for _ in range(tree.size)]
    for node in range(1, tree.size):
        kids[int(tree.parents[node])].append(node)
    tokens = tree.tokens.tolist()

    def visit(node: int) -> None:
        grammar.fill_vocab_mask(masks, node)
        for kid in kids[node]:
            if not allowed(masks[node], tokens[kid]):
                continue
            grammar.accept_token(tokens[kid])
            try:
                if not grammar.is_terminated():
                    visit(kid)
            finally:
                grammar.rollback(1)

    if not grammar.is_terminated():
        visit(0)
