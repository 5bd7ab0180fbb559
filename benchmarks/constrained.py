"""Constrained-request benchmark: accepted length and per-request speed of JSON-schema and regex requests against
unconstrained ones, DSPARK against plain decoding, on the real server (float32, greedy, concurrency 1).

All servers run side by side (plain, DSPARK with the flags a user types, DSPARK with the lookup branch) and only
one request is in flight at any time: every (prompt, constraint) is sent to each server in turn, rotating the
order each repeat, so machine drift hits all configurations alike; speed-ups are ratios of the same request's
tokens/s within one repeat. Greedy outputs are compared with plain's as they come (a mismatch is reported, never
hidden). Prompts: first user turns of ../shared/data/eval sets, chat-templated. Writes constrained.json (.md) and,
with --readme, the table between the constrained-table markers (docs/results.md).

    python benchmarks/constrained.py --prompts 4 --max-new-tokens 96 --repeats 2 --readme docs/results.md

Knob sweeps (the hybrid's lookup nodes, windows, thresholds) use the same harness: `--config NAME='FLAGS'`
(repeatable) replaces the two DSPARK configurations with DSPARK + the shipped drafter + FLAGS, beside plain;
`--constraints none` keeps unconstrained requests only; `--name` names the output files:

    python benchmarks/constrained.py --constraints none --name sweep-lookup \
        --config nodes4='--speculative-dspark-lookup-max-nodes 4' \
        --config nodes8='--speculative-dspark-lookup-max-nodes 8'
"""

import argparse
import json
import shlex
import statistics
import sys
import tempfile
import time
from contextlib import ExitStack
from pathlib import Path

if __package__ in (None, ""):  # run as a script: make `benchmarks` importable
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import requests
from tqdm import tqdm

from benchmarks.acceptance import EVAL_DIR, load_prompts
from benchmarks.acceptance_report import splice_table
from sgl_dspark.tools.launch import ServerSpec, free_port, serving
from sgl_dspark.tools.models import default_drafter, prepare

ANSWER = {"type": "object", "properties": {"answer": {"type": "string", "maxLength": 400},
                                           "confidence": {"type": "number"}},
          "required": ["answer", "confidence"], "additionalProperties": False}
CONSTRAINTS = {
    "none": {},
    "json_schema": {"json_schema": json.dumps(ANSWER)},
    "regex": {"regex": r"(Step [1-9]: [^\n]{1,160}\n){1,4}Answer: [0-9A-Za-z ,.$]{1,40}"},
}
MARKERS = ("<!-- constrained-table:start -->", "<!-- constrained-table:end -->")


def configs(drafter: str, extra: list[str] | None = None) -> dict[str, tuple[str, ...]]:
    """plain plus DSPARK configurations: the two flags a user types and lookup on, or each NAME=FLAGS of `extra`
    (DSPARK with the drafter and FLAGS)."""
    dspark = ("--speculative-algorithm", "DSPARK", "--speculative-draft-model-path", drafter)
    if not extra:
        return {"plain": (), "dspark": dspark, "dspark-lookup": (*dspark, "--speculative-dspark-lookup", "true")}
    out: dict[str, tuple[str, ...]] = {"plain": ()}
    for item in extra:
        name, sep, flags = item.partition("=")
        if not sep or not name or name in out:
            raise ValueError(f"--config {item!r}: expected a new NAME=FLAGS")
        out[name] = (*dspark, *shlex.split(flags))
    return out


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--prompts", type=int, default=4, help="prompts per set")
    p.add_argument("--sets", nargs="+", default=["gsm8k", "mt-bench"])
    p.add_argument("--max-new-tokens", type=int, default=96)
    p.add_argument("--repeats", type=int, default=2)
    p.add_argument("--eval-dir", type=Path, default=EVAL_DIR)
    p.add_argument("--out", type=Path, default=Path("benchmarks/results"))
    p.add_argument("--from-json", type=Path, help="skip the run: render from this JSON")
    p.add_argument("--readme", type=Path, help="replace the table between the constrained-table markers in this file "
                   "(docs/results.md)")
    p.add_argument("--config", action="append", default=[], metavar="NAME=FLAGS",
                   help="a DSPARK configuration: the shipped drafter plus FLAGS (repeatable; replaces the defaults)")
    p.add_argument("--constraints", nargs="+", choices=sorted(CONSTRAINTS), default=list(CONSTRAINTS))
    p.add_argument("--name", default="constrained", help="output file stem in --out")
    p.add_argument("--drafter", help="drafter folder (default: the shipped drafter of the default model)")
    return p.parse_args(argv)


def generate(base_url: str, text: str, constraint: dict, max_new_tokens: int) -> dict:
    started = time.perf_counter()
    reply = requests.post(f"{base_url}/generate", timeout=3600, json={
        "text": text, "sampling_params": {"temperature": 0, "max_new_tokens": max_new_tokens, **constraint}})
    reply.raise_for_status()
    body = reply.json()
    meta = body["meta_info"]
    return {"seconds": time.perf_counter() - started, "tokens": meta["completion_tokens"],
            "steps": meta.get("spec_verify_ct", 0), "output_ids": body["output_ids"]}


def run(args: argparse.Namespace) -> dict:
    from transformers import AutoTokenizer

    model = str(prepare("float32").path)
    drafter = args.drafter or default_drafter(model)
    prompts = load_prompts(args.eval_dir, args.sets, args.prompts, AutoTokenizer.from_pretrained(model))
    flags = configs(drafter, args.config)
    records, log_dir = [], Path(tempfile.mkdtemp(prefix="dspark-constrained-"))
    with ExitStack() as stack:
        servers = {name: stack.enter_context(serving(ServerSpec(model, port=free_port(), max_running_requests=1,
                                                                speculative_args=f), log_dir))
                   for name, f in flags.items()}
        for server in servers.values():  # compile each server's grammar cache and warm its kernels
            for constraint in args.constraints:
                generate(server.base_url, prompts[0].text, CONSTRAINTS[constraint], 8)
        jobs = [(r, p, c) for r in range(args.repeats) for p in prompts for c in args.constraints]
        for r, prompt, constraint in tqdm(jobs, desc="requests", unit="prompt"):
            names = list(servers)
            shift = (r + len(records)) % len(names)
            for name in names[shift:] + names[:shift]:
                out = generate(servers[name].base_url, prompt.text, CONSTRAINTS[constraint], args.max_new_tokens)
                records.append({"repeat": r, "set": prompt.set_name, "index": prompt.index,
                                "constraint": constraint, "config": name, **out})
    return {"meta": {"model": model, "drafter": Path(drafter).name, "prompts_per_set": args.prompts,
                     "sets": args.sets, "max_new_tokens": args.max_new_tokens, "repeats": args.repeats,
                     "configs": {name: list(f) for name, f in flags.items()},
                     "date": time.strftime("%Y-%m-%d %H:%M:%S")}, "records": records}


def summary(doc: dict) -> list[dict]:
    """One row per (constraint, config): accepted length, median tokens/s, median speed-up over plain (same request
    and repeat) with its min-max, and how many greedy outputs equal plain's."""
    recs = doc["records"]
    plain = {(r["repeat"], r["set"], r["index"], r["constraint"]): r for r in recs if r["config"] == "plain"}
    rows = []
    for constraint in dict.fromkeys(r["constraint"] for r in recs):
        for config in dict.fromkeys(r["config"] for r in recs):
            mine = [r for r in recs if r["constraint"] == constraint and r["config"] == config]
            base = [plain[(r["repeat"], r["set"], r["index"], constraint)] for r in mine]
            speed = [(r["tokens"] / r["seconds"]) / (b["tokens"] / b["seconds"]) for r, b in zip(mine, base)]
            steps = sum(r["steps"] for r in mine)
            rows.append({"constraint": constraint, "config": config, "requests": len(mine),
                         "tau": sum(r["tokens"] - 1 for r in mine) / steps if steps else None,
                         "tokens_per_s": statistics.median(r["tokens"] / r["seconds"] for r in mine),
                         "speedup": statistics.median(speed), "speedup_range": (min(speed), max(speed)),
                         "identical": sum(r["output_ids"] == b["output_ids"] for r, b in zip(mine, base))})
    return rows


def markdown(doc: dict) -> str:
    lines = ["| constraint | configuration | τ | tokens/s (median) | speed-up vs plain (median, min-max) "
             "| output = plain |", "|---|---|---|---|---|---|"]
    for row in summary(doc):
        tau = "-" if row["tau"] is None else f"{row['tau']:.2f}"
        lo, hi = row["speedup_range"]
        lines.append(f"| {row['constraint']} | {row['config']} | {tau} | {row['tokens_per_s']:.1f} "
                     f"| {row['speedup']:.2f}x ({lo:.2f}-{hi:.2f}) | {row['identical']}/{row['requests']} |")
    m = doc["meta"]
    lines.append(f"\n{m['prompts_per_set']} prompts from each of {', '.join(m['sets'])}, greedy, "
                 f"{m['max_new_tokens']} new tokens, {m['repeats']} repeats, concurrency 1, drafter `{m['drafter']}`; "
                 f"τ counts the bonus token (tokens after the prefill's per verify step); run {m['date']}.")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.from_json:
        doc = json.loads(args.from_json.read_text())
    else:
        doc = run(args)
        args.out.mkdir(parents=True, exist_ok=True)
        (args.out / f"{args.name}.json").write_text(json.dumps(doc, indent=1) + "\n")
    table = markdown(doc)
    if not args.from_json:
        (args.out / f"{args.name}.md").write_text(table + "\n")
    print(table)
    if args.readme:
        spliced = splice_table(args.readme.read_text(), table, MARKERS)
        if spliced is None:
            print(f"{args.readme}: no constrained-table markers; left unchanged", file=sys.stderr)
        else:
            args.readme.write_text(spliced)
    return 0


if __name__ == "__main__":
    sys.exit(main())
