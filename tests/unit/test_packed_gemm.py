"""oneDNN packed-weight linear layers: equal to nn.Linear up to float rounding, the drafter drafts the same blocks
with them, and only wide float linear layers are swapped; a weight's rows read from its packed copy are its rows."""

import pytest
import torch
from torch import nn
from torch.nn import functional as F

from sgl_dspark.drafter import Proposer, ProposeInput, pad_contexts
from fixture_drafters import tiny_hf_config
from sgl_dspark.drafter.fresh import random_drafter
from sgl_dspark.cost import StepCostTable
from sgl_dspark.drafter.model import TargetWeights
from sgl_dspark.packed_gemm import (MAX_KERNEL_ROWS, PAD_ABOVE, KernelTimes, PackedLinear, onednn_available,
                                   pack_drafter, packed_linear, packed_rows, pack, row_bucket, row_splits, time_kernels)

pytestmark = pytest.mark.skipif(not onednn_available(), reason="this torch build has no oneDNN")


@pytest.mark.parametrize("rows", [1, 3, 8, 17, 33, 100])  # 2 x 100 = 200 rows: the kernel runs on two parts
def test_packed_linear_equals_linear(rows):
    torch.manual_seed(rows)
    linear = nn.Linear(48, 96).requires_grad_(False)
    x = torch.randn(2, rows, 48)  # leading dims are kept
    want = linear(x)
    got = PackedLinear(linear)(x)
    assert got.shape == (2, rows, 96)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(packed_linear(x[0], pack(linear.weight)), x[0] @ linear.weight.T, rtol=1e-5, atol=1e-5)


def test_a_rows_product_does_not_depend_on_the_rows_beside_it():
    """oneDNN's packed product gives a row the same bits whether it is alone or one of up to 16 (docs/serving.md:
    a verify row gets the logits a one-row step on the same kernels gives it; benchmarks/greedy_identity.py)."""
    torch.manual_seed(0)
    weight, x = torch.randn(960, 576) * 0.05, torch.randn(16, 576)
    packed = pack(weight)
    alone = torch.cat([packed_linear(x[i:i + 1], packed) for i in range(16)])
    for rows in (2, 3, 4, 8, 16):
        assert torch.equal(packed_linear(x[:rows], packed), alone[:rows]), rows


@pytest.mark.parametrize("rows", [1, 64, 65, 127, 128, 129, 200, 4096])
def test_row_splits_cover_the_rows_in_near_equal_parts_under_the_cap(rows):
    parts = row_splits(rows)
    assert sum(parts) == rows and max(parts) <= MAX_KERNEL_ROWS and max(parts) - min(parts) <= 1
    assert len(parts) == -(-rows // MAX_KERNEL_ROWS)  # the fewest parts, so none is smaller than it must be


def test_kernel_calls_meet_few_row_counts_above_the_small_ones():
    """Up to PAD_ABOVE rows a call runs as it is; above, padded to few counts (each a kernel oneDNN keeps)."""
    counts = {row_bucket(part) for rows in range(1, 1000) for part in row_splits(rows)}
    assert {c for c in counts if c <= PAD_ABOVE} == set(range(1, PAD_ABOVE + 1))
    assert len(counts) - PAD_ABOVE <= 12 and max(counts) <= MAX_KERNEL_ROWS
    assert all(rows <= row_bucket(rows) < rows + 8 for rows in range(1, MAX_KERNEL_ROWS + 1))


def test_padded_calls_return_their_own_rows_products():
    """A call padded to its bucket returns exactly the rows it was given, each the product the bucket's kernel
    gives it beside any other rows (the padding rows are zeros and are dropped)."""
    torch.manual_seed(1)
    weight = torch.randn(96, 48)
    packed, x = pack(weight), torch.randn(PAD_ABOVE + 3, 48)
    got = packed_linear(x, packed)
    assert got.shape == (PAD_ABOVE + 3, 96) and row_bucket(PAD_ABOVE + 3) > PAD_ABOVE + 3
    beside = packed_linear(torch.cat([x, torch.randn(row_bucket(PAD_ABOVE + 3) - x.shape[0], 48)]), packed)
    assert torch.equal(got, beside[:x.shape[0]])
    torch.testing.assert_close(got, x @ weight.T, rtol=1e-5, atol=1e-5)


def drafter_and_input(**overrides):
    cfg = tiny_hf_config(hidden_size=64, intermediate_size=128, head_dim=16, num_attention_heads=4,
                         num_key_value_heads=4, markov_rank=16, **overrides)
    drafter, _ = random_drafter(cfg)
    lens = [6, 9]
    ctxs = [drafter.context_kv(torch.randn(n, 128, generator=torch.Generator().manual_seed(n)), torch.arange(n))
            for n in lens]
    return drafter, ProposeInput(pad_contexts(ctxs), torch.tensor([3, 7]), torch.tensor(lens), (),
                                 torch.Generator().manual_seed(0))


def test_packed_drafter_drafts_the_same_blocks():
    drafter, inp = drafter_and_input()
    hidden = drafter.block_hidden(inp.context, inp.anchors, inp.anchor_positions)
    want = Proposer(drafter).propose(inp).trees
    base = drafter.base_logits(hidden[0])
    count = pack_drafter(drafter)
    assert count > 0 and not any(type(m) is nn.Linear and m.out_features >= 64 for m in drafter.modules())
    torch.testing.assert_close(drafter.base_logits(hidden[0]), base, rtol=1e-5, atol=1e-5)
    got = Proposer(drafter).propose(inp).trees
    for a, b in zip(got, want):
        assert a.tokens.tolist() == b.tokens.tolist() and a.parents.tolist() == b.parents.tolist()
        torch.testing.assert_close(a.confidence, b.confidence, rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("rows,dtype", [(1000, torch.float32), (1000, torch.bfloat16), (80, torch.float32)])
def test_packed_rows_are_the_weights_rows(rows, dtype):
    """The packed copy pads the rows to whole blocks (1000 and 80 are not whole blocks of 64 or 32); lookups of any
    shape are F.embedding's, bit for bit."""
    g = torch.Generator().manual_seed(rows)
    weight = torch.randn(rows, 64, generator=g).to(dtype)
    table = packed_rows(weight, pack(weight))
    assert table is not None and table.shape == weight.shape and table.dtype == dtype
    ids = torch.randint(0, rows, (3, 5), generator=g)
    assert torch.equal(table[ids], F.embedding(ids, weight))
    assert torch.equal(table[torch.arange(rows)], weight)


def test_packed_rows_refuse_a_copy_that_is_not_the_weights():
    weight = torch.randn(1000, 64, generator=torch.Generator().manual_seed(0))
    packed = pack(weight)
    other = weight.clone()
    other[999, 63] += 1  # the last element only
    assert packed_rows(other, packed) is None
    assert packed_rows(weight, weight) is None  # not a packed tensor
    assert packed_rows(weight.bfloat16(), packed) is None
    assert packed_rows(weight, packed) is not None


def test_a_drafter_borrowing_the_packed_heads_rows_drafts_the_same_blocks():
    """The server's drafter looks its input rows up in the target's packed LM head (its table released)."""
    for reduced in (True, False):
        drafter, inp = drafter_and_input(draft_vocab_size=20 if reduced else None)
        want = Proposer(drafter).propose(inp).trees
        tables = [packed_rows(w, pack(w)) for w in (drafter.target.embed, drafter.target.lm_head)]
        assert None not in tables
        drafter.attach_target(TargetWeights(*tables))
        got = Proposer(drafter).propose(inp).trees
        for a, b in zip(got, want):
            assert a.tokens.tolist() == b.tokens.tolist() and torch.equal(a.confidence, b.confidence)


def test_narrow_layers_stay_plain():
    drafter, _ = drafter_and_input()
    pack_drafter(drafter)
    assert type(drafter.confidence_head.proj) is nn.Linear  # one output: nothing to gain


def test_kernel_times_time_each_kernel_at_each_row_count():
    weights = [torch.randn(256, 64), torch.randn(128, 256)]
    times = time_kernels([(w, pack(w)) for w in weights], rows=(1, 8), repeats=2)
    assert times.plain.tokens == (1, 8) == times.packed.tokens
    assert all(s > 0 for s in times.plain.seconds + times.packed.seconds)
    literal = KernelTimes(StepCostTable((1, 4), (0.05, 0.08)), StepCostTable((1, 4), (0.04, 0.045)))
    assert literal.saved(1) == pytest.approx(0.01) and literal.saved(4) == pytest.approx(0.035)
    assert literal.scaled(2.0).saved(4) == pytest.approx(0.07)
    assert literal.describe() == "rows 1/4: plain 50.0/80.0 ms, packed 40.0/45.0 ms"
