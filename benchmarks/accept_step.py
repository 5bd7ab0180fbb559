"""Acceptance benchmark: the step's batched acceptance (`sgl_dspark.step.accept`, on the logits' device, one
transfer) against the per-request verifier it replaced (every verify row copied to the host in float32, then
`verify_requests` request after request), on random chains: greedy batches and sampled ones. Median and min/max of
wall-clock milliseconds per step over repeats (the device synchronised around each). A benchmark, not a test.

    python benchmarks/accept_step.py --device cuda --out benchmarks/results/accept-step-cuda.json
"""

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import torch

if __package__ in (None, ""):
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from sgl_dspark.graft import Grafted  # noqa: E402
from sgl_dspark.layout import accept_rows, pack_trees  # noqa: E402
from sgl_dspark.sampling import SamplerBatch, SamplingParams  # noqa: E402
from sgl_dspark.step import DecodeStep, StepRequest, accept  # noqa: E402
from sgl_dspark.tree import DraftTree  # noqa: E402
from sgl_dspark.verify import VerifyInput, verify_requests  # noqa: E402


def case(batch: int, width: int, vocab: int, sampled: bool, device: str, rows_on: str = "cpu", shape: str = "chain"):
    """A step of `batch` blocks of `width` rows and its verify logits on `device`: chains, or trees (node 2 a one-hot
    lookup sibling of node 1 under the root, the rest a chain under node 1); the draft-probability rows of sampled
    blocks on `rows_on` (the host, as a CPU drafter makes them, or the device, as a drafter there does)."""
    gen = torch.Generator().manual_seed(0)
    params = SamplingParams(temperature=0.8) if sampled else SamplingParams(temperature=0.0)
    trees = []
    for _ in range(batch):
        tokens = torch.randint(vocab, (width,), generator=gen)
        probs = None
        if sampled:
            probs = torch.zeros(width, vocab)
            probs[torch.arange(1, width), tokens[1:]] = 0.5
            probs[1:] += 0.5 / vocab
        parents = torch.arange(-1, width - 1)
        if shape == "tree" and width > 2:
            parents[2], parents[3:] = 0, torch.cat([torch.tensor([1]), torch.arange(3, width - 1)])
            if probs is not None:
                probs[2] = 0.0
                probs[2, tokens[2]] = 1.0
        trees.append(DraftTree(tokens, parents, torch.ones(width), None if probs is None else probs.to(rows_on)))
    seq_lens = [100] * batch
    rows = pack_trees(trees, seq_lens, width)
    step = DecodeStep([Grafted.plain(t) for t in trees], [width - 1] * batch, [True] * batch, rows, seq_lens)
    reqs = [StepRequest(f"r{b}", [1], [int(t.tokens[0])], 100, torch.arange(100), params)
            for b, t in enumerate(trees)]
    logits = torch.randn(batch * width, vocab, generator=gen).to(device)
    return step, reqs, logits, SamplerBatch.of([params] * batch)


def batched(step, reqs, logits, sampler, width: int) -> None:
    accept(step, reqs, logits, sampler, torch.Generator().manual_seed(1), width)


def per_request(step, reqs, logits, sampler, width: int) -> None:
    host = logits.float().cpu().view(len(reqs), width, -1)
    results = verify_requests([VerifyInput(g.tree, host[b], r.sampling, None, sampler)
                            for b, (g, r) in enumerate(zip(step.trees, reqs))], torch.Generator().manual_seed(1))
    accept_rows(results, width, width)


def timed(fn, args, device: str, repeats: int) -> dict:
    sync = torch.cuda.synchronize if device == "cuda" else (lambda: None)
    fn(*args)  # warm-up
    out = []
    for _ in range(repeats):
        sync()
        start = time.perf_counter()
        fn(*args)
        sync()
        out.append(1e3 * (time.perf_counter() - start))
    return {"median_ms": round(statistics.median(out), 3), "min_ms": round(min(out), 3), "max_ms": round(max(out), 3)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--batches", type=int, nargs="+", default=[1, 16, 64])
    parser.add_argument("--width", type=int, default=8)
    parser.add_argument("--vocab", type=int, default=152064)
    parser.add_argument("--repeats", type=int, default=10)
    parser.add_argument("--shape", choices=["chain", "tree"], default="chain")
    parser.add_argument("--out", type=Path)
    args = parser.parse_args()
    rows = []
    for sampled in (False, True):
        for batch in args.batches:
            step, reqs, logits, sampler = case(batch, args.width, args.vocab, sampled, args.device, shape=args.shape)
            row = {"sampling": "sampled" if sampled else "greedy", "shape": args.shape, "batch": batch,
                   "width": args.width, "vocab": args.vocab, "device": args.device, "draft_rows": "host",
                   "batched": timed(batched, (step, reqs, logits, sampler, args.width), args.device, args.repeats),
                   "per_request": timed(per_request, (step, reqs, logits, sampler, args.width), args.device,
                                        args.repeats)}
            rows.append(row)
            print(json.dumps(row), flush=True)
            if sampled and args.device != "cpu":  # the drafter on the device: its rows never cross (batched only)
                step, reqs, logits, sampler = case(batch, args.width, args.vocab, sampled, args.device, args.device,
                                                   args.shape)
                row = {**row, "draft_rows": "device", "per_request": None,
                       "batched": timed(batched, (step, reqs, logits, sampler, args.width), args.device, args.repeats)}
                rows.append(row)
                print(json.dumps(row), flush=True)
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps({"device": torch.cuda.get_device_name() if args.device == "cuda" else "cpu",
                                        "rows": rows}, indent=1) + "\n")


if __name__ == "__main__":
    main()
