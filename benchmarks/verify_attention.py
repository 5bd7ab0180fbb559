"""Verify attention benchmark: the CPU backend's attention (attention_backends.paged, what DSPARK's verify forward
runs: per request, its keys and values gathered from the paged cache, then one SDPA) at the default model's
attention shape (9 query heads, 3 KV heads, dim 64, float32) over a verify batch like a server's at concurrency 1, 4
and 16 (context 200-700 keys on shuffled slots, 1-4 verify rows a request), and the gathers alone two ways: advanced
indexing (`k_rows[slots]`, as SGLang's torch_native backend gathers and this backend did) and torch.index_select
(what it does now; the same values). One layer, median and min/max over repeats, the kernels alternating. A
benchmark, not a test: numbers depend on the machine.

    OMP_NUM_THREADS=1 python -m benchmarks.verify_attention
"""

import argparse
import json
import random
import statistics
import sys
import time
from pathlib import Path

import torch

if __package__ in (None, ""):
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from attention_backends.paged import PagedTreeBatch, paged_tree_attention  # noqa: E402

Q_HEADS, KV_HEADS, DIM, SLOTS = 9, 3, 64, 16384  # the default model's heads; a pool of 16k slots


def verify_batch(requests: int, seed: int) -> PagedTreeBatch:
    """`requests` requests with a random context and 1-4 chain rows each, on shuffled slots (as a busy pool's)."""
    rng = random.Random(seed)
    free = list(range(SLOTS))
    rng.shuffle(free)
    slots, masks = [], []
    for _ in range(requests):
        rows, context = rng.choice((1, 2, 4)), rng.randint(200, 700)
        n = context + rows
        slots.append(torch.tensor([free.pop() for _ in range(n)]))
        mask = torch.ones(rows, n, dtype=torch.bool)
        for r in range(rows):
            mask[r, context + r + 1:] = False  # a chain: each row sees the context, the rows before it and itself
        masks.append(mask)
    return PagedTreeBatch.from_token_slots(slots, masks)


def gather_by_indexing(k_rows: torch.Tensor, v_rows: torch.Tensor, batch: PagedTreeBatch) -> None:
    """Every request's keys and values gathered by advanced indexing (`k_rows[slots]`: the backend before)."""
    for slots in batch.kv_slots:
        k_rows[slots], v_rows[slots]


def gather_by_index_select(k_rows: torch.Tensor, v_rows: torch.Tensor, batch: PagedTreeBatch) -> None:
    """The same gathers by torch.index_select (the backend now)."""
    for slots in batch.kv_slots:
        torch.index_select(k_rows, 0, slots), torch.index_select(v_rows, 0, slots)


def time_ms(fn) -> float:
    start = time.perf_counter()
    fn()
    return (time.perf_counter() - start) * 1000


def measure(requests: int, repeats: int) -> dict:
    torch.manual_seed(requests)
    batch = verify_batch(requests, requests)
    k_cache, v_cache = torch.randn(SLOTS, KV_HEADS, DIM), torch.randn(SLOTS, KV_HEADS, DIM)
    q = torch.randn(int(batch.qo_indptr[-1]), Q_HEADS, DIM)
    kernels = {  # name -> one layer's work
        "gather_indexing": lambda: gather_by_indexing(k_cache, v_cache, batch),
        "gather_index_select": lambda: gather_by_index_select(k_cache, v_cache, batch),
        "attention": lambda: paged_tree_attention(q, k_cache, v_cache, batch, DIM ** -0.5),
    }
    times = {name: [] for name in kernels}
    for _ in range(repeats):
        for name, kernel in kernels.items():
            times[name].append(time_ms(kernel))
    return {"requests": requests, "rows": int(batch.qo_indptr[-1]), "keys": sum(batch.kv_lens),
            **{f"{k}_ms": {"median": statistics.median(v), "min": min(v), "max": max(v)} for k, v in times.items()}}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--requests", type=lambda s: [int(x) for x in s.split(",")], default=[1, 4, 16])
    ap.add_argument("--repeats", type=int, default=50)
    ap.add_argument("--out", type=Path, default=None, help="write the results as JSON here")
    args = ap.parse_args(argv)
    results = [measure(n, args.repeats) for n in args.requests]
    for r in results:
        cells = ", ".join(f"{name} {t['median']:.3f} ms [{t['min']:.3f}-{t['max']:.3f}]"
                          for name, t in ((k.removesuffix("_ms"), v) for k, v in r.items() if k.endswith("_ms")))
        print(f"{r['requests']:3d} requests, {r['rows']:3d} rows, {r['keys']:6d} keys, one layer: {cells}")
    if args.out is not None:
        args.out.write_text(json.dumps({"threads": torch.get_num_threads(), "results": results}, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
