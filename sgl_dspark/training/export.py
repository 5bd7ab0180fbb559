"""`python -m sgl_dspark.training.export`: a training run folder -> a shippable drafter folder with its model card.

Casts the checkpoint's floating weights (bf16 by default, to fit the repo), copies the calibration, and writes
README.md (the model card: training command, data recipe, time, tau curve table) plus curve.png, and what
`trainer --init-from` continues from: curve.jsonl and training_state.json (steps and minutes so far). Owns only the
packaging; the numbers come from the run's own files (run.json, curve.jsonl, the data manifest).
"""

import argparse
import json
import shutil
import sys
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

from sgl_dspark import cli
from sgl_dspark.drafter.checkpoint import CONFIG_FILE, WEIGHTS_FILE, compress_weights, read_drafter_config

CARD_FILE = "README.md"
STATE_FILE = "training_state.json"  # {"steps", "minutes"} of all training so far: `trainer --init-from` reads it
CURVE_PNG = "curve.png"


def read_curve(run: Path) -> list[dict]:
    rows = [json.loads(line) for line in (run / "curve.jsonl").read_text().splitlines() if line.strip()]
    unique = {}
    for row in rows:  # the final evaluation may repeat the last periodic one
        unique[(row["step"], row["minutes"])] = row
    return sorted(unique.values(), key=lambda r: r["minutes"])


def cast_weights(src: Path, dst: Path, dtype: torch.dtype) -> None:
    tensors = load_file(str(src / WEIGHTS_FILE))
    tensors = {k: v.to(dtype) if v.is_floating_point() else v for k, v in tensors.items()}
    save_file({k: v.contiguous() for k, v in tensors.items()}, str(dst / WEIGHTS_FILE), metadata={"format": "pt"})


def plot_curve(curve: list[dict], out: Path, reference: dict[str, list[tuple[float, float, float]]]) -> None:
    """Two panels: tau against training minutes and against optimizer steps (machine load changes the first)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 2, figsize=(10, 4), sharey=True)
    for ax, x_key, x_label in ((axes[0], "minutes", "training minutes (this CPU, 2 cores)"),
                               (axes[1], "step", "optimizer steps")):
        for key in sorted(k for k in curve[-1] if k.startswith("tau")):
            ax.plot([r[x_key] for r in curve], [r.get(key) for r in curve], marker="o", label=f"this run: {key}")
        for label, points in reference.items():
            col = 0 if x_key == "minutes" else 1
            ax.plot([p[col] for p in points], [p[2] for p in points], linestyle="--", marker="x", label=label)
        ax.set_xlabel(x_label)
        ax.grid(alpha=0.3)
    axes[0].set_ylabel("accepted length tau (held out, greedy, window 7)")
    axes[1].legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(out, dpi=120)
    plt.close(fig)


# Measured earlier on the same target (../shared/reference/drafter-training-cpu.md): random-init 2-layer drafter,
# (minutes, steps at its 1.09 s/step, tau); its evaluation drafted on greedy continuations of held-out prompts.
RANDOM_INIT_CURVE = [(m, round(m * 60 / 1.09), t) for m, t in
                     ((0.0, 1.027), (3.0, 1.15), (6.0, 1.23), (12.0, 1.28), (18.0, 1.34), (23.0, 1.34))]


def placeholders(spec: dict) -> dict[str, str]:
    """The run's machine-specific paths -> the placeholders a model card writes instead (longest first)."""
    names = {"target": "TARGET", "data": "DATA", "out": "RUN"}
    found = {str(spec[k]): v for k, v in names.items() if spec.get(k)}
    return dict(sorted(found.items(), key=lambda kv: -len(kv[0])))


def redact(text: str, mapping: dict[str, str]) -> str:
    """Replace each machine path by its placeholder. Example: ("--data /x/d --out /x/r", {"/x/d": "DATA"}) ->
    "--data DATA --out /x/r"."""
    for path, name in mapping.items():
        text = text.replace(path, name)
    return text


def curve_table(curve: list[dict]) -> list[str]:
    """The tau curve as markdown rows: overall, with the lookup chain, per source (every source any row has)."""
    sources = sorted({k for r in curve for k in r if k.startswith("tau_") and k != "tau_hybrid"})
    head = ["minutes", "step", "tau", "tau_hybrid", *sources, "P(k accepted given < k), k = 1..7"]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for r in curve:
        cells = [f"{r['minutes']:.1f}", str(r["step"])]
        cells += ["-" if r.get(k) is None else f"{r[k]:.3f}" for k in ("tau", "tau_hybrid", *sources)]
        cells.append(" ".join("-" if c is None else f"{c:.2f}" for c in r["cond_accept"]))
        lines.append("| " + " | ".join(cells) + " |")
    return lines


def card(run: Path, data_manifest: dict, curve: list[dict], size_mb: float, command: str, notes: str) -> str:
    spec = json.loads((run / "run.json").read_text())
    return redact(_card(run, spec, data_manifest, curve, size_mb, command, notes), placeholders(spec))


def _card(run: Path, spec: dict, data_manifest: dict, curve: list[dict], size_mb: float, command: str,
          notes: str) -> str:
    last = curve[-1]
    lines = [
        f"# DSpark drafter for {Path(str(spec.get('target', 'the target'))).name} (trained on CPU)",
        "",
        "A DSpark drafter (published DeepSpec format: `config.json` + `model.safetensors`, shipped xz-compressed as",
        "`model.safetensors.xz`: the plugin reads either; `xz -dk` gives the plain file). Paths in the commands",
        "below are placeholders: TARGET (the target model folder), DATA (the data folder), RUN (the training run",
        "folder), DRAFTER (this folder). Serve it with",
        "`--speculative-algorithm DSPARK --speculative-draft-model-path DRAFTER`.",
        "",
        "## Shape",
        f"Preset `{spec['preset']}`: draft layers copied from the target's top layers, features of target layers",
        f"{list(read_drafter_config(run / 'checkpoint').target_layer_ids)}, reduced draft vocabulary,",
        f"vanilla Markov head, confidence head. Weights stored in bf16: {size_mb:.1f} MB compressed.",
        "",
        "## Training",
        "```",
        command,
        "```",
        f"Run spec: `{json.dumps(spec)}`",
        "",
        f"Time: {last['minutes']:.1f} CPU-minutes of training steps ({last['step']} steps) on 2 shared CPU cores.",
        "",
        "## Data recipe",
        "```",
        json.dumps(data_manifest, indent=2),
        "```",
        "Questions (ShareGPT first user turns, code instructions and function-completion problems made from the",
        "standard library's documented functions, templated math problems; the recipe's counts) answered greedily",
        "by the target through the real SGLang server, plus raw Python standard-library source (teacher-forced).",
        "The evaluation sets in ../shared/data/eval were never used for training.",
        "",
        "## Held-out accepted length (tau) against training time",
        "Teacher-forced blocks at every 4th anchor of held-out records; tau = 1 + leading draft tokens equal to the",
        "target's greedy tokens (window 7, lookup off); tau_hybrid: with the lookup chain beside the drafter's.",
        "Random-init reference: the facts file's curve.",
        "",
        *curve_table(curve),
    ]
    lines += ["", f"![tau curve]({CURVE_PNG})", ""]
    if notes:
        lines += ["## Notes", notes.strip(), ""]
    cal = run / "checkpoint" / "calibration.json"
    if cal.is_file():
        lines += ["## Calibration", "`python -m sgl_dspark.training.calibrate` fitted a temperature (and, since",
                  "2026-12-01, a bias) per draft position on held-out rollouts (`calibration.json`, read by the server",
                  "from this folder):", "```", cal.read_text().strip(), "```", ""]
        if (cal.parent / "reliability.png").is_file():
            lines += ["![reliability before and after](reliability.png)", ""]
    return "\n".join(lines)


def export(run: Path, data: Path, out: Path, dtype: torch.dtype, command: str, notes: str = "") -> Path:
    src = run / "checkpoint"
    if not (src / CONFIG_FILE).is_file():
        raise ValueError(f"{run} has no checkpoint/{CONFIG_FILE} "
                         "(is it a `python -m sgl_dspark.training.trainer` run folder?)")
    out.mkdir(parents=True, exist_ok=True)
    shutil.copy(src / CONFIG_FILE, out / CONFIG_FILE)
    for name in ("calibration.json", "reliability.png"):
        if (src / name).is_file():
            shutil.copy(src / name, out / name)
    cast_weights(src, out, dtype)
    weights = compress_weights(out)  # shipped compressed (sgl_dspark.drafter.checkpoint)
    curve = read_curve(run)
    shutil.copy(run / "curve.jsonl", out / "curve.jsonl")  # what `trainer --init-from` continues (small)
    (out / STATE_FILE).write_text(json.dumps({"steps": curve[-1]["step"], "minutes": curve[-1]["minutes"]}) + "\n")
    manifest = json.loads((data / "manifest.json").read_text())
    size_mb = weights.stat().st_size / 2**20
    plot_curve(curve, out / CURVE_PNG, {"random init (facts file)": RANDOM_INIT_CURVE})
    (out / CARD_FILE).write_text(card(run, manifest, curve, size_mb, command, notes) + "\n")
    return out


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m sgl_dspark.training.export", description=__doc__.splitlines()[0])
    p.add_argument("--run", required=True, type=Path, help="`python -m sgl_dspark.training.trainer --out` folder")
    p.add_argument("--data", required=True, type=Path, help="the data folder the run trained on")
    p.add_argument("--out", required=True, type=Path)
    p.add_argument("--dtype", choices=["bfloat16", "float32"], default="bfloat16")
    p.add_argument("--command", default="", help="the training command, quoted in the model card")
    p.add_argument("--notes", type=Path, default=None, help="a markdown file appended to the card as its notes")
    a = p.parse_args(argv)

    def body() -> None:
        notes = a.notes.read_text() if a.notes else ""
        print(export(a.run, a.data, a.out, getattr(torch, a.dtype), a.command, notes))

    return cli.run("sgl_dspark.training.export", body)


if __name__ == "__main__":
    sys.exit(main())
