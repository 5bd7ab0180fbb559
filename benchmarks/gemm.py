"""CPU GEMM benchmark: one decoder layer's linear layers plus the LM head of the default model (SmolLM2-135M:
hidden 576, fused qkv 960, fused gate/up 3072, down 576, vocab 49152), fp32, at the row counts a verify step has,
through each candidate kernel: `F.linear` on the weight as SGLang keeps it (MKL, what plain SGLang runs), `x @ W^T`
on a transposed contiguous copy (MKL on the other layout), and oneDNN on packed weights (sgl_dspark.packed_gemm)
packed for no particular batch, for 1 row and for 8 rows. The kernels alternate within each repeat (the machine
drifts). Median and min/max over repeats; JSON to --out. A benchmark, not a test: numbers depend on the machine.

    python benchmarks/gemm.py --out benchmarks/results/gemm.json
"""

import argparse
import json
import platform
import statistics
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F

if __package__ in (None, ""):
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from sgl_dspark.packed_gemm import pack, packed_linear  # noqa: E402

SHAPES = ((960, 576), (576, 576), (3072, 576), (576, 1536))  # [out, in] of one layer: qkv, o, gate_up, down
LM_HEAD = (49152, 576)
# name -> (weight [out, in] -> what the kernel reads, kernel(x, prepared) -> x @ weight^T)
KERNELS = {
    "mkl": (lambda w: w, lambda x, w: F.linear(x, w)),
    "mkl_t": (lambda w: w.t().contiguous(), lambda x, wt: x @ wt),
    "onednn": (pack, packed_linear),
    "onednn_b1": (lambda w: pack(w, batch_size=1), packed_linear),
    "onednn_b8": (lambda w: pack(w, batch_size=8), packed_linear),
}


def step_ms(rows: int, layers: list[list[torch.Tensor]], head: torch.Tensor, kernel) -> float:
    """One forward's linear layers at `rows` rows: every layer's GEMMs (distinct weights, as in the model: they do
    not stay in cache), then the LM head."""
    xs = {576: torch.randn(rows, 576), 1536: torch.randn(rows, 1536)}
    start = time.perf_counter()
    for layer in layers:
        for w in layer:
            kernel(xs[1536 if w is layer[-1] else 576], w)
    kernel(xs[576], head)
    return (time.perf_counter() - start) * 1000


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", type=Path, required=True)
    p.add_argument("--rows", default="1,2,3,4,6,8,12,16,32,64")
    p.add_argument("--layers", type=int, default=30, help="decoder layers of the target")
    p.add_argument("--repeats", type=int, default=15)
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--kernels", default=",".join(KERNELS), help=f"of {', '.join(KERNELS)}")
    args = p.parse_args()
    torch.set_num_threads(args.threads)
    layers = [[torch.randn(*shape) for shape in SHAPES] for _ in range(args.layers)]
    head = torch.randn(*LM_HEAD)
    kernels = {name: ([[prepare(w) for w in layer] for layer in layers], prepare(head), kernel)
               for name, (prepare, kernel) in KERNELS.items() if name in args.kernels.split(",")}
    results = []
    for rows in (int(r) for r in args.rows.split(",")):
        times: dict[str, list[float]] = {name: [] for name in kernels}
        for repeat in range(args.repeats + 1):  # the first one warms up
            for name, (ws, lm, kernel) in kernels.items():
                ms = step_ms(rows, ws, lm, kernel)
                if repeat:
                    times[name].append(ms)
        row = {"rows": rows, **{name: {"median": statistics.median(ms), "min": min(ms), "max": max(ms)}
                                for name, ms in times.items()}}
        results.append(row)
        print(f"rows {rows:3d}: " + "  ".join(f"{name} {row[name]['median']:6.1f}" for name in kernels)
              + " ms (linear layers + LM head of one forward)", flush=True)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps({"machine": platform.processor() or platform.machine(), "threads": args.threads,
                                    "layers": args.layers, "results": results}, indent=1) + "\n")
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
