"""The step's batched ops on a device, torch's against the Triton kernels (sgl_dspark.step_ops.time_ops: each checked
against torch first, then the median of 20 synchronised calls) on synthetic steps of 8-node trees after 1024 cached
tokens, at several batch sizes; what `choose_ops` would pick at each. A benchmark, not a test; `make gpu-check` runs
it on CUDA.

    python benchmarks/step_ops.py --device cuda --out benchmarks/results/gpu-check/step-ops.json
"""

import argparse
import json
import sys
from dataclasses import asdict
from pathlib import Path

import torch

sys.path[:0] = [str(Path(__file__).resolve().parents[1])]
from sgl_dspark.step_ops import PROBE_CONTEXT, PROBE_WIDTH, TORCH_OPS, time_ops, triton_ops  # noqa: E402


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--requests", type=int, nargs="+", default=[8, 64, 256])
    parser.add_argument("--out", type=Path)
    args = parser.parse_args()
    device = torch.device(args.device)
    rows = {n: [asdict(t) | {"chosen": t.chosen} for t in time_ops(TORCH_OPS, triton_ops(), device, n)]
            for n in args.requests}
    print(f"| requests | op | torch ms | triton ms | chosen |  ({PROBE_WIDTH}-node trees, {PROBE_CONTEXT} cached)")
    print("|---|---|---|---|---|")
    for n, timings in rows.items():
        for t in timings:
            print(f"| {n} | {t['op']} | {t['torch_ms']:.3f} | {t['triton_ms']:.3f} | {t['chosen']} |")
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps({"device": str(device), "name": torch.cuda.get_device_name(device)
                                        if device.type == "cuda" else "cpu", "timings": rows}, indent=2) + "\n")


if __name__ == "__main__":
    main()
