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
import math
import subprocess
import sys
from pathlib import Path

if __package__ in (None, ""):  # run as a script: make `benchmarks` importable
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch

from benchmarks.drafting import make_input, time_case
from sgl_dspark.drafter import DraftKnobs, Proposer
from sgl_dspark.drafter.fresh import random_drafter
from sgl_dspark.training.export import read_curve

SHIPPED = Path(__file__).resolve().parents[1] / "sgl_dspark" / "drafters" / "smollm2-135m-instruct"
# name -> trainer flags on top of the common ones (the baseline is the shipped drafter's recipe: preset small, zero
# Markov init, cosine schedule, no complement, top-32 targets; bigram init won and is the trainer's default since,
# so the common flags pin zero and the bigram variant overrides it: the later flag wins).
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
# the neural-alone targets, read against the held-out sources nearest the evaluation sets
TARGETS = {"tau_code": 2.0, "tau_sharegpt": 1.7}
TREND_POINTS = 5  # evaluations at the end of the shipped curve that the trend is fitted to


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
           "--markov-init", "zero",
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


def log_trend(points: list[tuple[float, float]]) -> tuple[float, float]:
    """Least-squares fit of tau = a + b ln(minutes) -> (a, b); b ln 2 is the gain per doubling of training time."""
    if len({m for m, _ in points}) < 2:
        raise ValueError("log_trend: needs two evaluations at different minutes")
    xs = [math.log(m) for m, _ in points]
    ys = [t for _, t in points]
    mx, my = sum(xs) / len(xs), sum(ys) / len(ys)
    sxx = sum((x - mx) ** 2 for x in xs)
    b = sum((x - mx) * (y - my) for x, y in zip(xs, ys)) / sxx
    return my - b * mx, b


def trend(curve: list[dict], key: str, target: float, points: int = TREND_POINTS) -> dict | None:
    """The shipped run's trend in `key` over its last `points` evaluations that carry it: gain per doubling of the
    minutes, and the minutes at which the fitted line reaches `target` (None if it does not rise)."""
    tail = [(r["minutes"], r[key]) for r in curve if r.get(key) is not None and r["minutes"] > 0][-points:]
    if len(tail) < 2:
        return None
    a, b = log_trend(tail)
    reach = math.exp((target - a) / b) if b > 0 else None
    return {"key": key, "target": target, "from_minutes": tail[0][0], "to_minutes": tail[-1][0], "last": tail[-1][1],
            "gain_per_doubling": b * math.log(2), "minutes_to_target": reach}


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
    trends = [t for key, goal in TARGETS.items() if (t := trend(shipped, key, goal)) is not None]
    doc = {"shipped": {"path": SHIPPED.name, "curve": shipped, "trends": trends}, "variants": rows}
    (out / "learning.json").write_text(json.dumps(doc, indent=1) + "\n")
    (out / "learning.md").write_text(markdown(rows) + trend_markdown(trends))
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


def trend_markdown(trends: list[dict]) -> str:
    if not trends:
        return ""
    lines = ["", f"The shipped drafter's run, fitted tau = a + b ln(minutes) over its last {TREND_POINTS} evaluations "
             "(offline held-out tau, lookup off; served tau also depends on the verify budget):", "",
             "| held-out source | minutes fitted | last tau | gain per doubling of minutes | target | "
             "minutes at which the fit reaches it |", "|---|---|---:|---:|---:|---:|"]
    for t in trends:
        reach = "not rising" if t["minutes_to_target"] is None else f"{t['minutes_to_target']:.0f}"
        lines.append(f"| {t['key'].removeprefix('tau_')} | {t['from_minutes']:.0f}-{t['to_minutes']:.0f} | "
                     f"{t['last']:.3f} | {t['gain_per_doubling']:+.3f} | {t['target']:.1f} | {reach} |")
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
    report(out, names)
    print((out / "learning.md").read_text())
    print(f"wrote {out / 'learning.json'}, learning.md, learning.png")
    return 0


if __name__ == "__main__":
    sys.exit(main())
