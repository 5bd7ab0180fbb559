"""Shared GPU test cases: random trees, paged batches on random pages, tolerances, and the FlashInfer JIT
combinations tests/gpu compiles (`make gpu-check` builds them in parallel before the tests run, `warm`).

Imports neither sglang nor flashinfer at module level."""

import torch

from attention_backends.mask import with_prefix
from attention_backends.paged import PagedTreeBatch
from sgl_dspark.tree import DraftTree, ancestor_mask, random_parents

TOLERANCE = {torch.float16: 5e-3, torch.bfloat16: 3e-2}
HEAD_DIM = 128  # one head size everywhere: each (dtype, kv dtype, soft cap) costs FlashInfer a JIT build
SOFT_CAP = 30.0
# (q dtype, kv dtype, soft cap): every FlashInfer prefill module the GPU tests use
JIT_COMBOS = {
    "fp16": (torch.float16, torch.float16, 0.0),
    "bf16": (torch.bfloat16, torch.bfloat16, 0.0),
    "bf16-softcap": (torch.bfloat16, torch.bfloat16, SOFT_CAP),
    "bf16-fp8kv": (torch.bfloat16, torch.float8_e4m3fn, 0.0),
}


def random_tree(n: int, gen: torch.Generator) -> torch.Tensor:
    """bool [n, n]: the ancestor mask of a random tree."""
    return ancestor_mask(torch.tensor(random_parents(n, gen)))


def draft_tree(n: int, gen: torch.Generator) -> DraftTree:
    return DraftTree(torch.randint(0, 1000, (n,), generator=gen), torch.tensor(random_parents(n, gen)), torch.ones(n))


def random_batch(prefix_lens: list[int], draft_masks: list[torch.Tensor], page_size: int, num_pages: int,
                 gen: torch.Generator) -> tuple[PagedTreeBatch, list[list[int]]]:
    """Requests with `prefix_lens` cached keys plus their draft rows as keys, each on random distinct pages."""
    q_lens = [m.shape[0] for m in draft_masks]
    kv_lens = [p + q for p, q in zip(prefix_lens, q_lens)]
    free = torch.randperm(num_pages, generator=gen).tolist()
    pages = [[free.pop() for _ in range(-(-kv_len // page_size))] for kv_len in kv_lens]
    batch = PagedTreeBatch(
        qo_indptr=torch.tensor([0, *torch.tensor(q_lens).cumsum(0).tolist()], dtype=torch.int32),
        kv_indptr=torch.tensor([0, *torch.tensor([len(p) for p in pages]).cumsum(0).tolist()], dtype=torch.int32),
        kv_indices=torch.tensor([x for p in pages for x in p], dtype=torch.int32),
        kv_last_page_len=torch.tensor([kv - (len(p) - 1) * page_size for kv, p in zip(kv_lens, pages)],
                                      dtype=torch.int32),
        masks=tuple(with_prefix(m, p) for m, p in zip(draft_masks, prefix_lens)), page_size=page_size,
    )  # fmt: skip
    return batch, pages


def pages_needed(kv_lens: list[int], page_size: int) -> int:
    return sum(-(-n // page_size) for n in kv_lens)


def cache_shape(num_pages: int, page_size: int, kv_heads: int, dim: int = HEAD_DIM) -> tuple[int, ...]:
    """SGLang's token-major cache at page size 1, FlashInfer's NHD pages otherwise."""
    return (num_pages, kv_heads, dim) if page_size == 1 else (num_pages, page_size, kv_heads, dim)


def warm(name: str) -> None:
    """Build (or load) the FlashInfer modules of one JIT combination by running a one-request tree verify."""
    from attention_backends.flashinfer_tree import tree_attention

    q_dtype, kv_dtype, soft_cap = JIT_COMBOS[name]
    gen = torch.Generator().manual_seed(0)
    batch, _ = random_batch([5], [random_tree(3, gen)], 1, 16, gen)
    q = torch.randn(3, 4, HEAD_DIM).to("cuda", q_dtype)
    k, v = (torch.randn(16, 2, HEAD_DIM).to("cuda", kv_dtype) for _ in range(2))
    tree_attention(q, k, v, batch, HEAD_DIM**-0.5, logits_soft_cap=soft_cap)
    torch.cuda.synchronize()
