"""The decode step's time split and host syncs per stage, on a device, against the Llama-shaped torch target
(tests/torch_target.py: head_dim 64, 9:3 GQA, a KV cache per request) with the drafter on the same device: the step
of tests/step_harness.py with each stage timed (the device synchronised around it) and its synchronising CUDA calls
counted (`torch.cuda.set_sync_debug_mode("warn")`). The target is a test model run request by request, so its verify
time is not SGLang's; drafting, acceptance and the commit are the plugin's own. A benchmark, not a test.

    python benchmarks/step_split.py --device cuda --out benchmarks/results/gpu-check/step-split-h200.json
"""

import argparse
import json
import statistics
import sys
import time
import warnings
from collections import defaultdict
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT), str(ROOT / "tests")]

import step_harness  # noqa: E402
from torch_target import LlamaTarget  # noqa: E402

STAGES = ("draft_and_plan", "constrain", "accept")  # the step's functions the harness calls, in step order


class Stages:
    """Per stage: wall-clock ms per call and synchronising device calls per call."""

    def __init__(self, device: str) -> None:
        self.cuda = device.startswith("cuda")
        self.ms: dict[str, list[float]] = defaultdict(list)
        self.syncs: dict[str, list[int]] = defaultdict(list)

    def wrap(self, name: str, fn):
        def timed(*args, **kwargs):
            if self.cuda:
                torch.cuda.synchronize()
            with warnings.catch_warnings(record=True) as caught:
                warnings.simplefilter("always")
                if self.cuda:
                    torch.cuda.set_sync_debug_mode("warn")
                start = time.perf_counter()
                try:
                    out = fn(*args, **kwargs)
                finally:
                    if self.cuda:
                        torch.cuda.set_sync_debug_mode("default")
                if self.cuda:
                    torch.cuda.synchronize()
                self.ms[name].append(1e3 * (time.perf_counter() - start))
            self.syncs[name].append(sum("synchronizing" in str(w.message) for w in caught))
            return out

        return timed

    def summary(self) -> dict:
        return {name: {"median_ms": round(statistics.median(ms), 3), "min_ms": round(min(ms), 3),
                       "max_ms": round(max(ms), 3), "syncs_per_call": statistics.median(self.syncs[name]),
                       "calls": len(ms)} for name, ms in self.ms.items()}


def measure(device: str, preset: str, kinds, repeats: int) -> dict:
    stages = Stages(device)
    originals = {name: getattr(step_harness, name) for name in STAGES}
    for name in STAGES:
        setattr(step_harness, name, stages.wrap(name, originals[name]))
    try:
        for _ in range(repeats):
            target = LlamaTarget(device=device)
            target.verify = stages.wrap("verify (test target)", target.verify)
            target.commit = stages.wrap("commit (test target KV)", target.commit)
            step_harness.decode({"lookup": True}, preset, kinds=kinds, target=target,
                                drafter_on=target.drafter(device))
    finally:
        for name, fn in originals.items():
            setattr(step_harness, name, fn)
    return stages.summary()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--out", type=Path)
    args = parser.parse_args()
    greedy = ((step_harness.GREEDY, None),) * 3
    sampled = ((step_harness.GREEDY, None), (step_harness.SEEDED, 1234),
               (step_harness.SamplingParams(temperature=0.8), None))
    rows = []
    for preset, name, kinds in (("chain", "greedy", greedy), ("tree", "greedy", greedy),
                                ("chain", "greedy+seeded+sampled", sampled)):
        row = {"preset": preset, "requests": name, "device": args.device,
               "stages": measure(args.device, preset, kinds, args.repeats)}
        rows.append(row)
        print(json.dumps(row), flush=True)
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        device = torch.cuda.get_device_name() if args.device.startswith("cuda") else "cpu"
        args.out.write_text(json.dumps({"device": device, "rows": rows}, indent=1) + "\n")


if __name__ == "__main__":
    main()
