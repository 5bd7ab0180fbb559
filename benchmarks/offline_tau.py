"""Offline accepted length on the evaluation sets: a drafter checkpoint scored on the target's own greedy answers
to the acceptance benchmark's prompts, without a speculative server.

The target answers the first user turn of N prompts per set in ../shared/data/eval (the same prompts and chat
template as benchmarks/acceptance.py; plain server, greedy; the answers are kept in --answers and reused). The
drafter then drafts a block at every answer position, teacher-forced (sgl_dspark.training.rollout, the trainer's
held-out evaluation at stride 1), and two means are reported per set: tau per anchor (every position alike, as in
the trainer's curve) and tau per step (stepping as a server that verifies every drafted token does: what
acceptance.py reports with --dspark-args=--speculative-dspark-budget=off, lookup off). A benchmark, not a test.

    python -m benchmarks.offline_tau --drafter sgl_dspark/drafters/smollm2-135m-instruct --sets humaneval mbpp mt-bench
"""

import argparse
import json
import sys
from dataclasses import asdict
from pathlib import Path

import requests
import torch
from tqdm import tqdm

from benchmarks.acceptance import EVAL_DIR, SETS, load_prompts
from sgl_dspark.drafter.checkpoint import load_drafter
from sgl_dspark.drafter.config import TargetSpec
from sgl_dspark.drafter.model import TargetWeights
from sgl_dspark.tools.launch import ServerSpec, free_port, serving
from sgl_dspark.tools.models import default_drafter, prepare
from sgl_dspark.training.data import Record
from sgl_dspark.training.objective import draft_index
from sgl_dspark.training.rollout import MAX_LEN, TargetCache, clip_record, rollouts, stepped_lengths, summarize
from sgl_dspark.training.target import FrozenTarget


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--drafter", nargs="+", default=None, help="drafter folders (default: the shipped one)")
    p.add_argument("--sets", nargs="+", default=list(SETS), choices=SETS)
    p.add_argument("--prompts", type=int, default=6, help="prompts per set")
    p.add_argument("--max-new-tokens", type=int, default=64)
    p.add_argument("--eval-dir", type=Path, default=EVAL_DIR)
    p.add_argument("--answers", type=Path, default=Path("benchmarks/results/offline-tau-answers.json"),
                   help="the target's answers (written on the first run, reused when they cover the prompts)")
    p.add_argument("--out", type=Path, default=Path("benchmarks/results/offline-tau.json"))
    return p.parse_args(argv)


def answers(model: str, args: argparse.Namespace, tokenizer) -> list[Record]:
    """Prompt + greedy answer ids per prompt, source = its set; from --answers when it holds this exact request."""
    key = {"sets": args.sets, "prompts": args.prompts, "max_new_tokens": args.max_new_tokens}
    if args.answers.is_file():
        kept = json.loads(args.answers.read_text())
        if kept.get("key") == key:
            return [Record(**r) for r in kept["records"]]
    prompts = load_prompts(args.eval_dir, args.sets, args.prompts, tokenizer)
    records = []
    with serving(ServerSpec(model, port=free_port())) as server:
        for p in tqdm(prompts, desc="target answers", unit="req"):
            ids = tokenizer(p.text, add_special_tokens=False)["input_ids"]
            reply = requests.post(f"{server.base_url}/generate", timeout=3600, json={
                "input_ids": ids, "sampling_params": {"temperature": 0, "max_new_tokens": args.max_new_tokens}})
            reply.raise_for_status()
            records.append(Record(p.set_name, ids + reply.json()["output_ids"], len(ids)))
    args.answers.parent.mkdir(parents=True, exist_ok=True)
    args.answers.write_text(json.dumps({"key": key, "records": [asdict(r) for r in records]}) + "\n")
    return records


def score(drafter_path: str, target: FrozenTarget, records: list[Record]) -> dict:
    """Per set: tau per anchor and per step, and the per-position conditional acceptance."""
    spec = TargetSpec.from_hf_config(target.model.config.to_dict())
    drafter = load_drafter(drafter_path, spec, TargetWeights(target.embed.float(), target.lm_head.float())).eval()
    to_draft = draft_index(drafter.draft_to_target, drafter.config.vocab_size)
    cache = TargetCache(target, drafter.config.target_layer_ids, False)
    out = {}
    for name in dict.fromkeys(r.source for r in records):
        examples = [clip_record(r, MAX_LEN) for r in records if r.source == name]
        steps, rolls = [], []
        for ex in tqdm(examples, desc=f"{Path(drafter_path).name} {name}", unit="answer"):
            roll = rollouts(drafter, cache, [ex], to_draft, stride=1)
            steps += stepped_lengths(roll["accepted"], roll["valid"])
            rolls.append(roll)
        merged = {k: torch.cat([r[k] for r in rolls]) for k in ("accepted", "confidence", "valid")}
        merged["source"] = [s for r in rolls for s in r["source"]]
        summary = summarize(merged)
        out[name] = {"tau_per_anchor": round(summary["tau"], 3), "tau_per_step": round(sum(steps) / len(steps), 3),
                     "steps": len(steps), "cond_accept": summary["cond_accept"]}
    return out


def markdown(doc: dict) -> str:
    sets = list(next(iter(doc["drafters"].values())))
    lines = ["| drafter | " + " | ".join(f"{s} per anchor / per step" for s in sets) + " |",
             "|---|" + "---|" * len(sets)]
    for name, by_set in doc["drafters"].items():
        lines.append(f"| {name} | " + " | ".join(
            f"{by_set[s]['tau_per_anchor']:.2f} / {by_set[s]['tau_per_step']:.2f}" for s in sets) + " |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    from transformers import AutoTokenizer

    args = parse_args(argv)
    torch.set_num_threads(1)
    model = str(prepare("float32").path)
    records = answers(model, args, AutoTokenizer.from_pretrained(model))
    target = FrozenTarget(model, torch.bfloat16, "cpu")
    drafters = args.drafter or [default_drafter(model)]
    doc = {"sets": args.sets, "prompts_per_set": args.prompts, "max_new_tokens": args.max_new_tokens,
           "drafters": {d: score(d, target, records) for d in drafters}}
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(doc, indent=1) + "\n")
    print(markdown(doc))
    return 0


if __name__ == "__main__":
    sys.exit(main())
