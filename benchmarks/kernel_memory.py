"""What the packed kernel's row counts cost in memory: the RSS of a process holding the default model's linear
weights packed for oneDNN (sgl_dspark.packed_gemm; 30 layers of qkv 960x576, o 576x576, gate/up 3072x576, down
576x1536, random values) after one forward's linear layers at each row count 1..N, then again, and the time of a
forward's linear layers over random row counts as a decode step at concurrency 1 (1-17 rows) and 16 (16-150) meets
them. oneDNN builds and caches one kernel per (row count, weight shape): a server that meets every row count
(prompts' lengths, verify widths) holds them all, up to its caches' capacity (oneDNN's primitive cache and ideep's,
1024 each by default). `packed_linear` calls the kernel on at most MAX_KERNEL_ROWS rows at a time and pads a call of
more than PAD_ABOVE rows to a multiple of PAD_TO, which bounds them. Settings: `default` (as served), `unpadded` (the
calls' rows as they are), `unsplit` (one kernel call per product, whatever its rows, unpadded: before both bounds),
or a number (both caches capped at it, as served otherwise). Each setting runs in a fresh process (the caches read their
capacity once), settings alternate over repeats (the machine drifts). A benchmark, not a test.

    python -m benchmarks.kernel_memory --settings default,unpadded --out benchmarks/results/kernel-memory.json
"""

import argparse
import json
import os
import random
import statistics
import subprocess
import sys
import time
from pathlib import Path

from benchmarks.gemm import SHAPES  # [out, in] of one decoder layer: qkv, o, gate_up, down

LAYERS = 30
DECODE_ROWS = {"c1": (1, 17), "c16": (16, 150)}  # rows of a decode step (1 + verified drafts per request)


def probe(max_rows: int, steps: int, unsplit: bool, unpadded: bool) -> dict:
    """In this process: RSS (MB) after packing, after every row count 1..max_rows once and again; forward ms."""
    import psutil
    import torch

    from sgl_dspark import packed_gemm
    from sgl_dspark.packed_gemm import pack, packed_linear

    if unsplit:
        packed_gemm.MAX_KERNEL_ROWS = 1 << 30
    if unsplit or unpadded:
        packed_gemm.PAD_ABOVE = 1 << 30

    torch.manual_seed(0)
    process = psutil.Process()
    weights = [pack(torch.randn(out, inp)) for _ in range(LAYERS) for out, inp in SHAPES]

    def forward(rows: int) -> None:
        inputs = {inp: torch.randn(rows, inp) for _, inp in SHAPES}
        for w, (_, inp) in zip(weights, SHAPES * LAYERS):
            packed_linear(inputs[inp], w)

    def rss() -> float:
        return process.memory_info().rss / 2**20

    out = {"packed_mb": rss()}
    for rows in range(1, max_rows + 1):
        forward(rows)
    out["all_rows_mb"] = rss()
    for rows in range(1, max_rows + 1):
        forward(rows)
    out["again_mb"] = rss()
    draw = random.Random(0)
    for name, (low, high) in DECODE_ROWS.items():
        start = time.perf_counter()
        for _ in range(steps):
            forward(draw.randint(low, high))
        out[f"{name}_forward_ms"] = (time.perf_counter() - start) / steps * 1000
    return out


def run_setting(setting: str, max_rows: int, steps: int) -> dict:
    env = dict(os.environ)
    if setting.isdigit():
        env["ONEDNN_PRIMITIVE_CACHE_CAPACITY"] = env["LRU_CACHE_CAPACITY"] = setting
    cmd = [sys.executable, "-m", "benchmarks.kernel_memory", "--probe", "--max-rows", str(max_rows),
           "--steps", str(steps), *([f"--{setting}"] if setting in ("unsplit", "unpadded") else [])]
    done = subprocess.run(cmd, env=env, capture_output=True, text=True, check=True,
                          cwd=Path(__file__).resolve().parents[1])
    return json.loads(done.stdout.strip().splitlines()[-1])


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--settings", default="default,unpadded",
                   help="of default, unpadded, unsplit, or a kernel-cache capacity")
    p.add_argument("--max-rows", type=int, default=200)
    p.add_argument("--steps", type=int, default=100, help="timed forwards per decode-like row range")
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--out", type=Path)
    p.add_argument("--probe", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--unsplit", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--unpadded", action="store_true", help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.probe:
        print(json.dumps(probe(args.max_rows, args.steps, args.unsplit, args.unpadded)))
        return 0
    settings = args.settings.split(",")
    runs: dict[str, list[dict]] = {c: [] for c in settings}
    for repeat in range(args.repeats):
        for setting in settings:
            runs[setting].append(run_setting(setting, args.max_rows, args.steps))
            print(f"repeat {repeat + 1}/{args.repeats} {setting}: {runs[setting][-1]}", flush=True)
    keys = list(runs[settings[0]][0])
    medians = {c: {k: statistics.median(r[k] for r in rs) for k in keys} for c, rs in runs.items()}
    table = render(medians, args.max_rows)
    print(table)
    if args.out:
        args.out.write_text(json.dumps({"args": {k: v for k, v in vars(args).items() if k not in ("out", "probe")},
                                        "runs": runs, "medians": medians}, indent=1, default=str) + "\n")
        args.out.with_suffix(".md").write_text(table + "\n")
    return 0


def render(medians: dict[str, dict[str, float]], max_rows: int) -> str:
    """Medians by setting -> a markdown table (RSS in MB, forward times in ms)."""
    lines = [f"| setting | RSS packed MB | after rows 1-{max_rows} | after them again | forward ms, "
             "c1-like rows | c16-like rows |", "|---|---:|---:|---:|---:|---:|"]
    lines += [f"| {c} | {m['packed_mb']:.0f} | {m['all_rows_mb']:.0f} | {m['again_mb']:.0f} | "
              f"{m['c1_forward_ms']:.1f} | {m['c16_forward_ms']:.1f} |" for c, m in medians.items()]
    return "\n".join(lines)


if __name__ == "__main__":
    sys.exit(main())
