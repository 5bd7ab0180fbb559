"""Plain decoding's logit transforms per verify row (sgl_dspark.constraints): each row of a draft tree gets exactly
what plain decoding would apply after generating the path to that node, bit for bit."""

import torch

from sgl_dspark.constraints import (Penalties, PathCounts, _repeated_sums, additive_rows, allowed, apply_scaling,
                                    bias_row, grammar_masks, scaling_rows)
from sgl_dspark.tree import DraftTree

V = 11
#   0(anchor 3) -> 1(tok 4) -> 3(tok 4) -> 4(tok 5)
#               -> 2(tok 3)
TREE = DraftTree(torch.tensor([3, 4, 3, 4, 5]), torch.tensor([-1, 0, 0, 1, 3]), torch.ones(5))
PATHS = [[], [4], [3], [4, 4], [4, 4, 5]]  # draft tokens generated before each row's prediction
OUTPUT = [7, 3, 9, 3]  # the request's output so far; its last token is the anchor


def plain_transform(logits: torch.Tensor, output: list[int], p: Penalties) -> torch.Tensor:
    """SGLang's non-speculative path, step by step: the penalizers cumulate one output token per decode step
    (scatter_add / scatter), the additive sum is built from zeros, then the scaling penalty is applied."""
    freq, pres, rep = torch.zeros(1, V), torch.zeros(1, V), torch.ones(1, V)
    for token in output:
        index = torch.tensor([[token]])
        freq.scatter_add_(1, index, torch.full((1, 1), p.frequency))
        pres.scatter_(1, index, torch.full((1, 1), p.presence))
        rep.scatter_(1, index, torch.full((1, 1), p.repetition))
    stops = torch.zeros(1, V)
    stops[0, list(p.stop_ids)] = float("-inf")
    additive = torch.zeros(1, V)
    additive.sub_(freq)
    additive.add_(torch.where(torch.tensor(len(output) < p.min_new_tokens), stops, 0.0))
    additive.sub_(pres)
    out = logits.clone()[None]
    out.add_(additive)
    out[:] = torch.where(out < 0, out * rep, out / rep)
    return out[0]


def rows_transform(logits: torch.Tensor, p: Penalties) -> torch.Tensor:
    counts = PathCounts.of(TREE, OUTPUT, V)
    out = logits.clone()
    out += additive_rows(p, counts)
    apply_scaling(out, scaling_rows(p, counts))
    return out


def test_path_counts_count_the_output_and_the_draft_path():
    counts = PathCounts.of(TREE, OUTPUT, V)
    assert counts.counts[:, 3].tolist() == [2, 2, 3, 2, 2]
    assert counts.counts[:, 4].tolist() == [0, 1, 0, 2, 2]
    assert counts.counts[:, 5].tolist() == [0, 0, 0, 0, 1]
    assert counts.lengths.tolist() == [4, 5, 5, 6, 7]
    example = PathCounts.of(DraftTree(torch.tensor([7, 5, 9]), torch.tensor([-1, 0, 0]), torch.ones(3)), [5, 7], V)
    assert example.counts[:, 5].tolist() == [1, 2, 1] and example.lengths.tolist() == [2, 3, 3]


def test_repeated_sums_are_float32_running_sums():
    value, running, sums = 0.1, torch.zeros(1), _repeated_sums(0.1, 40)
    for k in range(1, 41):
        running += torch.tensor([value], dtype=torch.float32)
        assert sums[k].item() == running.item()
    assert sums[30].item() != torch.tensor(30 * 0.1, dtype=torch.float32).item()  # not the product


def test_each_row_gets_plain_decodings_penalties_bit_for_bit():
    logits = torch.randn(TREE.size, V, generator=torch.Generator().manual_seed(0)) * 3
    for p in [Penalties(frequency=0.1), Penalties(presence=0.7), Penalties(repetition=1.3),
              Penalties(frequency=0.3, presence=-0.2, repetition=0.8),
              Penalties(frequency=0.1, min_new_tokens=6, stop_ids=(2, 5)),
              Penalties(repetition=1.1, min_new_tokens=7, stop_ids=(3,))]:
        got = rows_transform(logits, p)
        for i, path in enumerate(PATHS):
            want = plain_transform(logits[i], OUTPUT + path, p)
            assert torch.equal(got[i], want), (p, i)


def test_min_new_tokens_masks_stop_tokens_by_each_rows_own_length():
    p = Penalties(min_new_tokens=6, stop_ids=(2, 5, 99))  # an id past the vocabulary is ignored
    out = additive_rows(p, PathCounts.of(TREE, OUTPUT, V))
    masked = torch.isinf(out[:, 2]).tolist()
    assert masked == [True, True, True, False, False]  # output lengths 4, 5, 5, 6, 7
    assert torch.isinf(out[:, 5]).tolist() == masked and not torch.isinf(out[:, [0, 1, 3, 4]]).any()


def test_inactive_penalties_change_nothing():
    p = Penalties()
    assert not p.active
    logits = torch.randn(TREE.size, V)
    assert torch.equal(rows_transform(logits, p), logits)


def test_bias_row_last_equal_id_wins_and_none_without_bias():
    row = bias_row({"3": 1.5, "03": -2.0, "7": 0.25}, V)
    assert row[3].item() == -2.0 and row[7].item() == 0.25 and int((row != 0).sum()) == 2
    assert bias_row(None, V) is None and bias_row({}, V) is None


class CountingGrammar:
    """A grammar over tokens 0..V-1: after token t it allows only t+1 and t+2; token 9 terminates. Keeps its
    accepted tokens on a stack (accept_token / rollback), as xgrammar's matcher does."""

    def __init__(self, last: int):
        self.stack = [last]

    def accept_token(self, token: int) -> None:
        if token not in self.next():
            raise ValueError(f"token {token} not allowed")
        self.stack.append(token)

    def rollback(self, k: int) -> None:
        del self.stack[-k:]

    def is_terminated(self) -> bool:
        return self.stack[-1] == 9

    def next(self) -> set[int]:
        return {self.stack[-1] + 1, self.stack[-1] + 2}

    def fill_vocab_mask(self, masks: torch.Tensor, row: int) -> None:
        masks[row] = 0
        for t in self.next():
            masks[row, t // 32] |= 1 << (t % 32)


def words_mask(rows: int) -> torch.Tensor:
    return torch.full((rows, 1), -1, dtype=torch.int32)


def test_grammar_masks_follow_each_path_and_restore_the_state():
    # root 3 -> 4 -> 5 -> 7 ; root -> 5 ; root -> 6 (forbidden) -> 7 ; 4 -> 8 (forbidden)
    tree = DraftTree(torch.tensor([3, 4, 5, 5, 7, 6, 7, 8]), torch.tensor([-1, 0, 0, 1, 3, 0, 5, 1]), torch.ones(8))
    grammar, masks = CountingGrammar(3), words_mask(8)
    grammar_masks(grammar, tree, masks)
    allowed_sets = [{t for t in range(V) if allowed(masks[i], t)} for i in range(8)]
    assert allowed_sets[:5] == [{4, 5}, {5, 6}, {6, 7}, {6, 7}, {8, 9}]
    assert allowed_sets[5] == allowed_sets[6] == allowed_sets[7] == set(range(V))  # never accepted: allow-all
    assert grammar.stack == [3]


def test_grammar_masks_stop_below_a_terminating_token():
    tree = DraftTree(torch.tensor([7, 9, 10]), torch.tensor([-1, 0, 1]), torch.ones(3))
    grammar, masks = CountingGrammar(7), words_mask(3)
    grammar_masks(grammar, tree, masks)
    assert {t for t in range(V) if allowed(masks[0], t)} == {8, 9}
    assert {t for t in range(V) if allowed(masks[2], t)} == set(range(V))  # after termination: left as it was
    assert grammar.stack == [7]


def test_allowed_reads_the_sign_bit_word():
    row = torch.tensor([-2 ** 31, 1], dtype=torch.int32)  # bit 31 of word 0, bit 0 of word 1
    assert allowed(row, 31) and allowed(row, 32) and not allowed(row, 30)
