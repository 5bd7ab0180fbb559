"""CPU benchmark of the drafting step: one `Proposer.propose` call (parallel pass + sequential stage) on cached context.

Random weights shaped like a drafter for the default model (SmolLM2-135M: hidden 576, vocab 49152) unless told
otherwise. Prints median and min/max over repeats per (batch size, window) and writes JSON to --out.
A benchmark, not a test: numbers depend on the machine.

    python benchmarks/drafting.py --out /tmp/drafting.json --batch-sizes 1,4,16 --windows 3,7
"""

import argparse
import json
import platform
import statistics
import time
from pathlib import Path

import torch

from sgl_dspark.drafter import DraftKnobs, Proposer, ProposeInput, pad_contexts
from sgl_dspark.drafter.fresh import DRAFTER_BASE, random_drafter
from sgl_dspark.sampling import SamplingParams


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", required=True, help="where to write the JSON results")
    p.add_argument("--batch-sizes", default="1,4,16")
    p.add_argument("--windows", default="3,7", help="fixed draft lengths to time (each <= --gamma)")
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--warmup", type=int, default=1)
    p.add_argument("--context", type=int, default=256, help="cached context tokens per request")
    p.add_argument("--temperature", type=float, default=0.0, help="0: greedy drafts; >0: sampled, with draft_probs")
    p.add_argument("--tree-width", type=int, default=1)
    p.add_argument("--hidden", type=int, default=576)
    p.add_argument("--heads", type=int, default=9)
    p.add_argument("--kv-heads", type=int, default=3)
    p.add_argument("--head-dim", type=int, default=64)
    p.add_argument("--intermediate", type=int, default=1536)
    p.add_argument("--layers", type=int, default=2)
    p.add_argument("--vocab", type=int, default=49152)
    p.add_argument("--markov-rank", type=int, default=256)
    p.add_argument("--gamma", type=int, default=7)
    p.add_argument("--threads", type=int, default=1, help="torch threads (1: stable on a shared box); 0: torch default")
    return p.parse_args()


def drafter_config(a: argparse.Namespace) -> dict:
    return dict(DRAFTER_BASE, hidden_size=a.hidden, num_attention_heads=a.heads, num_key_value_heads=a.kv_heads,
                head_dim=a.head_dim, intermediate_size=a.intermediate, num_hidden_layers=a.layers, vocab_size=a.vocab,
                rms_norm_eps=1e-6, rope_theta=10000.0, markov_rank=a.markov_rank, block_size=a.gamma,
                target_layer_ids=[1, 9, 17], num_target_layers=30, mask_token_id=a.vocab - 1)


def make_input(drafter, batch: int, context: int, temperature: float) -> ProposeInput:
    width = drafter.config.num_features * drafter.config.hidden_size
    g = torch.Generator().manual_seed(0)
    rows = drafter.context_kv(torch.randn(context, width, generator=g), torch.arange(context))
    ctx = pad_contexts([rows] * batch)
    anchors = torch.randint(0, drafter.config.vocab_size, (batch,), generator=g)
    sampling = (SamplingParams(temperature=temperature),) * batch
    return ProposeInput(ctx, anchors, torch.full((batch,), context), sampling, torch.Generator().manual_seed(1))


def time_case(proposer: Proposer, inp: ProposeInput, repeats: int, warmup: int) -> dict:
    for _ in range(warmup):
        proposer.propose(inp)
    times, out = [], None
    for _ in range(repeats):
        start = time.perf_counter()
        out = proposer.propose(inp)
        times.append((time.perf_counter() - start) * 1e3)
    return {"median_ms": statistics.median(times), "min_ms": min(times), "max_ms": max(times),
            "lm_head_rows": out.lm_head_rows, "draft_tokens": sum(out.draft_lengths)}


def main() -> None:
    a = parse_args()
    if a.threads:
        torch.set_num_threads(a.threads)
    drafter, _ = random_drafter(drafter_config(a))
    results = []
    print(f"{'batch':>5} {'window':>6} {'median ms':>10} {'min ms':>8} {'max ms':>8} {'lm rows':>7} {'tokens':>6}")
    for batch in [int(x) for x in a.batch_sizes.split(",")]:
        inp = make_input(drafter, batch, a.context, a.temperature)
        for window in [int(x) for x in a.windows.split(",")]:
            knobs = DraftKnobs(max_window=window, min_window=window, tree_width=a.tree_width,
                               branch_threshold=1.0 if a.tree_width > 1 else 0.0)
            row = {"batch": batch, "window": window, **time_case(Proposer(drafter, knobs), inp, a.repeats, a.warmup)}
            results.append(row)
            print(f"{batch:>5} {window:>6} {row['median_ms']:>10.2f} {row['min_ms']:>8.2f} {row['max_ms']:>8.2f} "
                  f"{row['lm_head_rows']:>7} {row['draft_tokens']:>6}")
    report = {"benchmark": "drafting", "device": "cpu", "threads": torch.get_num_threads(),
              "platform": platform.platform(), "torch": torch.__version__, "args": vars(a), "results": results}
    Path(a.out).write_text(json.dumps(report, indent=2) + "\n")
    print(f"wrote {a.out}")


if __name__ == "__main__":
    main()
