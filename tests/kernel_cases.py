"""Cases for the step's Triton kernels (sgl_dspark.step_kernels) against their torch twins, on any device: random
packed steps (trees of random shapes in a width that is not a power of two, tokens from a tiny vocabulary so that
walks go deep and siblings share tokens, contexts over several of the mask kernel's column blocks). Used by
tests/unit/test_step_kernels.py (Triton's interpreter, CPU) and tests/gpu/test_step_kernels_cuda.py (CUDA)."""

import sys
from dataclasses import dataclass
from pathlib import Path

import torch

sys.path[:0] = [str(Path(__file__).resolve().parents[1])]  # run as a script: the repository's packages
from sgl_dspark.graft import Grafted  # noqa: E402
from sgl_dspark.layout import VerifyRows, pack_trees  # noqa: E402
from sgl_dspark.sampling import SamplerBatch, SamplingParams  # noqa: E402
from sgl_dspark.step import DecodeStep, StepRequest, accept  # noqa: E402
from sgl_dspark.step_ops import TORCH_OPS, StepOps, same, triton_ops, warm  # noqa: E402
from sgl_dspark.tree import DraftTree, random_parents  # noqa: E402

VOCAB = 3  # tiny: children often carry their parent's choice, and siblings often share a token


@dataclass(frozen=True)
class PackedCase:
    rows: VerifyRows  # host tensors
    seq_lens: list[int]
    choices: torch.Tensor  # [bs, width] the target's token after each node

    def on(self, device: torch.device) -> tuple[torch.Tensor, ...]:
        """(tokens [bs, w], parents [bs, w], ancestors [bs, w, w], sizes [bs], choices [bs, w]) on `device`."""
        w = self.rows.width
        return (self.rows.tokens.view(-1, w).to(device), self.rows.parents.to(device), self.rows.mask.to(device),
                self.rows.sizes.to(device), self.choices.to(device))


def random_tree(n: int, gen: torch.Generator) -> DraftTree:
    """n nodes in topological order; a third of the trees are chains."""
    if torch.rand(1, generator=gen) < 1 / 3:
        parents = list(range(-1, n - 1))
    else:
        parents = random_parents(n, gen)
    return DraftTree(torch.randint(0, VOCAB, (n,), generator=gen), torch.tensor(parents), torch.ones(n))


def random_case(gen: torch.Generator, max_bs: int = 12, max_width: int = 11, max_seq: int = 300) -> PackedCase:
    bs = int(torch.randint(1, max_bs + 1, (1,), generator=gen))
    width = int(torch.randint(1, max_width + 1, (1,), generator=gen))
    trees = [random_tree(int(torch.randint(1, width + 1, (1,), generator=gen)), gen) for _ in range(bs)]
    seq_lens = torch.randint(0, max_seq + 1, (bs,), generator=gen).tolist()
    rows = pack_trees(trees, seq_lens, width)
    return PackedCase(rows, seq_lens, torch.randint(0, VOCAB, (bs, width), generator=gen))


def literal_case() -> PackedCase:
    """acceptance.match_paths' docstring example: tokens [5, 6, 7, 8], parents [-1, 0, 0, 1], choices [7, 8, 2, 3]
    -> accept_index [[0, 2, -1, -1]], tokens [[7, 2, 0, ...]], accept_lens [2]."""
    tree = DraftTree(torch.tensor([5, 6, 7, 8]), torch.tensor([-1, 0, 0, 1]), torch.ones(4))
    return PackedCase(pack_trees([tree], [3], 4), [3], torch.tensor([[7, 8, 2, 3]]))


def mixed_step(gen: torch.Generator) -> tuple[DecodeStep, list[StepRequest], SamplerBatch, torch.Tensor]:
    """A greedy tree, a sampled chain, a sampled tree and a seeded chain in one step, with random logits
    [bs * width, V]."""
    vocab, width = 6, 4
    q = torch.softmax(torch.randn(3, vocab, generator=gen), -1)
    no_draw = torch.zeros(1, vocab)
    shapes = [([1, 2, 3, 4], [-1, 0, 0, 1], None), ([2, 4, 1], [-1, 0, 1], torch.cat([no_draw, q[:2]])),
              ([3, 0, 5], [-1, 0, 0], torch.cat([no_draw, q[1:]])), ([0, 5], [-1, 0], torch.cat([no_draw, q[:1]]))]
    trees = [DraftTree(torch.tensor(t), torch.tensor(p), torch.ones(len(t)), d) for t, p, d in shapes]
    params = [SamplingParams(temperature=0.0), SamplingParams(temperature=0.8), SamplingParams(temperature=1.0),
              SamplingParams(temperature=0.7)]
    lens = [5, 7, 9, 3]
    step = DecodeStep([Grafted.plain(t) for t in trees], [t.size - 1 for t in trees], [True] * 4,
                      pack_trees(trees, lens, width), lens)
    reqs = [StepRequest(f"r{b}", [1], [t.tokens[0]], n, torch.arange(n), p, s)
            for b, (t, p, s, n) in enumerate(zip(trees, params, [None, None, None, 11], lens))]
    return step, reqs, SamplerBatch.of(params), torch.randn(4 * width, vocab, generator=gen) * 2


def check_literal(ops: StepOps, device: torch.device) -> None:
    tokens, parents, ancestors, sizes, choices = literal_case().on(device)
    on_path = ops.matched_path(tokens, parents, ancestors, sizes, choices)
    assert on_path.tolist() == [[True, False, True, False]], on_path
    rows = ops.path_rows(tokens, on_path, choices, 6)
    assert rows.accept_index.tolist() == [[0, 2, -1, -1]], rows
    assert rows.tokens.tolist() == [[7, 2, 0, 0, 0, 0]] and rows.accept_lens.tolist() == [2], rows


def check_random(ops: StepOps, device: torch.device, cases: int) -> None:
    """Each op equals torch's on `cases` random steps, whose greedy paths reach two drafts and more."""
    gen = torch.Generator().manual_seed(0)
    deep = 0
    for i in range(cases):
        case = random_case(gen)
        tokens, parents, ancestors, sizes, choices = case.on(device)
        want = TORCH_OPS.matched_path(tokens, parents, ancestors, sizes, choices)
        assert same(ops.matched_path(tokens, parents, ancestors, sizes, choices), want, device), i
        deep += int((want.sum(1) > 2).sum())
        stride = case.rows.width + i % 3
        assert same(ops.path_rows(tokens, want, choices, stride), TORCH_OPS.path_rows(tokens, want, choices, stride),
                    device), i
        for prefix in (False, True):
            assert same(ops.verify_input(case.rows, case.seq_lens, prefix, device),
                        TORCH_OPS.verify_input(case.rows, case.seq_lens, prefix, device), device), (i, prefix)
    assert deep > cases // 4, deep


def check_accept_stage(ops: StepOps, device: torch.device, seeds: int) -> None:
    """The step's accept stage gives the same verdict with `ops` as with torch's, over seeds that both accept and
    reject."""
    gen = torch.Generator().manual_seed(2)
    taus = set()
    for seed in range(seeds):
        step, reqs, sampler, logits = mixed_step(gen)
        logits = logits.to(device)
        want = accept(step, reqs, logits.clone(), sampler, torch.Generator().manual_seed(seed), 5)
        got = accept(step, reqs, logits.clone(), sampler, torch.Generator().manual_seed(seed), 5, ops)
        assert same(got.rows, want.rows, device) and same(got.host, want.host, device), seed
        taus |= set(want.host.accept_lens.tolist())
    assert len(taus) > 1, taus


def check_decode(ops: StepOps, device: str) -> None:
    """The whole step (tests/step_harness.py: the real drafter, a table target, lookup trees, greedy and sampled
    requests) with `ops` decodes what plain decoding does."""
    from step_harness import KINDS, decode, plain_outputs

    run = decode({"lookup": True}, "tree", device=device, ops=ops)
    assert run.outputs == plain_outputs(KINDS) and run.accepted_drafts > 0, run.outputs


def main() -> None:
    """Under TRITON_INTERPRET=1 (set before Triton is imported: tests/unit/test_step_kernels.py starts this file
    so): every check on the CPU, one `ok NAME` line each."""
    device = torch.device("cpu")
    ops = triton_ops()
    check_literal(ops, device)
    print("ok literal")
    check_random(ops, device, 40)
    print("ok random")
    check_accept_stage(ops, device, 12)
    print("ok accept-stage")
    check_decode(ops, "cpu")
    print("ok decode")
    warm(ops, device, 11)  # every block size up to a width of 11 runs
    print("ok warm")


if __name__ == "__main__":
    main()
