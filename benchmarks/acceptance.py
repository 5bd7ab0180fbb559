"""Acceptance benchmark: DSPARK against SGLang's builtin NGRAM on the evaluation prompt sets, on the real server.

For each DSPARK variant (lookup on/off) and NGRAM one server is started (float32; CPU flags from
sgl_dspark.tools.launch), the first user turn of N prompts per set in ../shared/data/eval (spread evenly over each
file) is chat-templated and sent to /generate at each temperature, and the replies' meta_info plus the worker's
step trace (the `trace` knob) are aggregated by benchmarks.acceptance_report. Writes one JSON file and PNG plots; the
markdown table is rendered from the JSON. A benchmark, not a test: numbers depend on the drafter and machine.

    python benchmarks/acceptance.py --prompts 8 --max-new-tokens 128 --temperatures 0 1 --out benchmarks/results
    python benchmarks/acceptance.py --from-json benchmarks/results/acceptance.json --markdown --readme docs/results.md
"""

import argparse
import json
import math
import platform
import sys
import tempfile
import time
from collections import defaultdict
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, dataclass
from pathlib import Path

if __package__ in (None, ""):  # run as a script: make `benchmarks` importable
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import requests
from tqdm import tqdm

from benchmarks.acceptance_report import markdown_table, outcome_of, splice_table, summarize
from scheduler_patch.backends import TORCH_BACKEND
from sgl_dspark.tools.launch import ServerSpec, free_port, has_cuda, serving
from sgl_dspark.tools.models import default_drafter, prepare
from sgl_dspark.trace import StepTrace, read_trace

EVAL_DIR = Path(__file__).resolve().parents[2] / "shared" / "data" / "eval"  # ../shared beside the repo
SETS = ("gsm8k", "math500", "humaneval", "mbpp", "mt-bench", "spec-bench")


@dataclass(frozen=True)
class Prompt:
    set_name: str
    index: int  # line in the set's file
    text: str  # chat-templated first user turn


@dataclass(frozen=True)
class Variant:
    """One server configuration."""

    algorithm: str  # DSPARK or NGRAM
    lookup: bool | None  # DSPARK's lookup knob (None for NGRAM)

    @property
    def name(self) -> str:
        return self.algorithm if self.lookup is None else f"{self.algorithm}-lookup-{'on' if self.lookup else 'off'}"


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--prompts", type=int, default=8, help="prompts per set")
    p.add_argument("--max-new-tokens", type=int, default=128)
    p.add_argument("--temperatures", type=float, nargs="+", default=[0.0])
    p.add_argument("--sets", nargs="+", default=list(SETS), choices=SETS)
    p.add_argument("--lookup", nargs="+", default=["on"], choices=["on", "off"], help="DSPARK lookup variants to run")
    p.add_argument("--no-ngram", action="store_true", help="skip the NGRAM baseline")
    p.add_argument("--drafter", default=None, help="drafter folder (default: sgl_dspark.tools.models.default_drafter)")
    p.add_argument("--dspark-args", nargs="*", action="extend", default=[],
                   help="more --speculative-dspark-* flags, each given as --dspark-args=--FLAG=VALUE (repeatable)")
    p.add_argument("--concurrency", type=int, default=4, help="requests in flight (also the server's batch limit)")
    p.add_argument("--eval-dir", type=Path, default=EVAL_DIR)
    p.add_argument("--out", type=Path, default=Path("benchmarks/results"), help="folder for acceptance.json + PNGs")
    p.add_argument("--from-json", type=Path, help="skip the run: render from this report JSON")
    p.add_argument("--markdown", action="store_true", help="print the markdown table")
    p.add_argument("--readme", type=Path, help="replace the table between the acceptance-table markers in this file "
                   "(docs/results.md)")
    return p.parse_args(argv)


# -- prompts -----------------------------------------------------------------------------------------------------

def spread(n_items: int, n: int) -> list[int]:
    """n line indices spread evenly over a file of n_items lines (all of them when n >= n_items)."""
    n = min(n, n_items)
    return [i * n_items // n for i in range(n)]


def load_prompts(eval_dir: Path, sets: list[str], n: int, tokenizer) -> list[Prompt]:
    prompts = []
    for name in sets:
        lines = (eval_dir / f"{name}.jsonl").read_text().splitlines()
        for i in spread(len(lines), n):
            turn = json.loads(lines[i])["turns"][0]
            text = tokenizer.apply_chat_template([{"role": "user", "content": turn}], tokenize=False,
                                                 add_generation_prompt=True)
            prompts.append(Prompt(name, i, text))
    return prompts


# -- one server run ----------------------------------------------------------------------------------------------

# Every request drafts every step: accepted length measures the drafter and the scheduler. With the gate on (the
# serving default) steps it predicts will not pay draft nothing, and tau would measure the gate's choices instead.
GATE_OFF = ("--speculative-dspark-gate", "false")


def server_flags(variant: Variant, drafter: str, trace: Path, extra: list[str]) -> tuple[str, ...]:
    if variant.algorithm == "NGRAM":
        return ("--speculative-algorithm", "NGRAM", *(() if has_cuda() else ("--attention-backend", TORCH_BACKEND)))
    return ("--speculative-algorithm", "DSPARK", "--speculative-draft-model-path", drafter,
            "--speculative-dspark-lookup", str(variant.lookup).lower(), "--speculative-dspark-trace", str(trace),
            *GATE_OFF, *extra)


def request_id(variant: Variant, prompt: Prompt, temperature: float) -> str:
    return f"{variant.name}:{prompt.set_name}:{prompt.index}:T{temperature:g}"


def generate(base_url: str, rid: str, text: str, temperature: float, max_new_tokens: int) -> dict:
    reply = requests.post(f"{base_url}/generate", timeout=3600, json={
        "rid": rid, "text": text,
        "sampling_params": {"temperature": temperature, "max_new_tokens": max_new_tokens}})
    reply.raise_for_status()
    return reply.json()["meta_info"]


def run_variant(variant: Variant, prompts: list[Prompt], args: argparse.Namespace, model: str,
                drafter: str, log_dir: Path) -> dict[str, dict]:
    """Start the server, send every (prompt, temperature), stop it -> {rid: meta_info}; traces under log_dir."""
    trace = log_dir / f"trace-{variant.name}.jsonl"
    trace.unlink(missing_ok=True)
    spec = ServerSpec(model, port=free_port(), max_running_requests=args.concurrency,
                      speculative_args=server_flags(variant, drafter, trace, args.dspark_args))
    jobs = [(request_id(variant, p, t), p.text, t) for t in args.temperatures for p in prompts]
    metas: dict[str, dict] = {}
    with serving(spec, log_dir) as server, ThreadPoolExecutor(args.concurrency) as pool:
        bar = tqdm(total=len(jobs), desc=variant.name, unit="req")
        futures = {pool.submit(generate, server.base_url, rid, text, t, args.max_new_tokens): rid
                   for rid, text, t in jobs}
        for future, rid in futures.items():
            metas[rid] = future.result()
            bar.update(1)
        bar.close()
    return metas


def exact_sampling(variant: Variant, temperature: float) -> bool:
    """False where the server does not sample from the target: SGLang's NGRAM commits the argmax on CPU
    (eagle_utils._verify_uses_greedy), whatever the temperature."""
    return not (variant.algorithm == "NGRAM" and temperature > 0 and not has_cuda())


def report_variant(variant: Variant, prompts: list[Prompt], temperatures: list[float], metas: dict[str, dict],
                   traces: list[StepTrace]) -> list[dict]:
    """One run record per temperature, each with a SetReport per set and one over all sets."""
    by_rid: dict[str, list[StepTrace]] = defaultdict(list)
    for t in traces:
        by_rid[t.rid].append(t)
    runs = []
    for temp in temperatures:
        groups: dict[str, list[str]] = defaultdict(list)
        for p in prompts:
            groups[p.set_name].append(request_id(variant, p, temp))
        groups["all"] = [rid for rids in list(groups.values()) for rid in rids]
        sets = {name: asdict(summarize([outcome_of(metas[r]) for r in rids], [t for r in rids for t in by_rid[r]]))
                for name, rids in groups.items()}
        runs.append({"name": f"{variant.name} T={temp:g}", "algorithm": variant.algorithm,
                     "lookup": variant.lookup, "temperature": temp, "exact_sampling": exact_sampling(variant, temp),
                     "sets": sets})
    return runs


def run_all(args: argparse.Namespace) -> dict:
    from transformers import AutoTokenizer

    model = str(prepare("float32").path)
    drafter = args.drafter or default_drafter(model)
    prompts = load_prompts(args.eval_dir, args.sets, args.prompts, AutoTokenizer.from_pretrained(model))
    variants = [Variant("DSPARK", mode == "on") for mode in args.lookup]
    variants += [] if args.no_ngram else [Variant("NGRAM", None)]
    log_dir = Path(tempfile.mkdtemp(prefix="dspark-acceptance-"))
    runs, started = [], time.time()
    partial = args.out / "acceptance.partial.json"  # what a crash mid-run would otherwise lose
    args.out.mkdir(parents=True, exist_ok=True)
    for variant in variants:
        metas = run_variant(variant, prompts, args, model, drafter, log_dir)
        traces = read_trace(log_dir / f"trace-{variant.name}.jsonl")
        runs += report_variant(variant, prompts, args.temperatures, metas, traces)
        partial.write_text(json.dumps({"runs": runs}, indent=1) + "\n")
    partial.unlink(missing_ok=True)
    meta = {"model": model, "drafter": drafter, "drafter_name": Path(drafter).name, "prompts_per_set": args.prompts,
            "max_new_tokens": args.max_new_tokens, "temperatures": args.temperatures, "sets": args.sets,
            "concurrency": args.concurrency, "dspark_args": args.dspark_args, "device": "cuda" if has_cuda() else "cpu",
            "host": platform.node(), "seconds": round(time.time() - started, 1), "logs": str(log_dir),
            "date": time.strftime("%Y-%m-%d %H:%M:%S")}
    return {"meta": meta, "runs": runs}


# -- plots -------------------------------------------------------------------------------------------------------

def plot_all(doc: dict, out: Path) -> list[Path]:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    paths = [plot_tau(doc, out, plt)]
    for run in (r for r in doc["runs"] if r["algorithm"] == "DSPARK"):
        slug = run["name"].replace(" ", "-").replace("=", "")
        paths.append(plot_positions(run, out / f"positions-{slug}.png", plt))
        paths.append(plot_reliability(run, out / f"reliability-{slug}.png", plt))
    return paths


def plot_tau(doc: dict, path_dir: Path, plt) -> Path:
    names = list(doc["runs"][0]["sets"])
    fig, ax = plt.subplots(figsize=(9, 4))
    width = 0.8 / len(doc["runs"])
    for j, run in enumerate(doc["runs"]):
        values = [run["sets"][n]["tau"] or 0.0 for n in names]
        label = run["name"] + ("" if run.get("exact_sampling", True) else " (argmax on CPU)")
        ax.bar([i + j * width for i in range(len(names))], values, width, label=label)
    ax.set_xticks([i + 0.4 - width / 2 for i in range(len(names))], names)
    ax.set_ylabel("accepted length τ (bonus included)")
    ax.legend(fontsize=8, loc="upper left", bbox_to_anchor=(1.01, 1.0))
    return _save(fig, path_dir / "tau.png", plt)


def plot_positions(run: dict, path: Path, plt) -> Path:
    fig, ax = plt.subplots(figsize=(6, 4))
    for name, s in run["sets"].items():
        pos = s["positions"]
        rates = [a / n if n else math.nan for a, n in zip(pos["accepts"], pos["attempts"])]
        ax.plot(range(1, len(rates) + 1), rates, marker="o", lw=2.5 if name == "all" else 1, label=name)
    ax.set(xlabel="draft position k", ylabel="P(k accepted | < k accepted)", ylim=(0, 1.02), title=run["name"])
    ax.legend(fontsize=8)
    return _save(fig, path, plt)


def plot_reliability(run: dict, path: Path, plt) -> Path:
    fig, ax = plt.subplots(figsize=(5, 5))
    ax.plot([0, 1], [0, 1], "k--", lw=1)
    for name, s in run["sets"].items():
        rel = s["reliability"]
        points = [(c, r) for c, r in zip(rel["mean_confidence"], rel["accept_rate"]) if c is not None]
        ece = "-" if rel["ece"] is None else f"{rel['ece']:.3f}"
        ax.plot([c for c, _ in points], [r for _, r in points], marker="o", lw=2.5 if name == "all" else 1,
                label=f"{name} (ECE {ece})")
    ax.set(xlabel="survival (calibrated confidence product)", ylabel="share with positions 1..k accepted",
           xlim=(0, 1), ylim=(0, 1), title=run["name"])
    ax.legend(fontsize=7)
    return _save(fig, path, plt)


def _save(fig, path: Path, plt) -> Path:
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path


# -- entry point -------------------------------------------------------------------------------------------------

def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.from_json:
        doc = json.loads(args.from_json.read_text())
    else:
        doc = run_all(args)
        (args.out / "acceptance.json").write_text(json.dumps(doc, indent=1) + "\n")
        for path in [args.out / "acceptance.json", *plot_all(doc, args.out)]:
            print(f"wrote {path}")
    table = markdown_table(doc)
    if args.markdown:
        print(table)
    if args.readme:
        spliced = splice_table(args.readme.read_text(), table)
        if spliced is None:
            print(f"{args.readme}: no acceptance-table markers; left unchanged", file=sys.stderr)
        else:
            args.readme.write_text(spliced)
            print(f"updated the table in {args.readme}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
