"""Learning per CPU-minute (issue 13): one trainer run per training idea, same data, seed and time budget; held-out
accepted length against training minutes for every idea in one plot beside the shipped drafter's curve, and each
variant's drafting time per step (batch 1, window 7), since serving speed is the goal.

    python -m benchmarks.learning --data DATA --out OUT --minutes 12            # every variant, ~13 min each
    python -m benchmarks.learning --data DATA --out OUT --variants baseline,bigram
    python -m benchmarks.learning --out OUT --report-only                       # table and plot from OUT

Each variant trains into OUT/<variant> with `python -m sgl_dspark.training.trainer`; a rerun resumes an unfinished
variant and skips a finished one (OUT/<variant>/done.json). Writes OUT/learning.json, learning.md and learning.png.
A benchmark, not a test: the curves depend on the data, the budget and the machine's load. Compare variants of one
run only, at equal minutes.
"""

import argparse
import json
import subprocess
import sys
from pathlib import Path

if __package__ in (None, ""):  # run as a script: make `benchmarks` importable
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch

from benchmarks.drafting import make_input, time_case
from sgl_dspark.drafter import DraftKnobs, Proposer
from sgl_dspark.drafter.factory import random_drafter
from sgl_dspark.training.export import read_curve

SHIPPED = Path(__file__).resolve().parents[1] / "sgl_dspark" / "drafters" / "smollm2-135m-instruct"
# name -> trainer flags on top of the common ones (the baseline is the shipped drafter's recipe: preset small, zero
# Markov init, cosine schedule, no complement, top-32 targets).
VARIANTS = {
    "baseline": (),
    "bigram": ("--markov-init", "bigram"),
    "depth1": ("--preset", "small-1layer"),
    "constant-lr": ("--lr-schedule", "constant"),
    "complement": ("--complement", "0.5"),
    "topk8": ("--top-k", "8"),
}
DONE = "done.json"
WINDOW = 7


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m benchmarks.learning", description=__doc__.splitlines()[0])
    p.add_argument("--data", help="folder from `python -m sgl_dspark.training.data build` (not with --report-only)")
    p.add_argument("--out", required=True, help="one folder per variant, plus learning.json/.md/.png")
    p.add_argument("--minutes", type=float, default=12.0, help="training budget of each variant")
    p.add_argument("--variants", default=",".join(VARIANTS), help=f"comma-separated, of {', '.join(VARIANTS)}")
    p.add_argument("--eval-every-min", type=float, default=2.0)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--eval-records", type=int, default=12, help="held-out records per source in each evaluation")
    p.add_argument("--target", default=None, help="target HF folder (default: the prepared default model)")
    p.add_argument("--report-only", action="store_true", help="no training: table and plot from OUT")
    a = p.parse_args(argv)
    unknown = sorted(set(a.variants.split(",")) - set(VARIANTS))
    if unknown:
        p.error(f"unknown variant(s) {unknown}; known: {', '.join(VARIANTS)}")
    if not a.report_only and not a.data:
        p.error("--data is required unless --report-only")
    return a


def train_variant(name: str, a: argparse.Namespace) -> None:
    run = Path(a.out) / name
    if (run / DONE).is_file():
        print(f"{name}: done before, skipped")
        return
    cmd = [sys.executable, "-m", "sgl_dspark.training.trainer", "--data", a.data, "--out", str(run),
           "--minutes", str(a.minutes), "--eval-every-min", str(a.eval_every_min), "--seed", str(a.seed),
           "--bf16", "--cache-features", "--eval-records", str(a.eval_records),  # the shipped run's recipe
           *(("--target", a.target) if a.target else ()), *VARIANTS[name]]
    print(f"{name}: {' '.join(cmd[2:])}", flush=True)
    subprocess.run(cmd, check=True)
    (run / DONE).write_text(json.dumps({"flags": list(VARIANTS[name]), "draft_ms": draft_ms(run / "checkpoint")})
                            + "\n")


def draft_ms(checkpoint: Path, repeats: int = 15) -> float:
    """Median ms of one drafting call (batch 1, window 7, 256 context tokens) of a drafter shaped as `checkpoint`:
    the time depends on the shape, not on the weights."""
    drafter, _ = random_drafter(json.loads((checkpoint / "config.json").read_text()))
    window = min(WINDOW, drafter.config.gamma)
    knobs = DraftKnobs(max_window=window, min_window=window)
    with torch.no_grad():
        return time_case(Proposer(drafter.eval(), knobs), make_input(drafter, 1, 256, 0.0), repeats, 3)["median_ms"]


def tau_at(curve: list[dict], minutes: float) -> float | None:
    """tau of the last evaluation at or before `minutes` (None if none was)."""
    before = [r["tau"] for r in curve if r["minutes"] <= minutes + 1e-6]
    return before[-1] if before else None


def report(out: Path, names: list[str]) -> dict:
    """learning.json / .md / .png from the variants' run folders (those that have a curve)."""
    shipped = read_curve(SHIPPED)
    rows = []
    for name in names:
        run = out / name
        if not (run / "curve.jsonl").is_file():
            continue
        curve = read_curve(run)
        done = json.loads((run / DONE).read_text()) if (run / DONE).is_file() else {}
        last = curve[-1]
        rows.append({"variant": name, "flags": " ".join(VARIANTS[name]), "minutes": last["minutes"],
                     "steps": last["step"], "tau": last["tau"],
                     "tau_hybrid": last.get("tau_hybrid"), "shipped_tau_same_minutes": tau_at(shipped, last["minutes"]),
                     "draft_ms": done.get("draft_ms"), "curve": curve})
    doc = {"shipped": {"path": SHIPPED.name, "curve": shipped}, "variants": rows}
    (out / "learning.json").write_text(json.dumps(doc, indent=1) + "\n")
    (out / "learning.md").write_text(markdown(rows))
    plot(rows, shipped, out / "learning.png")
    return doc


def markdown(rows: list[dict]) -> str:
    lines = ["| variant | trainer flags | minutes | steps | held-out tau | tau with the lookup chain | "
             "shipped run's tau at those minutes | draft ms / step (batch 1, window 7) |",
             "|---|---|---:|---:|---:|---:|---:|---:|"]
    for r in rows:
        ship = "-" if r["shipped_tau_same_minutes"] is None else f"{r['shipped_tau_same_minutes']:.3f}"
        ms = "-" if r["draft_ms"] is None else f"{r['draft_ms']:.1f}"
        hybrid = "-" if r["tau_hybrid"] is None else f"{r['tau_hybrid']:.3f}"
        lines.append(f"| {r['variant']} | `{r['flags'] or '(none)'}` | {r['minutes']:.1f} | {r['steps']} | "
                     f"{r['tau']:.3f} | {hybrid} | {ship} | {ms} |")
    return "\n".join(lines) + "\n"


def plot(rows: list[dict], shipped: list[dict], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4.5))
    horizon = max((r["minutes"] for r in rows), default=60.0)
    ship = [p for p in shipped if p["minutes"] <= 1.5 * horizon]
    ax.plot([p["minutes"] for p in ship], [p["tau"] for p in ship], "k--", marker="x", label="shipped drafter's run")
    for r in rows:
        ax.plot([p["minutes"] for p in r["curve"]], [p["tau"] for p in r["curve"]], marker="o", label=r["variant"])
    ax.set_xlabel("training minutes (this CPU, 2 cores)")
    ax.set_ylabel("held-out accepted length tau (greedy, window 7)")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def main(argv: list[str] | None = None) -> int:
    a = parse_args(argv)
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    names = a.variants.split(",")
    if not a.report_only:
        for name in names:
            train_variant(name, a)
    doc = report(out, names)
    print(markdown(doc["variants"]))
    print(f"wrote {out / 'learning.json'}, learning.md, learning.png")
    return 0


if __name__ == "__main__":
    sys.exit(main())
